"""The sdpa backend: `sdpa_disentangled` runs the path `dispatch.decide` names from its table of runners (`RUNNERS`,
keyed by `dispatch.PATHS`' names), each in the file of its path: cpu-fused, cpu-bias-kernel and cpu-by-distance in
`cpu_inference.py`, cpu-training-kernel and cpu-training in `cpu_training.py`, onnx-fused in `onnx_fused.py`
(onnx-kernel's writer comes with its export, `dispatch.onnx_graph`), triton's kernel in `triton_attention.py` (its
runner is here, as it falls back to sdpa-blocked), and this file's own two: sdpa-dense
(`torch.nn.functional.scaled_dot_product_attention` with the position terms and the mask as one dense additive bias,
which a traced graph can hold; also onnx-portable) and sdpa-blocked (the same, one block of query rows at a time, keys
reversed: `blocks.py`; accelerators, p2p, and where the Triton kernel cannot serve). Which path serves a call is
`dispatch.decide`'s, asked once per call; this file only runs what it says.

In `modeling/`'s layering (`__init__.py`): layer 2, a PyTorch backend over layer 1's tables; it calls layers 3 and 4.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from .blocks import _block_bias, _tiles
from .cpu_inference import _run_by_distance, _run_cpu_fused
from .cpu_training import _run_cpu_training
from .disentangled_attention import (
    PositionScores,
    _block_mask,
    _masked_scores,
    p2c_by_row,
    position_table,
)
from .dispatch import (
    FAILED_CHECK,
    Decision,
    blocked_instead,
    call_facts,
    decide,
    kernel_check,
    log_fallback,
    onnx_graph_asked,
)
from .onnx_fused import fused_attention
from .triton_attention import KernelLaunchError, launch_failed, triton_disentangled
from .validation import is_tracing


def sdpa_disentangled(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_scores: PositionScores | None = None,
    block_elements: int | None = None,
    decision: Decision | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The sdpa implementation: runs the path `decision` names (`RUNNERS`), the layer's, which `dispatch.decide` made
    once for the call; a caller from elsewhere (transformers' attention interface, a benchmark) passes none, and the
    call is decided here. `block_elements` bounds the bias of a block of query rows on the blocked paths.
    """
    if decision is None:
        decision = decide(call_facts(query, key, value, attention_mask, position_scores, dropout))
    log_fallback(decision)
    run = RUNNERS[decision.path]
    return run(decision, module, query, key, value, attention_mask, scaling, dropout, position_scores, block_elements)


# Each runner: (decision, module, query, key, value, attention_mask, scaling, dropout, position_scores,
# block_elements) -> (context [B, L, H, D], None).


def _run_dense(decision, module, query, key, value, attention_mask, scaling, dropout, position_scores, block_elements):
    """One dense bias: a graph compile and export can follow."""
    length = query.shape[-2]
    bias = position_scores.bias().to(query.dtype) if position_scores is not None else None
    if attention_mask is not None:  # finfo.min, not -inf: a fully masked row is uniform, as in eager
        bias = torch.zeros((), dtype=query.dtype, device=query.device) if bias is None else bias
        bias = _masked_scores(bias.expand(*bias.shape[:2], length, key.shape[-2]), attention_mask)
    context = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling)
    context = context.transpose(1, 2)  # [B, L, H, D]
    if is_tracing():  # torch.export's decomposition of sdpa yields other strides than it traced
        context = context.clone(memory_format=torch.contiguous_format)
    return context, None


def _run_onnx_fused(
    decision, module, query, key, value, attention_mask, scaling, dropout, position_scores, block_elements
):
    """An ONNX export's fused graph (`onnx_fused.py`)."""
    return fused_attention(query, key, value, attention_mask, scaling, position_scores), None


def _run_onnx_kernel(
    decision, module, query, key, value, attention_mask, scaling, dropout, position_scores, block_elements
):
    """An ONNX export's kernel graph: the writer that came with it (`dispatch.onnx_graph`, the package's)."""
    write = onnx_graph_asked().write
    return write(query, key, value, attention_mask, scaling, position_scores), None


def _run_blocked(
    decision, module, query, key, value, attention_mask, scaling, dropout, position_scores, block_elements
):
    return blocked_attention(
        module, query, key, value, attention_mask, scaling, dropout, position_scores, block_elements
    )


def _run_triton(decision, module, query, key, value, attention_mask, scaling, dropout, position_scores, block_elements):
    """CUDA: the fused Triton kernel (`triton_attention.py`). What the decision left open is settled here, not by
    deciding again: the first call of its kind on this GPU runs the self-check before the kernel serves, and where
    the check fails or the kernel cannot launch (warned once), sdpa's blocked path serves, as `decide` would answer
    for that kind from then on."""
    arguments = (module, query, key, value, attention_mask, scaling, dropout, position_scores)
    try:
        if decision.check == "pending":
            if not kernel_check.check(decision.kind, query.device, triton_disentangled, blocked_attention)["passed"]:
                log_fallback(blocked_instead(decision.skipped, FAILED_CHECK))
                return blocked_attention(*arguments, block_elements)
        return triton_disentangled(*arguments, blocks=decision.tiles)
    except KernelLaunchError as error:  # this GPU cannot run it: warned once, and not tried again
        launch_failed(query, error)
        log_fallback(blocked_instead(decision.skipped, f"it failed to launch on this GPU: {error}"))
    return blocked_attention(*arguments, block_elements)


RUNNERS = {  # the paths of `dispatch.PATHS` that this backend runs
    "sdpa-dense": _run_dense,
    "cpu-fused": _run_cpu_fused,
    "cpu-bias-kernel": _run_by_distance,
    "cpu-by-distance": _run_by_distance,
    "cpu-training-kernel": _run_cpu_training,
    "cpu-training": _run_cpu_training,
    "sdpa-blocked": _run_blocked,
    "triton": _run_triton,
    "onnx-fused": _run_onnx_fused,
    "onnx-kernel": _run_onnx_kernel,
    "onnx-portable": _run_dense,
}


def blocked_attention(
    module: torch.nn.Module | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float,
    position_scores: PositionScores,
    block_elements: int | None = None,
) -> tuple[Tensor, None]:
    """sdpa's blocked path (accelerators, p2p): SDPA one block of query rows at a time, the keys reversed
    (j' = L - 1 - j), so that a block's index is a stride-(1, 1) view (`_hankel`). Also the Triton kernel's
    self-check's baseline."""
    tensors = (query, key, value, position_scores.pos_key, position_scores.pos_query)
    inference = not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))
    key, value = key.flip(-2), value.flip(-2)  # j' = L - 1 - j
    mask = attention_mask.flip(-1) if attention_mask is not None else None
    context = _attend_in_blocks(position_scores, query, key, value, mask, scaling, dropout, block_elements, inference)
    return context, None


def _attend_in_blocks(
    position_scores: PositionScores,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    scaling: float,
    dropout: float,
    block_elements: int,
    inference: bool,
) -> Tensor:
    """SDPA one block of query rows at a time, keys reversed. Returns [B, L, H, D].

    In inference the tables are built as they are needed and nothing [B, H, L, W] is kept: p2c for one group
    of sequences, c2p for one block of rows, so on the CPU (one sequence per group when L is large) tables
    and bias stay in cache. With gradients (training off the CPU, or with p2p) the whole tables are built
    once and each block's bias is gathered from them, so that autograd sees one table per term.
    """
    batch, heads, length, dim = query.shape
    positions, pos_key, pos_query = position_scores.positions, position_scores.pos_key, position_scores.pos_query
    if not inference:
        c2p, p2c = position_scores.c2p, p2c_by_row(key, pos_query)
    context = query.new_empty(batch, length, heads, dim)
    group = group_p2c = None
    for sequences, first, last in _tiles(query, block_elements):
        if not inference:
            c2p_rows = c2p[sequences, :, first:last] if c2p is not None else None
            group_p2c = p2c[sequences] if p2c is not None else None
        else:
            if pos_query is not None and sequences != group:  # p2c of this group's reversed keys: k_j' . Qr[r]
                group_p2c, group = p2c_by_row(key[sequences], pos_query), sequences
            c2p_rows = position_table(query[sequences, :, first:last], pos_key)  # c2p of these rows: q_i . Kr[r]
        group_heads = (sequences.stop - sequences.start, heads)
        bias = _block_bias(positions, c2p_rows, group_p2c, position_scores.p2p, first, last, group_heads)
        bias = bias.to(query.dtype)
        if mask is not None:
            bias.masked_fill_(~_block_mask(mask, sequences, first, last), torch.finfo(query.dtype).min)
        attended = F.scaled_dot_product_attention(
            query[sequences, :, first:last],
            key[sequences],
            value[sequences],
            attn_mask=bias,
            dropout_p=dropout,
            scale=scaling,
        )
        context[sequences, first:last] = attended.transpose(1, 2)
    return context
