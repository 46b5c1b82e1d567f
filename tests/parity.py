"""Helpers for the parity tests: big seeded weights, padded batches, output and gradient comparison."""

from __future__ import annotations

import math

import torch
from torch import nn


def inflate_weights(model: nn.Module, seed: int = 0) -> None:
    """N(0, 1/fan_in) linears, N(0, 1) embeddings (relative ones included), random LayerNorms and biases.

    The default init gives near-uniform attention, under which a wrong position term can hide.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2 and "embeddings" not in name:
                fan_in = param.shape[1] * (param.shape[2] if param.dim() > 2 else 1)
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
            elif param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator))
            elif "LayerNorm.weight" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def padded_batch(vocab_size: int, lengths: list[int], seed: int = 0, pad_id: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    input_ids = torch.full((len(lengths), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), longest), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(1, vocab_size, (length,), generator=generator)
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Largest |a - b|, over the positions where `mask` ([B, L]) is set when given."""
    diff = (a - b).abs()
    if mask is not None:
        diff = diff[mask.bool()]
    return diff.max().item() if diff.numel() else 0.0


def gradient_mismatches(ours: nn.Module, reference: nn.Module, rtol: float = 1e-4) -> list[str]:
    """Parameters whose gradient differs by more than rtol * max|reference gradient| (same names in both).

    A gradient that is zero in exact arithmetic (e.g. the c2p key bias, which softmax cancels) is float noise
    on both sides; it is compared against 1e-3 of the largest gradient of the model instead of its own scale.
    """
    reference_params = dict(reference.named_parameters())
    overall = max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
    problems = []
    for name, param in ours.named_parameters():
        ref = reference_params[name]
        if ref.grad is None and param.grad is None:
            continue
        if (ref.grad is None) != (param.grad is None):
            problems.append(f"{name}: gradient present on one side only")
            continue
        scale = max(ref.grad.abs().max().item(), 1e-3 * overall)
        error = (param.grad - ref.grad).abs().max().item()
        if error > rtol * scale + 1e-12:
            problems.append(f"{name}: max error {error:.3g} vs scale {scale:.3g}")
    return problems
