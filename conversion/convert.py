"""DeBERTa checkpoint -> a self-contained Hub folder of this architecture, verified against transformers.

In order: `canonical_checkpoint` (any source layout -> transformers' own DeBERTa layout and config),
`convert_config`, `convert_state_dict` (rename every key, assert every shape), strict loads, `export_hub_folder`
(config.json with auto_map, safetensors, tokenizer, the flat remote code), then parity (`load_bundled`, `compare`):
the source through transformers' classes and the folder through its bundled remote code, on the same fixed
padded batch. For the heads transformers has no class for (the Enhanced Mask Decoder, replaced-token detection),
`heads.compare_head` checks the encoder against transformers' base model and recomputes the head from the source
weights. `convert` runs them all and moves the folder into place only when every step passed.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch import Tensor, nn

from .bundle import auto_map, write_bundle
from .deberta_v1 import convert_v1_state_dict
from .heads import compare_head
from .model_card import write_model_card
from .sources import SUPPORTED_MODEL_TYPES, Source, read_source
from .tasks import DTYPES, POSITION_TABLE, TASKS, TOLERANCE, TRANSFORMERS_PREFIX

NO_TRANSFORMERS_CLASS = ("replaced-token-detection",)  # and masked-lm with the Enhanced Mask Decoder
# Gradient-disentangled embedding sharing (DeBERTa-v3) saves the discriminator's delta beside the merged table.
GDES_DELTAS = ("deberta.embeddings.word_embeddings._weight", "deberta.embeddings.position_embeddings._weight")

# Source key -> transformers key; first match wins. Microsoft's package prefixes its encoder with "bert." or
# "deberta.", or not at all; its MLM head (`lm_predictions.lm_head.*`) is already DeBERTa-v3's legacy=False layout.
RENAMES = [
    (r"^bert\.", "deberta."),  # Microsoft, older checkpoints
    (r"^(embeddings|encoder)\.", r"deberta.\1."),  # Microsoft without prefix, or a transformers base model
    (r"^mask_predictions\.classifer\.", "mask_predictions.classifier."),  # the spelling of Microsoft's RTD code
    (r"^(.*)$", r"\1"),  # transformers' keys (and the v2 -> ours map) are identities
]
UNUSED_BUFFERS = re.compile(r"(^|\.)position_ids$")


def rename_key(key: str) -> str:
    for pattern, replacement in RENAMES:
        new_key, hits = re.subn(pattern, replacement, key)
        if hits:
            return new_key
    raise KeyError(f"no conversion rule for checkpoint key {key!r}")


# ----------------------------------------------------------------------------------------------------------------
# Any source -> transformers' DeBERTa layout


@dataclass
class Checkpoint:
    """A checkpoint in transformers' layout: model_type, config dict, tensors under `deberta.` + head keys."""

    model_type: str  # "deberta" or "deberta-v2"
    config: dict
    state_dict: dict[str, Tensor]
    task: str
    not_needed: list[str] = field(default_factory=list)  # source tensors the converted model has no use for
    notes: list[str] = field(default_factory=list)  # what the converter decided, for the log

    @property
    def enhanced_mask_decoder(self) -> bool:
        return bool(self.config.get("enhanced_mask_decoder"))

    @property
    def has_transformers_class(self) -> bool:
        return self.task not in NO_TRANSFORMERS_CLASS and not self.enhanced_mask_decoder


def _is_v1(state_dict: dict) -> bool:
    return any(key.endswith("attention.self.in_proj.weight") for key in state_dict)


def task_of(config: dict, state_dict: dict) -> str:
    """The head named by `architectures`; without one, the MLM head when its weights are there, the RTD head when
    its weights are the only head weights (a DeBERTa-v3 discriminator), else the base model."""
    for architecture in config.get("architectures") or []:
        match = re.fullmatch(r"Deberta(?:V2)?(Model|For\w+)", architecture)
        for task, head in TASKS.items():
            if match and match[1] == head.suffix:
                return task
    if any(key.startswith(("lm_predictions.lm_head.", "cls.predictions.")) for key in state_dict):
        return "masked-lm"
    if any(key.startswith("mask_predictions.") for key in state_dict):
        return "replaced-token-detection"
    return "base"


def canonical_checkpoint(source: Source, task: str | None = None, enhanced_mask_decoder: bool = False) -> Checkpoint:
    """The source as transformers would hold it (Microsoft's config fields and key prefixes normalised).

    Microsoft's own masked-LM checkpoints (`lm_predictions.*` in their package's layout, and their generators) were
    trained with the Enhanced Mask Decoder and convert with it; `enhanced_mask_decoder` asks for it on any masked-LM
    source that has the absolute position table.
    """
    state_dict = {rename_key(key): value for key, value in source.state_dict.items() if not UNUSED_BUFFERS.search(key)}
    not_needed = _drop_gdes_deltas(state_dict)
    notes: list[str] = []
    config = dict(source.config)
    if source.layout == "microsoft":
        config = _microsoft_config(config, state_dict)
    model_type = config["model_type"]
    if model_type == "deberta-v2":
        from disentangled.configuration.configuration_disentangled import DEBERTA_V2_ABSENT_DEFAULTS

        config = {**DEBERTA_V2_ABSENT_DEFAULTS, **config}
    if source.generator:
        if task not in (None, "masked-lm"):
            raise ValueError(f"a generator is a masked-LM model; --task {task} does not apply to it")
        task = "masked-lm"
    task = task or task_of(config, state_dict)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if task == "masked-lm":
        config["legacy"] = _mlm_layout_is_legacy(state_dict)
    microsoft_mlm = task == "masked-lm" and not config["legacy"] and (source.layout == "microsoft" or source.generator)
    if microsoft_mlm and POSITION_TABLE not in state_dict:  # older releases of their package kept no table
        microsoft_mlm = False
        notes.append(f"no {POSITION_TABLE} in the source: converted without the Enhanced Mask Decoder")
    if enhanced_mask_decoder or microsoft_mlm:
        _require_decoder_weights(task, config, state_dict, source.name)
        config["enhanced_mask_decoder"] = True
    elif not config.get("position_biased_input", True):  # the table only the decoder reads
        if state_dict.pop(POSITION_TABLE, None) is not None:
            not_needed.append(POSITION_TABLE)
    if task in ("sequence-classification", "token-classification", "multiple-choice"):
        _fit_num_labels(config, state_dict)
    config["architectures"] = [TRANSFORMERS_PREFIX[model_type] + TASKS[task].suffix]
    return Checkpoint(model_type, config, state_dict, task, not_needed, notes)


def _drop_gdes_deltas(state_dict: dict) -> list[str]:
    """Remove GDES's embedding deltas (`E_delta`, saved as `_weight`) where the merged table is there; refuse
    a checkpoint that has a delta without its merged table (the delta alone is not the embedding)."""
    dropped = []
    for delta in GDES_DELTAS:
        if delta not in state_dict:
            continue
        merged = delta.removesuffix("._weight") + ".weight"
        if merged not in state_dict:
            raise ValueError(
                f"the checkpoint has the embedding-sharing delta {delta} but not the merged table {merged}; "
                "save the discriminator with its merged embeddings (E_generator + E_delta) and convert that"
            )
        del state_dict[delta]
        dropped.append(delta)
    return dropped


def _require_decoder_weights(task: str, config: dict, state_dict: dict, name: str) -> None:
    if task != "masked-lm":
        raise ValueError(f"--enhanced-mask-decoder applies to the masked-lm task, not {task}")
    if config["legacy"]:
        raise ValueError(
            "the Enhanced Mask Decoder feeds DeBERTa's own MLM head (lm_predictions.lm_head.*); this source has "
            "transformers' cls.predictions head instead: convert without --enhanced-mask-decoder"
        )
    if POSITION_TABLE not in state_dict:
        raise ValueError(
            f"the Enhanced Mask Decoder reads the absolute position table, and {name} has no {POSITION_TABLE}; "
            "convert without --enhanced-mask-decoder"
        )


def _microsoft_config(config: dict, state_dict: dict) -> dict:
    """Microsoft's model_config.json in transformers' terms; an absent field keeps their code's default."""
    config = {key: value for key, value in config.items() if not isinstance(value, dict)}  # e.g. "pooling"
    if "padding_idx" in config:
        config["pad_token_id"] = config.pop("padding_idx")
    config["model_type"] = "deberta" if _is_v1(state_dict) else "deberta-v2"
    word_embeddings = state_dict.get("deberta.embeddings.word_embeddings.weight")
    if word_embeddings is not None and int(config.get("vocab_size", -1)) <= 0:
        config["vocab_size"] = word_embeddings.shape[0]
    return config


def _mlm_layout_is_legacy(state_dict: dict) -> bool:
    if any(key.startswith("lm_predictions.lm_head.") for key in state_dict):
        return False
    if any(key.startswith("cls.predictions.") for key in state_dict):
        return True
    raise ValueError("the masked-lm task needs MLM head weights (lm_predictions.lm_head.* or cls.predictions.*)")


def _fit_num_labels(config: dict, state_dict: dict) -> None:
    classifier = state_dict.get("classifier.weight")
    if classifier is not None and "id2label" not in config and "num_labels" not in config:
        config["num_labels"] = classifier.shape[0]


def reference_class(checkpoint: Checkpoint) -> type[nn.Module]:
    """transformers' class for the checkpoint's head, or its base model where transformers has no such head."""
    task = checkpoint.task if checkpoint.has_transformers_class else "base"
    return transformers_class(checkpoint.model_type, task)


def transformers_class(model_type: str, task: str) -> type[nn.Module]:
    name = TRANSFORMERS_PREFIX[model_type] + TASKS[task].suffix
    if not hasattr(transformers, name):
        raise ValueError(f"transformers has no {name}: the {task} head is not available for {model_type} sources")
    return getattr(transformers, name)


def transformers_config(checkpoint: Checkpoint):
    config_class = transformers.DebertaConfig if checkpoint.model_type == "deberta" else transformers.DebertaV2Config
    fields = {k: v for k, v in checkpoint.config.items() if k not in ("model_type", "transformers_version", "auto_map")}
    return config_class.from_dict(fields)


# ----------------------------------------------------------------------------------------------------------------
# transformers' layout -> ours


def convert_config(checkpoint: Checkpoint):
    """Our config for the checkpoint: v1 fields mapped explicitly, v2 fields with DebertaV2's meaning."""
    from disentangled.configuration import DisentangledConfig
    from disentangled.configuration.configuration_disentangled import deberta_v1_fields

    config = transformers_config(checkpoint).to_dict()
    for key in ("model_type", "transformers_version", "auto_map", "architectures", "torch_dtype", "dtype"):
        config.pop(key, None)
    if checkpoint.model_type == "deberta":
        config = deberta_v1_fields(config)
    config["architectures"] = ["Disentangled" + TASKS[checkpoint.task].suffix]
    return DisentangledConfig(**config)


def convert_state_dict(checkpoint: Checkpoint, config) -> dict[str, Tensor]:
    """Rename every key to ours (v1: split the fused in_proj head by head)."""
    state_dict = checkpoint.state_dict
    if checkpoint.model_type == "deberta":
        state_dict = convert_v1_state_dict(state_dict, config.num_attention_heads)
    return {rename_key(key): value for key, value in state_dict.items()}


def fit_to_model(model: nn.Module, state_dict: dict[str, Tensor], what: str) -> dict[str, Tensor]:
    """The tensors `model` takes, under its own names, shapes checked; head weights it has no use for are dropped.

    A base model (no `deberta.` prefix) takes the encoder keys without their prefix. Missing keys are allowed only
    where the model ties them to a key that is present (a legacy MLM decoder and the word embeddings).
    """
    expected = model.state_dict()
    has_prefix = any(key.startswith("deberta.") for key in expected)
    fitted = {}
    for key, value in state_dict.items():
        name = key if has_prefix else key.removeprefix("deberta.")
        if name in expected:
            fitted[name] = value
        elif key.startswith("deberta.") and not key.endswith("embeddings.position_embeddings.weight"):
            raise ValueError(f"weights do not fit the config: {what} has no parameter {name!r}")
    tied = _tied_groups(model)
    missing = [name for name in expected if name not in fitted and not (tied.get(name, set()) & fitted.keys())]
    if missing:
        raise ValueError(
            f"weights do not fit the config: {len(missing)} {what} tensors missing from the checkpoint, "
            f"e.g. {', '.join(missing[:3])}"
        )
    wrong = [
        f"{name} {tuple(value.shape)} vs {tuple(expected[name].shape)}"
        for name, value in fitted.items()
        if value.shape != expected[name].shape
    ]
    if wrong:
        raise ValueError(f"weights do not fit the config: shape mismatch {'; '.join(wrong[:3])} (checkpoint vs config)")
    return fitted


def _tied_groups(model: nn.Module) -> dict[str, set[str]]:
    """name -> the other names of the same tensor (tied parameters share storage)."""
    by_pointer: dict[int, set[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_pointer.setdefault(tensor.data_ptr(), set()).add(name)
    return {name: names - {name} for names in by_pointer.values() for name in names}


def load_strict(model: nn.Module, state_dict: dict[str, Tensor], what: str) -> nn.Module:
    fitted = fit_to_model(model, state_dict, what)
    with torch.no_grad():
        result = model.load_state_dict(fitted, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"weights do not fit the config: unexpected {result.unexpected_keys[:3]}")
    return model.eval()


def dropped_keys(model: nn.Module, state_dict: dict[str, Tensor]) -> list[str]:
    expected = model.state_dict()
    has_prefix = any(key.startswith("deberta.") for key in expected)
    return sorted(k for k in state_dict if (k if has_prefix else k.removeprefix("deberta.")) not in expected)


# ----------------------------------------------------------------------------------------------------------------
# The Hub folder


def export_hub_folder(model: nn.Module, folder: Path, max_shard_size: str = "5GB") -> list[str]:
    """config.json (model_type disentangled, architectures, auto_map), safetensors weights and the flat remote code."""
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = auto_map()
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return write_bundle(folder)


def load_bundled(folder: Path, class_name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """`class_name` from the folder's own remote code, as `trust_remote_code=True` loads it (never the package)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    reference = json.loads((folder / "config.json").read_text())["auto_map"]
    entry = next(value for value in reference.values() if value.endswith("." + class_name))
    model_class = get_class_from_dynamic_module(entry, str(folder))
    if model_class.__module__.split(".")[0] == "disentangled":
        raise ValueError(f"{class_name} came from the installed package, not from the folder's remote code")
    return model_class.from_pretrained(folder, dtype=dtype).eval()


# ----------------------------------------------------------------------------------------------------------------
# Parity


def fixed_batch(vocab_size: int, max_positions: int, multiple_choice: bool = False, pad_id: int = 0) -> dict:
    """Two sequences, padded; the longer one passes 256 tokens when the model allows, to reach the log buckets."""
    longest = min(300, max_positions)
    lengths = [longest, max(1, longest * 4 // 7)]
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.full((2, longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((2, longest), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(min(5, vocab_size - 1), vocab_size, (length,), generator=generator)
        attention_mask[row, :length] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if multiple_choice:  # one question, two choices: [1, 2, L]
        batch = {key: value.unsqueeze(0) for key, value in batch.items()}
    return batch


def named_outputs(output) -> dict[str, Tensor]:
    names = ("last_hidden_state", "logits", "start_logits", "end_logits")
    return {name: getattr(output, name) for name in names if getattr(output, name, None) is not None}


def compare(reference: nn.Module, ours: nn.Module, batch: dict) -> dict[str, dict[str, float]]:
    """max |ours - reference| per output at real (non-padded) positions, and the reference's scale."""
    with torch.no_grad():
        expected = named_outputs(reference(**batch))
        actual = named_outputs(ours(**batch))
    mask = batch["attention_mask"].reshape(-1, batch["attention_mask"].shape[-1]).bool()
    figures = {}
    for name, value in expected.items():
        got = actual[name].float()
        if not torch.isfinite(got).all():
            raise ValueError(f"{name}: the converted model produced NaN or inf")
        diff = (got - value.float()).abs()
        if diff.shape[:2] == mask.shape:  # per-token outputs: real positions only
            diff = diff[mask]
        figures[name] = {"max_abs_diff": diff.max().item(), "max_abs_reference": value.abs().max().item()}
    return figures


def within_tolerance(figures: dict[str, dict[str, float]], tolerance: float = TOLERANCE) -> bool:
    return all(f["max_abs_diff"] <= tolerance * max(1.0, f["max_abs_reference"]) for f in figures.values())


def format_figures(figures: dict[str, dict[str, float]], tolerance: float = TOLERANCE) -> str:
    return "; ".join(
        f"{name}: max |diff| {f['max_abs_diff']:.2e} (tolerance {tolerance * max(1.0, f['max_abs_reference']):.1e})"
        for name, f in figures.items()
    )


# ----------------------------------------------------------------------------------------------------------------
# The whole conversion


@dataclass
class ConversionResult:
    output_dir: Path
    task: str
    model_type: str
    figures: dict[str, dict[str, float]] | None
    files: list[str]


def check_output(output_dir: Path, force: bool, source_folder: Path | None = None) -> Path:
    """The absolute output folder, after refusing what must not be written or replaced.

    A non-empty folder is replaced only with `force`, and only when it is a model folder (it holds a
    config.json): `--force` never wipes an arbitrary folder such as a home directory. The source folder and
    any folder that contains it are never an output.
    """
    output_dir = Path(output_dir).expanduser().absolute()
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"output {output_dir} exists and is not a folder")
    if source_folder is not None:
        source_folder = Path(source_folder).expanduser().absolute()
        if output_dir == source_folder or output_dir in source_folder.parents:
            raise ValueError(f"output folder {output_dir} holds the source {source_folder}; choose another output")
    if output_dir.is_dir() and any(output_dir.iterdir()):
        if not force:
            raise FileExistsError(f"output folder {output_dir} is not empty; pass --force to replace it")
        if not (output_dir / "config.json").is_file():
            raise FileExistsError(
                f"output folder {output_dir} is not empty and is not a model folder (no config.json); "
                "--force replaces only a model folder, so choose another output"
            )
    return output_dir


def prepare_output(output_dir: Path, force: bool, source_folder: Path | None = None) -> Path:
    """A fresh staging folder next to `output_dir`, named like it (its remote code is cached under that name)."""
    output_dir = check_output(output_dir, force, source_folder)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent)) / output_dir.name
    staging.mkdir()
    return staging


def move_into_place(staging: Path, output_dir: Path) -> None:
    output_dir = Path(output_dir).expanduser().absolute()
    if output_dir.exists():
        shutil.rmtree(output_dir)
    staging.rename(output_dir)
    shutil.rmtree(staging.parent, ignore_errors=True)


def convert(
    source: str,
    output_dir: str | Path,
    *,
    task: str | None = None,
    enhanced_mask_decoder: bool = False,
    generator: bool = False,
    revision: str | None = None,
    token: str | None = None,
    dtype: str = "float32",
    max_shard_size: str = "5GB",
    verify: bool = True,
    force: bool = False,
    repo_id: str | None = None,
    log=print,
) -> ConversionResult:
    """Convert `source` (a folder or Hub repo id) into `output_dir`; raises ValueError when parity fails.

    `generator` reads Microsoft's generator (`pytorch_model.generator.bin`, `generator_config.json`) instead of the
    discriminator; `enhanced_mask_decoder` converts a masked-LM source with the decoder (see `canonical_checkpoint`).
    """
    from disentangled import modeling

    from .tokenizer_files import copy_tokenizer

    local_source = Path(source).expanduser()
    output_dir = check_output(output_dir, force, local_source if local_source.is_dir() else None)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}")
    read = read_source(source, revision=revision, token=token, generator=generator)
    checkpoint = canonical_checkpoint(read, task, enhanced_mask_decoder)
    head = TASKS[checkpoint.task]
    decoder = ", with the Enhanced Mask Decoder" if checkpoint.enhanced_mask_decoder else ""
    log(
        f"source: {source} ({read.layout} layout{', generator' if read.generator else ''}, model_type "
        f"{checkpoint.model_type}, {SUPPORTED_MODEL_TYPES[checkpoint.model_type]}), head {checkpoint.task}{decoder}, "
        f"weights {', '.join(read.weight_files)}"
    )
    for note in checkpoint.notes:
        log(note)
    if checkpoint.not_needed:
        log(f"not needed (merged tables or an unused absolute table are converted instead): {checkpoint.not_needed}")

    # The reference: transformers' own class on the source weights, rounded to the output dtype first so that
    # the parity check measures the code, not the rounding. Heads transformers lacks: its base model (heads.py).
    reference_config = transformers_config(checkpoint)
    reference = reference_class(checkpoint)(reference_config)
    rounded = {k: v.to(DTYPES[dtype]).float() if v.is_floating_point() else v for k, v in checkpoint.state_dict.items()}
    load_strict(reference, rounded, f"transformers' {type(reference).__name__}")
    del rounded

    config = convert_config(checkpoint)
    ours = getattr(modeling, "Disentangled" + head.suffix)(config)
    converted = convert_state_dict(checkpoint, config)
    load_strict(ours, converted, type(ours).__name__)
    if dropped := dropped_keys(ours, converted):
        log(f"not converted (unused by the {checkpoint.task} head): {_summarise(dropped)}")
    del converted
    if dtype != "float32":
        ours = ours.to(DTYPES[dtype])

    staging = prepare_output(output_dir, force, read.folder)
    try:
        export_hub_folder(ours, staging, max_shard_size=max_shard_size)
        del ours
        copy_tokenizer(read, checkpoint.model_type, staging, log=log)
        figures = None
        batch = fixed_batch(config.vocab_size, config.max_position_embeddings, head.suffix == "ForMultipleChoice")
        if verify:
            bundled = load_bundled(staging, "Disentangled" + head.suffix)
            if checkpoint.has_transformers_class:
                figures = compare(reference, bundled, batch)
            else:
                figures = compare_head(checkpoint.task, reference, bundled, config, checkpoint.state_dict, batch, dtype)
            log(f"parity (transformers {transformers.__version__}, float32): {format_figures(figures)}")
            if not within_tolerance(figures):
                raise ValueError(f"parity check failed: {format_figures(figures)}")
        else:
            log("WARNING: --no-verify: the converted model was NOT compared with transformers' DeBERTa")
        lengths = batch["attention_mask"].reshape(-1, batch["attention_mask"].shape[-1]).sum(-1).tolist()
        write_model_card(
            staging,
            read,
            checkpoint,
            figures,
            dtype=dtype,
            repo_id=repo_id or f"./{output_dir.name}",
            batch_lengths=" and ".join(map(str, lengths)),
        )
        move_into_place(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging.parent, ignore_errors=True)
        raise
    files = sorted(p.name for p in output_dir.iterdir())
    log(f"wrote {output_dir}: {', '.join(files)}")
    return ConversionResult(output_dir, checkpoint.task, checkpoint.model_type, figures, files)


def _summarise(keys: list[str]) -> str:
    prefixes = sorted({".".join(key.split(".")[:2]) for key in keys})
    return f"{len(keys)} tensors ({', '.join(prefixes)})"
