"""Memory per GPU: the training state DDP replicates and FSDP2 / ZeRO-3 divide, for fine-tuning and for RTD
pretraining on DeBERTa's released shapes; `memory_table` writes docs/multi-gpu.md's table
(`python -m disentangled.pretraining.memory` prints it)."""

from __future__ import annotations

import torch

from ..configuration import DisentangledConfig
from ..configuration.configuration_disentangled import V3_FIELDS
from ..modeling import (
    DisentangledForMaskedLM,
    DisentangledForReplacedTokenDetection,
    DisentangledForSequenceClassification,
)
from .objectives import ReplacedTokenDetectionPretraining, generator_config

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
