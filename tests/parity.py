"""Helpers for the parity tests: big seeded weights, padded batches, output and gradient comparison."""

from __future__ import annotations

import copy
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


def packed_inputs(batch: dict) -> dict:
    """The padded batch's sequences packed side by side: [1, T] tokens with their cu_seqlens bounds."""
    lengths = batch["attention_mask"].sum(-1)
    tokens = batch["input_ids"][batch["attention_mask"].bool()][None]  # [1, T]
    return {"input_ids": tokens, "cu_seqlens": torch.cat([torch.zeros(1), lengths.cumsum(0)]).long()}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Largest |a - b|, over the positions where `mask` ([B, L]) is set when given."""
    diff = (a - b).abs()
    if mask is not None:
        diff = diff[mask.bool()]
    return diff.max().item() if diff.numel() else 0.0


def gradient_mismatches(ours: nn.Module, reference_grads: dict[str, torch.Tensor], rtol: float = 1e-4) -> list[str]:
    """Parameters whose gradient differs by more than rtol * max|reference gradient|.

    `reference_grads` maps our parameter names to the reference's gradients, one for every reference parameter;
    parameters only we have (the zero key biases a v1 conversion adds) are not compared. A gradient that is zero in
    exact arithmetic (e.g. a key bias, which softmax cancels) is float noise on both sides; it is compared
    against 1e-3 of the largest gradient of the model instead of its own scale.
    """
    overall = max(g.abs().max().item() for g in reference_grads.values())
    our_grads = {name: p.grad for name, p in ours.named_parameters() if p.grad is not None}
    problems = [f"{name}: no gradient in ours" for name in reference_grads.keys() - our_grads.keys()]
    for name, ref in reference_grads.items():
        if name not in our_grads:
            continue
        scale = max(ref.abs().max().item(), 1e-3 * overall)
        error = (our_grads[name] - ref).abs().max().item()
        if error > rtol * scale + 1e-12:
            problems.append(f"{name}: max error {error:.3g} vs scale {scale:.3g}")
    return problems


TOLERANCE = 1e-5  # float32, relative to the output's scale: |ours - ref| <= 1e-5 * max(1, max|ref|)


def head_inputs(head: str, batch: dict) -> dict:
    inputs = dict(batch)
    if head == "MultipleChoice":  # [B, L] -> [1, B, L]: one question, B choices
        inputs = {k: v.unsqueeze(0) for k, v in inputs.items()}
    return inputs


def outputs_of(head: str, output) -> dict[str, torch.Tensor]:
    if head == "Model":
        return {"last_hidden_state": output.last_hidden_state}
    if head == "QuestionAnswering":
        return {"start_logits": output.start_logits, "end_logits": output.end_logits}
    return {"logits": output.logits}


def real_positions(head: str, name: str, batch: dict) -> torch.Tensor | None:
    if name in ("last_hidden_state", "start_logits", "end_logits") or head in ("MaskedLM", "TokenClassification"):
        return batch["attention_mask"]
    return None  # pooled heads: one value per sequence


def check_parity(reference, ours, head: str, batch: dict, rename_gradients=None) -> dict[str, float]:
    """Outputs at real positions and all parameter gradients; `rename_gradients` maps reference names to ours."""
    inputs = head_inputs(head, batch)
    expected = outputs_of(head, reference(**inputs))
    actual = outputs_of(head, ours(**inputs))
    diffs = {}
    for name, value in expected.items():
        mask = real_positions(head, name, batch)
        diffs[name] = max_abs_diff(actual[name], value, mask) / max(1.0, value.abs().max().item())
        assert torch.isfinite(actual[name]).all(), f"{name} has non-finite values (padded positions included)"
    assert max(diffs.values()) <= TOLERANCE, diffs

    # Gradients of a loss that reads real positions only.
    reference.zero_grad()
    ours.zero_grad()

    def loss_of(outputs):
        total = 0.0
        for name, value in outputs.items():
            mask = real_positions(head, name, batch)
            weights = torch.linspace(-1, 1, value.numel()).view_as(value)  # fixed, non-trivial cotangent
            if mask is not None:
                weights = weights * mask.view(*mask.shape, *([1] * (value.dim() - mask.dim()))).to(value.dtype)
            total = total + (value * weights).sum()
        return total

    loss_of(outputs_of(head, reference(**inputs))).backward()
    loss_of(outputs_of(head, ours(**inputs))).backward()
    reference_grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    if rename_gradients is not None:
        reference_grads = rename_gradients(reference_grads)
    problems = gradient_mismatches(ours, reference_grads, rtol=1e-4)
    assert not problems, problems
    return diffs


def uncached_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` holding no inference cache of position tables (the encoder's normalised rows, each
    layer's projections), so that its first call computes them from its modules as they are now."""
    fresh = copy.deepcopy(model)
    for module in fresh.modules():
        for cache in ("_rel_cache", "_position_cache"):
            if hasattr(module, cache):
                setattr(module, cache, None)
    return fresh
