"""A fused disentangled-attention kernel for CUDA GPUs, in Triton: forward and backward, flash-attention style.

    context_i = sum_j softmax_j(A_ij) v_j,
    A_ij = scaling * q_i . k_j + c2p[i, δ(i,j)] + p2c[j, δ(i,j)] [+ p2p[i - j]],   masked keys: finfo(dtype).min

with the same tables the eager reference reads (`disentangled_attention.py`): c2p[b, h, i, r] = q_i . Kr[r] and
p2c[b, h, j, r] = k_j . Qr[r] ([B, H, L, W], `position_table`, the scaling folded into Kr and Qr), read at column
`column[i - j + L - 1]` (`RelativePositions.int32_column`, 2L - 1 entries), and p2p [H, 2L - 1] by distance.

Tiling. The forward runs one program per (block of BLOCK_M query rows, batch x head); it keeps q's tile, the
running row max and row sum and the [BLOCK_M, D] float32 accumulator on chip, and walks the keys in blocks of
BLOCK_N: per tile it loads k and v ([BLOCK_N, D]), computes c2c with `tl.dot`, gathers the tile's columns from the
column vector, c2p's entries from the rows of its own queries and p2c's from the rows of the tile's keys (small
tables, [L, W] per head, that stay in L2), adds p2p by distance, masks, and updates the online softmax (float32
throughout). It writes the context ([B, L, H, D], the layout the model flattens) and, per query row, the row max
and the log of the row sum, which the backward uses to rebuild P exactly (kept apart, not summed into one
log-sum-exp: for a fully masked row the max is finfo.min, next to which log(L) vanishes in float32).

The backward is two kernels that each recompute their tiles' scores and P = exp(A - max - log sum):
- by key blocks: a program owns BLOCK_N keys, walks all query blocks and accumulates dk and dv on chip, and adds
  dS[i, j] into d_p2c[j, column[i - j]] (and d_p2p[h, i - j]) with atomics;
- by query blocks: a program owns BLOCK_M queries, walks all key blocks, accumulates dq on chip, and adds dS into
  d_c2p[i, column[i - j]].
Each table's gradient rows thus belong to one program (only p2p's, [H, 2L - 1], are shared across programs); the
atomics are there because several (i, j) of a tile read the same column where distances are clipped or bucketed.
dS = P * (dP - rowsum(dO * O)) as in FlashAttention-2 (rowsum(dO * O), [B, H, L], comes from torch). The
gradients of the tables are float32 buffers; torch autograd carries them on into q, k, Kr and Qr through the
`position_table` products the wrapper made, so the kernel's arguments are exactly the eager reference's tables.

Never materialised, forward or backward: any [L, L] tensor (scores, probabilities, bias, index, dS, dropout mask).
What exists is O(L): the [B, H, L, W] tables and their gradients (as in the flex backend), the [2L - 1] column
vector, and two float32 [B, H, L] row statistics.

Dropout (training) is decided inside the kernels by Philox (`tl.rand`) at counter ((b * H + h) * L + i) * L + j,
with a seed drawn from torch's CPU generator per call (so `torch.manual_seed` makes it repeatable), and decided
again identically in the backward. `dropout_keep_mask` writes the same decisions densely, for tests only.

Design choices. The position tables are made by torch (one einsum each) rather than inside the kernel, so that the
kernel's inputs are the reference's, and autograd, not the kernel, owns the products into q, k, Kr and Qr; the
kernel's own work per score is then a column load and two gathers from cache-resident tables. q . k is accumulated
in float32 and scaled after (eager scales q first so that float16 cannot overflow; float32 cannot). Float32 inputs
use IEEE products (no TF32), matching torch's default for float32 matmuls.

Where it runs (`kernel_fallback_reason`, asked by `sdpa_disentangled` on each call, which logs the reason at debug
level when it falls back to its own blocked path): CUDA with compute capability 8.0 or more (not ROCm), float16,
bfloat16 or float32, head sizes 32, 64 and 128, self-attention with position terms (plain attention stays with
torch's own fused kernels), no mask or a boolean key mask [B, 1, 1, L]. A pair mask [B, 1, L, L] (a 3-D
attention_mask) falls back. Everything else is the kernel's: c2p, p2c and p2p in any combination, share_att_key or
not (only Kr and Qr differ), clipped distances and log buckets (only `column` differs), packed sequences (the model
calls once per sequence, each with its own cut column vector), dropout.

Tests run the kernels in Triton's interpreter on the CPU, which must be on (TRITON_INTERPRET=1) when triton is
imported: the kernels here, and triton.language's own jitted helpers, are decorated then. The interpreter multiplies
bfloat16 in `tl.dot` as raw integers, so there the operands are widened to float32 first (`_dot`): the same exact
products a tensor core makes.

For a GPU session to measure and tune (nothing here is measured; tests run in the interpreter with 16 x 16 tiles):
- forward and training step time against sdpa's blocked path (`_attend_in_blocks`) and compiled flex_attention,
  at 128 ... 4096 tokens, D = 64 and 128, bfloat16, with and without padding and dropout;
- `BLOCKS` per head size (BLOCK_M, BLOCK_N, num_warps, num_stages) on the target GPU, or a `triton.autotune` over
  a few of them keyed on (L, D) (off in the interpreter); the gathers add register pressure that plain flash
  attention does not have, so the best tiles may be smaller than FlashAttention's;
- the cost of the atomics into d_c2p and d_p2c (one per score element each): if they dominate, accumulate a
  tile's dS along its diagonals first (within a tile, i - j takes BLOCK_M + BLOCK_N - 1 values), or keep a
  program's [BLOCK, W] gradient rows in shared memory where W is small;
- peak memory (should stay linear in L) and that the fallback reasons never fire for the intended configs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .disentangled_attention import PositionScores

try:  # optional: the Hub bundle and CPU installs run without it (sdpa serves them)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = tl = None

# Decorated at import, as triton's own helpers are: TRITON_INTERPRET (Triton's interpreter, for tests on the CPU) must
# be set before triton is imported, since triton.language's jitted helpers (`tl.zeros`, `tl.rand`) are built then.
_jit = triton.jit if triton is not None else (lambda function: function)
INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)  # the kernels below are the interpreter's

TRITON_AVAILABLE = triton is not None
USE_TRITON = True  # sdpa_disentangled runs the kernel where `kernel_fallback_reason` allows; False turns it off
HEAD_SIZES = (32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward and of the backward by head size: first choices for
# Hopper and Ampere (FlashAttention's tiles, the backward's and D = 128's a step smaller for the gathers' registers),
# to be tuned on a GPU. `triton_disentangled(..., blocks=...)` overrides them (the tests use 16 x 16 tiles).
BLOCKS = {
    32: {"forward": (128, 64, 4, 3), "backward": (64, 64, 4, 2)},
    64: {"forward": (128, 64, 4, 3), "backward": (64, 64, 4, 2)},
    128: {"forward": (128, 32, 8, 2), "backward": (64, 32, 8, 2)},
}


def kernel_fallback_reason(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    position_scores: PositionScores | None,
    device_type: str | None = None,
    triton_available: bool | None = None,
) -> str | None:
    """Why the Triton kernel cannot serve this call, or None when it can. Decides from facts only (shapes, dtypes,
    device type), so that it runs on meta or CPU tensors with `device_type="cuda"` as well as on a GPU's."""
    device_type = device_type or query.device.type
    available = TRITON_AVAILABLE if triton_available is None else triton_available
    if not USE_TRITON:
        return "the Triton kernel is switched off (triton_attention.USE_TRITON = False)"
    if not available:
        return "triton is not installed"
    if device_type != "cuda":  # the interpreter is for tests only: never chosen for CPU tensors
        return f"the Triton kernel runs on CUDA devices, not {device_type}"
    if torch.version.hip is not None:
        return "the Triton kernel is not tested on ROCm"
    if query.device.type == "cuda":  # Volta and Turing (7.x) have float16 tensor cores, and no bfloat16
        capability = torch.cuda.get_device_capability(query.device)
        if capability < (7, 0) or (query.dtype == torch.bfloat16 and capability < (8, 0)):
            return f"the Triton kernel needs compute capability 7.0 (8.0 for bfloat16), not {capability}"
    if position_scores is None:
        return "no position terms: plain attention runs scaled_dot_product_attention's own fused kernels"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in DTYPES:
        return f"the Triton kernel takes float16, bfloat16 or float32 q, k, v, not {query.dtype}/{key.dtype}"
    if query.shape[-1] not in HEAD_SIZES or key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        return f"the Triton kernel takes head sizes {HEAD_SIZES}, not {query.shape[-1]}"
    if query.shape[-2] != key.shape[-2] or position_scores.positions.length != query.shape[-2]:
        return "the Triton kernel takes self-attention with one length for queries, keys and positions"
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.shape[-2] != 1):
        return "the Triton kernel takes a boolean key-padding mask [B, 1, 1, L], not a pair mask"
    return None


def triton_disentangled(
    module: torch.nn.Module | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_scores: PositionScores | None = None,
    seed: int | None = None,
    blocks: dict | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The fused kernel behind the backends' signature: q, k, v [B, H, L, D], a bool key mask [B, 1, 1, L] or
    None. Returns the context [B, L, H, D] and no probabilities.

    The c2p and p2c tables are made here with torch, so that autograd carries their gradients on into q, k, Kr
    and Qr; the kernel reads them tile by tile. `seed` fixes the dropout draw (tests); `blocks` overrides the tile
    configuration (`BLOCKS[head_size]`; the tests use tiny tiles in the interpreter).
    """
    c2p = p2c = p2p = column = None
    if position_scores is not None:
        c2p, p2c, p2p = position_scores.c2p, position_scores.p2c, position_scores.p2p  # [B, H, L, W], [H, 2L - 1]
        column = position_scores.positions.int32_column  # [2L - 1]: the table column of i - j at i - j + L - 1
    keep = attention_mask[:, 0, 0] if attention_mask is not None else None  # [B | 1, L]: True = attend
    if dropout > 0 and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()))  # torch's CPU generator: no device sync, repeatable
    blocks = blocks or BLOCKS[query.shape[-1]]
    context = TritonDisentangledAttention.apply(
        query, key, value, c2p, p2c, p2p, column, keep, scaling, dropout, seed or 0, blocks
    )
    return context, None


class TritonDisentangledAttention(torch.autograd.Function):
    """softmax(scaling q kᵀ + c2p + p2c [+ p2p], key mask), dropout, @ v, by the kernels above; see the module
    docstring. Inputs q, k, v [B, H, L, D] (any strides), tables [B, H, L, W] or None, p2p [H, 2L - 1] or None,
    column int32 [2L - 1], keep bool [B | 1, L] or None. Returns the context [B, L, H, D]."""

    @staticmethod
    def forward(ctx, query, key, value, c2p, p2c, p2p, column, keep, scaling, dropout, seed, blocks):
        batch, heads, length, dim = query.shape
        block_m, block_n, warps, stages = blocks["forward"]
        context = query.new_empty(batch, length, heads, dim)
        row_max = query.new_empty(batch, heads, length, dtype=torch.float32)
        log_sum = torch.empty_like(row_max)
        grid = (triton.cdiv(length, block_m), batch * heads)
        _forward_kernel[grid](
            *_arguments(query, key, value, c2p, p2c, p2p, column, keep),
            context, *context.stride(), row_max, log_sum,
            heads, length, scaling, dropout, seed, torch.finfo(query.dtype).min,
            **_flags(query, c2p, p2c, p2p, keep, dropout),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        ctx.save_for_backward(query, key, value, c2p, p2c, p2p, column, keep, context, row_max, log_sum)
        ctx.scaling, ctx.dropout, ctx.seed, ctx.blocks = scaling, dropout, seed, blocks
        return context

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_context):
        query, key, value, c2p, p2c, p2p, column, keep, context, row_max, log_sum = ctx.saved_tensors
        batch, heads, length, dim = query.shape
        block_m, block_n, warps, stages = ctx.blocks["backward"]
        # rowsum(dO * O) = rowsum(P * dP), [B, H, L]; O includes dropout, so this holds with it too
        delta = (grad_context.float() * context.float()).sum(-1).transpose(1, 2).contiguous()
        grad_query, grad_key, grad_value = (torch.empty_like(t) for t in (query, key, value))
        grad_c2p, grad_p2c, grad_p2p = (
            torch.zeros(t.shape, dtype=torch.float32, device=t.device) if t is not None else None
            for t in (c2p, p2c, p2p)
        )
        common = (
            *_arguments(query, key, value, c2p, p2c, p2p, column, keep),
            grad_context, *grad_context.stride(), row_max, log_sum, delta,
            heads, length, ctx.scaling, ctx.dropout, ctx.seed, torch.finfo(query.dtype).min,
        )  # fmt: skip
        flags = _flags(query, c2p, p2c, p2p, keep, ctx.dropout)
        _backward_keys_kernel[(triton.cdiv(length, block_n), batch * heads)](
            *common, grad_key, *_strides(grad_key), grad_value, *_strides(grad_value), grad_p2c, *_strides(grad_p2c),
            grad_p2p, *_strides(grad_p2p, 2), **flags, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        _backward_queries_kernel[(triton.cdiv(length, block_m), batch * heads)](
            *common, grad_query, *_strides(grad_query), grad_c2p, *_strides(grad_c2p),
            **flags, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        grad_c2p, grad_p2c, grad_p2p = (
            grad.to(t.dtype) if grad is not None else None
            for grad, t in ((grad_c2p, c2p), (grad_p2c, p2c), (grad_p2p, p2p))
        )
        return grad_query, grad_key, grad_value, grad_c2p, grad_p2c, grad_p2p, None, None, None, None, None, None


def _strides(tensor: Tensor | None, count: int = 4) -> tuple[int, ...]:
    """A tensor's strides for a kernel; zeros for an absent tensor (its code is compiled out)."""
    return tuple(tensor.stride()) if tensor is not None else (0,) * count


def _arguments(query, key, value, c2p, p2c, p2p, column, keep) -> tuple:
    """The inputs every kernel reads, each followed by its strides."""
    # tables [B, H, L, W]: strides of (b, h, row, column); p2p [H, 2L - 1]; keep [B | 1, L] (batch stride 0 if 1)
    keep_strides = (
        keep.stride(0) if keep is not None and keep.shape[0] > 1 else 0,
        keep.stride(1) if keep is not None else 0,
    )
    return (
        query, *_strides(query), key, *_strides(key), value, *_strides(value),
        c2p, *_strides(c2p), p2c, *_strides(p2c), p2p, *_strides(p2p, 2), column, keep, *keep_strides,
    )  # fmt: skip


def _flags(query: Tensor, c2p, p2c, p2p, keep, dropout: float) -> dict:
    """The compile-time switches: which terms, mask, dropout; head size; IEEE float32 products (no TF32); see `_dot`."""
    return dict(
        HAS_C2P=c2p is not None,
        HAS_P2C=p2c is not None,
        HAS_P2P=p2p is not None,
        HAS_MASK=keep is not None,
        HAS_DROPOUT=dropout > 0,
        HEAD_DIM=query.shape[-1],
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        WIDEN_DOTS=query.dtype == torch.bfloat16 and INTERPRETED,
    )


def dropout_keep_mask(shape: tuple[int, int, int, int], dropout: float, seed: int, device=None) -> Tensor:
    """The kernels' dropout decisions for `seed` as a dense bool [B, H, L, L] (True = kept). For tests only: the
    kernels themselves never write it."""
    batch, heads, length, _ = shape
    keep = torch.empty(shape, dtype=torch.int8, device=device)
    block = 16
    grid = (triton.cdiv(length, block), triton.cdiv(length, block), batch * heads)
    _keep_mask_kernel[grid](keep, length, dropout, seed, BLOCK_M=block, BLOCK_N=block)
    return keep.bool()


# The kernels. Without triton they stay plain functions that nothing calls.


@_jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """a @ b with float32 accumulation. WIDEN_DOTS (Triton's interpreter with bfloat16, whose dot would multiply
    bfloat16's raw bits as integers): the operands as float32 first, which gives the same exact products."""
    if WIDEN_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@_jit
def _kept(seed, plane, rows, cols, length, dropout):
    """Dropout's decision for each (i, j) of a tile: Philox at counter (plane * L + i) * L + j (int64)."""
    offsets = (plane * length + rows[:, None]) * length + cols[None, :]
    return tl.rand(seed, offsets) >= dropout


@_jit
def _scores_tile(
    q, k, rows, cols, b, h, length, scaling, masked,
    c2p, c2p_b, c2p_h, c2p_l, c2p_w, p2c, p2c_b, p2c_h, p2c_l, p2c_w, p2p, p2p_h, p2p_d,
    column, keep, keep_b, keep_l,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_P2P: tl.constexpr, HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
):  # fmt: skip
    """A_ij for rows x cols, float32 [BLOCK_M, BLOCK_N]: masked keys finfo.min (as eager), keys past L -inf."""
    inside = (rows[:, None] < length) & (cols[None, :] < length)
    distance = rows[:, None] - cols[None, :] + length - 1  # i - j + L - 1
    c2c = _dot(q, tl.trans(k), PRECISION, WIDEN_DOTS) * scaling  # q_i . k_j
    scores = c2c
    if HAS_C2P or HAS_P2C:
        r = tl.load(column + distance, mask=inside, other=0)  # δ(i, j)'s table column
        if HAS_C2P:  # q_i . Kr[δ(i,j)]
            c2p_rows = c2p + b * c2p_b + h * c2p_h + rows[:, None] * c2p_l
            scores += tl.load(c2p_rows + r * c2p_w, mask=inside, other=0.0).to(tl.float32)
        if HAS_P2C:  # k_j . Qr[δ(i,j)]
            p2c_rows = p2c + b * p2c_b + h * p2c_h + cols[None, :] * p2c_l
            scores += tl.load(p2c_rows + r * p2c_w, mask=inside, other=0.0).to(tl.float32)
    if HAS_P2P:  # Qr[δ(i,j)] . Kr[δ(j,i)], by distance
        scores += tl.load(p2p + h * p2p_h + distance * p2p_d, mask=inside, other=0.0).to(tl.float32)
    if HAS_MASK:
        attend = tl.load(keep + b * keep_b + cols * keep_l, mask=cols < length, other=0) != 0
        scores = tl.where(attend[None, :], scores, masked)
    return tl.where(cols[None, :] < length, scores, float("-inf"))


@_jit
def _forward_kernel(
    Q, q_b, q_h, q_l, q_d, K, k_b, k_h, k_l, k_d, V, v_b, v_h, v_l, v_d,
    C2P, c2p_b, c2p_h, c2p_l, c2p_w, P2C, p2c_b, p2c_h, p2c_l, p2c_w, P2P, p2p_h, p2p_d,
    Column, Keep, keep_b, keep_l,
    Out, o_b, o_l, o_h, o_d, RowMax, LogSum,
    heads, length, scaling, dropout, seed, masked,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_P2P: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    plane = tl.program_id(1).to(tl.int64)  # b * H + h
    b, h = plane // heads, plane % heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    valid = rows[:, None] < length
    q = tl.load(Q + b * q_b + h * q_h + rows[:, None] * q_l + dims[None, :] * q_d, mask=valid, other=0.0)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, length, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_keys = cols[:, None] < length
        k = tl.load(K + b * k_b + h * k_h + cols[:, None] * k_l + dims[None, :] * k_d, mask=in_keys, other=0.0)
        v = tl.load(V + b * v_b + h * v_h + cols[:, None] * v_l + dims[None, :] * v_d, mask=in_keys, other=0.0)
        scores = _scores_tile(
            q, k, rows, cols, b, h, length, scaling, masked,
            C2P, c2p_b, c2p_h, c2p_l, c2p_w, P2C, p2c_b, p2c_h, p2c_l, p2c_w, P2P, p2p_h, p2p_d,
            Column, Keep, keep_b, keep_l, HAS_C2P, HAS_P2C, HAS_P2P, HAS_MASK, PRECISION, WIDEN_DOTS,
        )  # fmt: skip
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        rescale = tl.exp(row_max - new_max)  # the earlier tiles' terms, to the new max
        p = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, 1)  # the normaliser counts dropped entries too
        if HAS_DROPOUT:
            p = tl.where(_kept(seed, plane, rows, cols, length, dropout), p, 0.0)
        acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN_DOTS)
        row_max = new_max
    acc = acc / row_sum[:, None]
    if HAS_DROPOUT:
        acc = acc / (1.0 - dropout)
    out = Out + b * o_b + h * o_h + rows[:, None] * o_l + dims[None, :] * o_d  # [B, L, H, D]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=valid)
    tl.store(RowMax + plane * length + rows, row_max, mask=rows < length)
    tl.store(LogSum + plane * length + rows, tl.log(row_sum), mask=rows < length)


@_jit
def _probabilities_tile(
    q, k, v, do, rows, cols, b, h, plane, row_max, log_sum, delta, length, scaling, masked, dropout, seed,
    C2P, c2p_b, c2p_h, c2p_l, c2p_w, P2C, p2c_b, p2c_h, p2c_l, p2c_w, P2P, p2p_h, p2p_d,
    Column, Keep, keep_b, keep_l,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_P2P: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
):  # fmt: skip
    """A tile's P after dropout (what multiplied v, without 1 / (1 - p)) and dS, both float32 [M, N]."""
    scores = _scores_tile(
        q, k, rows, cols, b, h, length, scaling, masked,
        C2P, c2p_b, c2p_h, c2p_l, c2p_w, P2C, p2c_b, p2c_h, p2c_l, p2c_w, P2P, p2p_h, p2p_d,
        Column, Keep, keep_b, keep_l, HAS_C2P, HAS_P2C, HAS_P2P, HAS_MASK, PRECISION, WIDEN_DOTS,
    )  # fmt: skip
    p = tl.exp((scores - row_max[:, None]) - log_sum[:, None])  # the forward's softmax, exactly
    p = tl.where(rows[:, None] < length, p, 0.0)
    grad_p = _dot(do, tl.trans(v), PRECISION, WIDEN_DOTS)  # dO v^T, [M, N]
    dropped = p
    if HAS_DROPOUT:
        keep_ij = _kept(seed, plane, rows, cols, length, dropout)
        dropped = tl.where(keep_ij, p, 0.0)
        grad_p = tl.where(keep_ij, grad_p / (1.0 - dropout), 0.0)
    grad_scores = p * (grad_p - delta[:, None])  # dS, softmax's backward
    if HAS_MASK:  # masked scores are constants (masked_fill): no gradient, also in a fully masked row
        attend = tl.load(Keep + b * keep_b + cols * keep_l, mask=cols < length, other=0) != 0
        grad_scores = tl.where(attend[None, :], grad_scores, 0.0)
    return dropped, grad_scores


@_jit
def _backward_keys_kernel(
    Q, q_b, q_h, q_l, q_d, K, k_b, k_h, k_l, k_d, V, v_b, v_h, v_l, v_d,
    C2P, c2p_b, c2p_h, c2p_l, c2p_w, P2C, p2c_b, p2c_h, p2c_l, p2c_w, P2P, p2p_h, p2p_d,
    Column, Keep, keep_b, keep_l,
    DO, do_b, do_l, do_h, do_d, RowMax, LogSum, Delta,
    heads, length, scaling, dropout, seed, masked,
    DK, dk_b, dk_h, dk_l, dk_d, DV, dv_b, dv_h, dv_l, dv_d, DP2C, dp2c_b, dp2c_h, dp2c_l, dp2c_w, DP2P, dp2p_h, dp2p_d,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_P2P: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dk, dv of BLOCK_N keys over all queries; dS into d_p2c's rows of these keys (and d_p2p)."""
    plane = tl.program_id(1).to(tl.int64)
    b, h = plane // heads, plane % heads
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    in_keys = cols[:, None] < length
    k = tl.load(K + b * k_b + h * k_h + cols[:, None] * k_l + dims[None, :] * k_d, mask=in_keys, other=0.0)
    v = tl.load(V + b * v_b + h * v_h + cols[:, None] * v_l + dims[None, :] * v_d, mask=in_keys, other=0.0)
    grad_k = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    grad_v = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start in range(0, length, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        valid = rows[:, None] < length
        q = tl.load(Q + b * q_b + h * q_h + rows[:, None] * q_l + dims[None, :] * q_d, mask=valid, other=0.0)
        do = tl.load(DO + b * do_b + h * do_h + rows[:, None] * do_l + dims[None, :] * do_d, mask=valid, other=0.0)
        row_max = tl.load(RowMax + plane * length + rows, mask=rows < length, other=0.0)
        log_sum = tl.load(LogSum + plane * length + rows, mask=rows < length, other=0.0)
        delta = tl.load(Delta + plane * length + rows, mask=rows < length, other=0.0)
        dropped, grad_scores = _probabilities_tile(
            q, k, v, do, rows, cols, b, h, plane, row_max, log_sum, delta, length, scaling, masked, dropout, seed,
            C2P, c2p_b, c2p_h, c2p_l, c2p_w, P2C, p2c_b, p2c_h, p2c_l, p2c_w, P2P, p2p_h, p2p_d,
            Column, Keep, keep_b, keep_l, HAS_C2P, HAS_P2C, HAS_P2P, HAS_MASK, HAS_DROPOUT, PRECISION, WIDEN_DOTS,
        )  # fmt: skip
        grad_v += _dot(tl.trans(dropped).to(do.dtype), do, PRECISION, WIDEN_DOTS)
        grad_k += _dot(tl.trans(grad_scores).to(q.dtype), q, PRECISION, WIDEN_DOTS)
        inside = (rows[:, None] < length) & (cols[None, :] < length)
        distance = rows[:, None] - cols[None, :] + length - 1
        if HAS_P2C:  # p2c[j, column[i - j]] received dS[i, j]; several i of a column share an entry
            r = tl.load(Column + distance, mask=inside, other=0)
            target = DP2C + b * dp2c_b + h * dp2c_h + cols[None, :] * dp2c_l + r * dp2c_w
            tl.atomic_add(target, grad_scores, mask=inside, sem="relaxed")
        if HAS_P2P:  # p2p[h, i - j + L - 1] received dS[i, j], from every batch row and tile
            tl.atomic_add(DP2P + h * dp2p_h + distance * dp2p_d, grad_scores, mask=inside, sem="relaxed")
    grad_key = DK + b * dk_b + h * dk_h + cols[:, None] * dk_l + dims[None, :] * dk_d
    tl.store(grad_key, (grad_k * scaling).to(DK.dtype.element_ty), mask=in_keys)
    if HAS_DROPOUT:
        grad_v = grad_v / (1.0 - dropout)
    grad_value = DV + b * dv_b + h * dv_h + cols[:, None] * dv_l + dims[None, :] * dv_d
    tl.store(grad_value, grad_v.to(DV.dtype.element_ty), mask=in_keys)


@_jit
def _backward_queries_kernel(
    Q, q_b, q_h, q_l, q_d, K, k_b, k_h, k_l, k_d, V, v_b, v_h, v_l, v_d,
    C2P, c2p_b, c2p_h, c2p_l, c2p_w, P2C, p2c_b, p2c_h, p2c_l, p2c_w, P2P, p2p_h, p2p_d,
    Column, Keep, keep_b, keep_l,
    DO, do_b, do_l, do_h, do_d, RowMax, LogSum, Delta,
    heads, length, scaling, dropout, seed, masked,
    DQ, dq_b, dq_h, dq_l, dq_d, DC2P, dc2p_b, dc2p_h, dc2p_l, dc2p_w,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_P2P: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dq of BLOCK_M queries over all keys; dS into d_c2p's rows of these queries."""
    plane = tl.program_id(1).to(tl.int64)
    b, h = plane // heads, plane % heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    valid = rows[:, None] < length
    q = tl.load(Q + b * q_b + h * q_h + rows[:, None] * q_l + dims[None, :] * q_d, mask=valid, other=0.0)
    do = tl.load(DO + b * do_b + h * do_h + rows[:, None] * do_l + dims[None, :] * do_d, mask=valid, other=0.0)
    row_max = tl.load(RowMax + plane * length + rows, mask=rows < length, other=0.0)
    log_sum = tl.load(LogSum + plane * length + rows, mask=rows < length, other=0.0)
    delta = tl.load(Delta + plane * length + rows, mask=rows < length, other=0.0)
    grad_q = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, length, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_keys = cols[:, None] < length
        k = tl.load(K + b * k_b + h * k_h + cols[:, None] * k_l + dims[None, :] * k_d, mask=in_keys, other=0.0)
        v = tl.load(V + b * v_b + h * v_h + cols[:, None] * v_l + dims[None, :] * v_d, mask=in_keys, other=0.0)
        _, grad_scores = _probabilities_tile(
            q, k, v, do, rows, cols, b, h, plane, row_max, log_sum, delta, length, scaling, masked, dropout, seed,
            C2P, c2p_b, c2p_h, c2p_l, c2p_w, P2C, p2c_b, p2c_h, p2c_l, p2c_w, P2P, p2p_h, p2p_d,
            Column, Keep, keep_b, keep_l, HAS_C2P, HAS_P2C, HAS_P2P, HAS_MASK, HAS_DROPOUT, PRECISION, WIDEN_DOTS,
        )  # fmt: skip
        grad_q += _dot(grad_scores.to(k.dtype), k, PRECISION, WIDEN_DOTS)
        if HAS_C2P:  # c2p[i, column[i - j]] received dS[i, j]; several j of a row share a column
            inside = (rows[:, None] < length) & (cols[None, :] < length)
            r = tl.load(Column + rows[:, None] - cols[None, :] + length - 1, mask=inside, other=0)
            target = DC2P + b * dc2p_b + h * dc2p_h + rows[:, None] * dc2p_l + r * dc2p_w
            tl.atomic_add(target, grad_scores, mask=inside, sem="relaxed")
    grad_query = DQ + b * dq_b + h * dq_h + rows[:, None] * dq_l + dims[None, :] * dq_d
    tl.store(grad_query, (grad_q * scaling).to(DQ.dtype.element_ty), mask=valid)


@_jit
def _keep_mask_kernel(Out, length, dropout, seed, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`kept` for a whole [B * H, L, L] int8 tensor: the tests' copy of the kernels' dropout decisions."""
    plane = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < length) & (cols[None, :] < length)
    decision = _kept(seed, plane, rows, cols, length, dropout)
    target = Out + (plane * length + rows[:, None]) * length + cols[None, :]
    tl.store(target, decision.to(tl.int8), mask=inside)
