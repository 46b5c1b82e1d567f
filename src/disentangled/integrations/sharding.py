"""`disentangled pretrain` under FSDP2 and DeepSpeed ZeRO-3 (`accelerate launch --config_file
examples/accelerate/{fsdp2,zero3}.yaml`): what the command adds to Trainer there.

Sharded, no process holds the whole generator and discriminator: FSDP2 keeps a DTensor shard of each parameter, ZeRO-3
an empty placeholder and a flat partition. Saving the two model folders (the discriminator's tables merged with
sg(E_G) + E_delta) needs the whole objective: every process hands its shard in (`full_state_dict`, a collective),
and the main process loads them into an unsharded copy of the objective and saves from it (`unsharded_copy`).

FSDP gathers a unit's parameters for that unit's own forward only. Some of our tables are read by a module other than
their own, outside that table's forward: the encoder reads its relative position table (and its LayerNorm) for every
layer, the MLM head projects onto the word table, and GDES's discriminator reads the generator's word table. A wrap
policy that puts such a table in a unit apart from (and not around) its reader leaves the reader a shard; torch stops
on it with "got mixed torch.Tensor and DTensor". `check_fsdp_wrapping` (run as `WrapCheck` when training starts) says
instead which option puts which table where, and what to set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torch import nn
from transformers import TrainerCallback

from ..configuration.configuration_disentangled import V3_FIELDS

WRAP_FIX = (
    "wrap only the layers: fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP with fsdp_transformer_layer_cls_to_wrap: "
    "DisentangledLayer (DebertaV2Layer for transformers' DeBERTa), as examples/accelerate/fsdp2.yaml does"
)


def is_sharded(trainer) -> bool:
    return bool(trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled)


def full_state_dict(trainer) -> dict | None:
    """The whole model's state dict on the main process (None on the others); every process must call it."""
    if trainer.is_fsdp_enabled:
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        state = trainer.accelerator.get_state_dict(trainer.model)
    else:  # ZeRO-3 gathers each partitioned parameter in turn (zero3_save_16bit_model in the accelerate config)
        state = trainer.accelerator.get_state_dict(trainer.deepspeed)
    return state if trainer.is_world_process_zero() else None


def unsharded_copy(trainer, build: Callable[[], nn.Module]) -> nn.Module | None:
    """On the main process, `build()` (a fresh objective of the same shape) holding the trained weights; None on the
    others. Every process must call it."""
    state = full_state_dict(trainer)
    if state is None:
        return None
    with _outside_zero3():
        module = build()
    module.load_state_dict(state, strict=True)
    return module


@contextlib.contextmanager
def _outside_zero3():
    """Models built here are whole: under ZeRO-3, transformers' `from_pretrained` (`--init-from`) would partition
    them across the processes (a collective that only the main process joins here)."""
    from transformers.integrations import deepspeed

    active = deepspeed._hf_deepspeed_config_weak_ref
    deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = active


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def tables_read_elsewhere(model: nn.Module) -> list[tuple[str, str, str]]:
    """(reader, table, why) for each table of `model` that a module other than its own reads in its forward."""
    from ..modeling.modeling_disentangled import DisentangledEncoder, DisentangledForMaskedLM
    from ..pretraining import SharedEmbedding

    names = {id(module): name for name, module in model.named_modules()}
    found = []
    for name, module in model.named_modules():
        if isinstance(module, DisentangledEncoder):
            for child in ("rel_embeddings", "LayerNorm"):
                if getattr(module, child, None) is not None:
                    found.append((name, _join(name, child), "the relative position table that every layer reads"))
        elif isinstance(module, DisentangledForMaskedLM):
            word_table = _join(name, "deberta.embeddings.word_embeddings")
            found.append((name, word_table, "the word table that the MLM head projects onto"))
        elif isinstance(module, SharedEmbedding) and id(module.source) in names:
            found.append((name, names[id(module.source)], "GDES: the discriminator reads sg(E_G) + E_delta"))
    return found


def check_fsdp_wrapping(model: nn.Module) -> None:
    """ValueError when FSDP's units put a table apart from the module that reads it (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule

    units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]

    def unit_of(name: str) -> str | None:
        around = [unit for unit in units if unit == "" or name == unit or name.startswith(unit + ".")]
        return max(around, key=len) if around else None

    problems = []
    for reader, table, why in tables_read_elsewhere(model):
        table_unit, reader_unit = unit_of(table), unit_of(reader)
        if not table_unit or table_unit == reader_unit or (reader_unit or "").startswith(table_unit + "."):
            continue  # not sharded apart, or gathered around the reader's forward (a reader in no unit is reported)
        problems.append(
            f"{table} ({why}) is an FSDP unit of its own ({table_unit}), apart from {reader or 'the model'}"
        )
    if problems:
        raise ValueError(
            "the FSDP wrap policy (fsdp_auto_wrap_policy / fsdp_transformer_layer_cls_to_wrap in the accelerate config) "
            f"separates tables from the modules that read them: {'; '.join(problems)}. Fix: {WRAP_FIX}"
        )


class WrapCheck(TrainerCallback):
    """`check_fsdp_wrapping` on the sharded model when training starts (Trainer has wrapped it by then)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            check_fsdp_wrapping(model)


# ----------------------------------------------------------------------------------------------------------------------
# Memory per GPU: the training state DDP replicates and FSDP2 / ZeRO-3 divide (docs/multi-gpu.md)

V3_SHAPE = dict(V3_FIELDS, vocab_size=128100, legacy=False)
SHAPES = {
    "deberta-v3-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "deberta-v3-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "deberta-v2-xxlarge": dict(
        hidden_size=1536, num_hidden_layers=48, num_attention_heads=24, intermediate_size=6144, attention_head_size=64,
        conv_kernel_size=3, conv_act="gelu",
    ),
}  # fmt: skip
# Bytes per parameter with Adam: float32 parameters (FSDP2's sharded parameters; ZeRO-3's master copy), float32
# gradients, Adam's two float32 moments. bf16 mixed precision keeps these (and adds transient half-precision copies).
STATE_BYTES = {"parameters": 4, "gradients": 4, "Adam states": 8}


def training_parameters(shape: str, job: str) -> tuple[int, int]:
    """(parameters trained, parameters of the largest unit FSDP gathers: one layer) of `job` on `shape`:
    "fine-tuning" (sequence classifier) or "RTD" (discriminator + a generator of half the depth, GDES's E_delta).
    Counted on the meta device: nothing is allocated."""
    import torch

    from ..configuration import DisentangledConfig
    from ..modeling import DisentangledForMaskedLM, DisentangledForSequenceClassification
    from ..modeling.modeling_disentangled import DisentangledForReplacedTokenDetection
    from ..pretraining import ReplacedTokenDetectionPretraining, generator_config

    config = DisentangledConfig(**V3_SHAPE, **SHAPES[shape])
    with torch.device("meta"):
        if job == "fine-tuning":
            model = DisentangledForSequenceClassification(config)
        else:
            generator = DisentangledForMaskedLM(generator_config(config))
            model = ReplacedTokenDetectionPretraining(generator, DisentangledForReplacedTokenDetection(config))
    layer = next(module for module in model.modules() if type(module).__name__ == "DisentangledLayer")
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in layer.parameters())


def memory_per_gpu(parameters: int, gpus: int, sharded: bool) -> dict[str, float]:
    """Bytes of training state on each GPU, by kind: the whole of it under DDP, a 1/gpus share sharded."""
    share = 1 / gpus if sharded else 1.0
    return {kind: parameters * size * share for kind, size in STATE_BYTES.items()}


def memory_table(gpus: tuple[int, ...] = (2, 8)) -> str:
    """The manual's table: GB (10^9 bytes) of parameters + gradients + Adam states per GPU."""

    def cell(parameters: int, count: int, sharded: bool) -> str:
        parts = memory_per_gpu(parameters, count, sharded)
        return f"{sum(parts.values()) / 1e9:.1f} ({' + '.join(f'{value / 1e9:.1f}' for value in parts.values())})"

    header = ["model, job", "parameters", "DDP, any number of GPUs"]
    header += [f"FSDP2 / ZeRO-3, {count} GPUs" for count in gpus] + ["one layer gathered (float32)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for shape in SHAPES:
        for job in ("fine-tuning", "RTD"):
            if job == "RTD" and shape == "deberta-v2-xxlarge":
                continue  # v2 was pretrained with MLM
            parameters, layer = training_parameters(shape, job)
            row = [f"{shape}, {job}", f"{parameters / 1e6:,.0f} M", cell(parameters, 1, False)]
            row += [cell(parameters, count, True) for count in gpus] + [f"{layer * 4 / 1e6:.0f} MB"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(memory_table())
