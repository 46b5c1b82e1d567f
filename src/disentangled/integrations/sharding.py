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
        for source, why in module.tables_read_elsewhere() if hasattr(module, "tables_read_elsewhere") else ():
            if id(source) in names:  # a module above modeling/ says so itself (pretraining's SharedEmbedding)
                found.append((name, names[id(source)], why))
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
