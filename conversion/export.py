"""A converted folder -> transformers' native DeBERTa-v2 format (no remote code), verified the same way as `convert`.

Parameter names are already DeBERTa-v2's, so the weights map one to one; the config drops `auto_map` and names
transformers' classes. Every field this architecture reads has a DeBERTa-v2 meaning except the optional `p2p` term,
and transformers has no class for DeBERTa's replaced-token-detection head or its Enhanced Mask Decoder: such a folder
exports with `task="base"`, the encoder alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import transformers

from .convert import (
    TASKS,
    compare,
    fixed_batch,
    format_figures,
    load_strict,
    move_into_place,
    prepare_output,
    rename_key,
    within_tolerance,
)
from .sources import TOKENIZER_FILES, load_weights, resolve_folder

OPTIONAL = ("embedding_size", "attention_head_size", "pooler_hidden_size", "cls_dropout")
DROPPED_FIELDS = (
    "model_type",
    "auto_map",
    "architectures",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "enhanced_mask_decoder",  # no DeBERTa-v2 meaning (see refuse_unrepresentable)
)


def task_of_architecture(architecture: str) -> str:
    for task, head in TASKS.items():
        if architecture == "Disentangled" + head.suffix:
            return task
    raise ValueError(f"unknown architecture {architecture!r} in config.json")


def deberta_v2_config(config: dict) -> transformers.DebertaV2Config:
    from disentangled import DisentangledConfig

    ours = DisentangledConfig.from_dict({k: v for k, v in config.items() if k != "auto_map"})
    if "p2p" in ours.pos_att_type:
        raise ValueError("the p2p attention term has no DeBERTa-v2 equivalent; this model cannot be exported")
    # DeBERTa-v2 reads getattr(config, name, default): a field we leave at None must be absent there.
    fields = {k: v for k, v in ours.to_dict().items() if k not in DROPPED_FIELDS and not (k in OPTIONAL and v is None)}
    return transformers.DebertaV2Config(**fields)


def refuse_unrepresentable(task: str, config: dict) -> None:
    if task == "replaced-token-detection":
        raise ValueError(
            "transformers has no class for DeBERTa's replaced-token-detection head (mask_predictions); "
            "export the encoder alone with --task base"
        )
    if task == "masked-lm" and config.get("enhanced_mask_decoder"):
        raise ValueError(
            "transformers' DeBERTa-v2 masked-LM head reads the last layer, not the Enhanced Mask Decoder "
            "(enhanced_mask_decoder=True), and would predict differently; export the encoder alone with --task base"
        )


def export_transformers(
    folder: str | Path,
    hf_dir: str | Path,
    *,
    revision: str | None = None,
    task: str | None = None,
    verify: bool = True,
    force: bool = False,
    log=print,
) -> dict | None:
    """`task="base"` exports the encoder alone; otherwise the folder's own head."""
    from disentangled import modeling

    source_folder, _ = resolve_folder(str(folder), revision)
    config_path = source_folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{source_folder} has no config.json")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "disentangled":
        raise ValueError(
            f"{source_folder} is not a disentangled model folder (model_type {config.get('model_type')!r})"
        )
    folder_task = task_of_architecture((config.get("architectures") or ["DisentangledModel"])[0])
    if task is None:
        refuse_unrepresentable(folder_task, config)
    task = task or folder_task
    head = TASKS[task]
    v2_config = deberta_v2_config(config)
    v2_config.architectures = ["DebertaV2" + head.suffix]
    state_dict, _ = load_weights(source_folder)
    reference = getattr(transformers, "DebertaV2" + head.suffix)(v2_config)
    load_strict(reference, {rename_key(k): v.float() for k, v in state_dict.items()}, type(reference).__name__)
    dtype = next(iter(state_dict.values())).dtype

    staging = prepare_output(Path(hf_dir), force, source_folder)
    try:
        reference.to(dtype).save_pretrained(staging)
        for name in TOKENIZER_FILES:
            if (source_folder / name).is_file():
                shutil.copyfile(source_folder / name, staging / name)
        figures = None
        if verify:
            exported = getattr(transformers, f"AutoModel{'' if task == 'base' else head.suffix}")
            native = exported.from_pretrained(staging, dtype="float32").eval()
            if type(native).__module__.split(".")[0] != "transformers":
                raise ValueError(f"the exported folder did not load with transformers' own classes ({type(native)})")
            ours = (
                getattr(modeling, "Disentangled" + head.suffix).from_pretrained(source_folder, dtype="float32").eval()
            )
            batch = fixed_batch(
                v2_config.vocab_size, v2_config.max_position_embeddings, head.suffix == "ForMultipleChoice"
            )
            figures = compare(native, ours, batch)
            log(f"parity ({type(native).__name__} vs Disentangled{head.suffix}): {format_figures(figures)}")
            if not within_tolerance(figures):
                raise ValueError(f"parity check failed: {format_figures(figures)}")
        else:
            log("WARNING: --no-verify: the exported model was NOT compared with the converted one")
        move_into_place(staging, Path(hf_dir))
    except BaseException:
        shutil.rmtree(staging.parent, ignore_errors=True)
        raise
    log(f"wrote {Path(hf_dir).absolute()} (transformers DebertaV2{head.suffix}, no remote code)")
    return figures
