"""A fused disentangled-attention kernel for CUDA GPUs, in Triton: forward and backward, flash-attention style.

    context_i = sum_j softmax_j(A_ij) v_j,
    A_ij = scaling * q_i . k_j + c2p[i, δ(i,j)] + p2c[j, δ(i,j)] [+ p2p[i - j]],   masked keys: finfo(dtype).min

with the same tables the eager reference reads (`disentangled_attention.py`): c2p[b, h, i, r] = q_i . Kr[r] and
p2c[b, h, j, r] = k_j . Qr[r] ([B, H, L, W], `position_table`, the scaling folded into Kr and Qr), read at column
`column[i - j + L - 1]` (`workspace.int32_column`, 2L - 1 entries), and p2p [H, 2L - 1] by distance.

Tiling. The forward runs one program per (block of BLOCK_M query rows, batch x head); it keeps q's tile, the
running row max and row sum and the [BLOCK_M, D] float32 accumulator on chip, and walks the keys in blocks of
BLOCK_N: per tile it loads k and v ([BLOCK_N, D]), computes c2c with `tl.dot`, gathers the tile's columns from the
column vector, c2p's entries from the rows of its own queries and p2c's from the rows of the tile's keys (small
tables, [L, W] per head, that stay in L2), adds p2p by distance, masks, and updates the online softmax (float32
throughout). It writes the context ([B, L, H, D], the layout the model flattens) and, per query row, the row max
and the log of the row sum, which the backward uses to rebuild P exactly (kept apart, not summed into one
log-sum-exp: for a fully masked row the max is finfo.min, next to which log(L) vanishes in float32).

The backward is two kernels that each recompute their tiles' scores and P = exp(A - max - log sum):
- by key blocks ("keys"): a program owns BLOCK_N keys, walks all query blocks and accumulates dk and dv on chip, and
  adds dS[i, j] into d_p2c[j, column[i - j]] (and d_p2p[h, i - j]);
- by query blocks ("queries"): a program owns BLOCK_M queries, walks all key blocks, accumulates dq on chip, and adds
  dS into d_c2p[i, column[i - j]].
Each table's gradient rows thus belong to one program (only p2p's, [H, 2L - 1], are shared across programs), and how
a tile adds into them depends on its distances (`_add_to_table`, decided per tile from `column_runs`,
two prefix counts over the column vector made once per forward): where none of the tile's distances shares its column with any other
distance (no clipping or bucketing reaches them: all of v1 within its reach, v2/v3 below half the buckets), each
entry is written by this tile alone, so dS is stored, no atomics; where the whole tile reads one column (clipped
distances far from the diagonal), dS is summed per owned row first, one atomic per row; only between the two (log
buckets that merge a few distances) is there an atomic per score.
dS = P * (dP - rowsum(dO * O)) as in FlashAttention-2 (rowsum(dO * O), [B, H, L], comes from torch). The
gradients of the tables are float32 buffers; torch autograd carries them on into q, k, Kr and Qr through the
`position_table` products the wrapper made, so the kernel's arguments are exactly the eager reference's tables.

Registers. Offsets within a (batch, head) plane are int32 from that plane's base pointers, the column of a tile is
gathered once for c2p and p2c, v is loaded after the scores: at the tiles of `triton_tiles.py` no kernel spills or asks
for more shared memory than its GPU has, on every target, specialisation (`_kernel`) and Triton (3.8, 3.9) that
`python -m benchmarks.kernel_resources` compiles for (it reads the same table, and CI checks part of it).

Never materialised, forward or backward: any [L, L] tensor (scores, probabilities, bias, index, dS, dropout mask).
What exists is O(L): the [B, H, L, W] tables and their gradients (as in the flex backend), the [2L - 1] column
vector, and two float32 [B, H, L] row statistics.

Dropout (training) is decided inside the kernels by Philox (`tl.rand`) keyed by seed + (b * H + h), at counter
i * L + j (int32: up to 46,340 tokens), with a seed drawn from torch's CPU generator per call (so `torch.manual_seed`
makes it repeatable), and decided again identically in the backward. `dropout_keep_mask` writes the same decisions
densely, for tests only.

Design choices. The position tables are made by torch (one einsum each) rather than inside the kernel, so that the
kernel's inputs are the reference's, and autograd, not the kernel, owns the products into q, k, Kr and Qr; the
kernel's own work per score is then a column load and two gathers from cache-resident tables. q . k is accumulated
in float32 and scaled after (eager scales q first so that float16 cannot overflow; float32 cannot). Float32 inputs
use IEEE products (no TF32), matching torch's default for float32 matmuls.

Where it runs (decided by `dispatch.decide`, once per call, which says why in one debug line when it falls back to
sdpa's own blocked path; a pending self-check and a failed launch are settled by `sdpa_attention._run_triton`;
DISENTANGLED_TRITON=0 turns it off): CUDA with compute
capability 7.0 or more (8.0 for bfloat16; not ROCm), float16, bfloat16 or float32, head sizes 32, 64 and 128,
self-attention with position terms (plain attention stays with torch's own fused kernels), no mask or a boolean key
mask [B, 1, 1, L], where `tiles_for` has tiles for the GPU (a tuned profile, else `triton_tiles.TILES`). A pair mask [B, 1, L, L] (a 3-D attention_mask) falls back.
Everything else is the kernel's: c2p, p2c and p2p in any combination, share_att_key or not (only Kr and Qr differ),
clipped distances and log buckets (only `column` differs), packed sequences (the model calls once per sequence, each
with its own cut column vector), dropout. A launch that fails all the same (an unlisted GPU: out of shared memory, a
compiler error) raises KernelLaunchError before anything ran (in training the backward's kernels are compiled and
loaded before the forward's launch); sdpa then serves the call and every later one of that GPU, dtype and head size,
after one warning naming the GPU and the reason. The first call of each kind on a GPU is checked against sdpa's
path before the kernel serves it (`kernel_check.py`).

Tests run the kernels in Triton's interpreter on the CPU, which must be on (TRITON_INTERPRET=1) when triton is
imported: the kernels here, and triton.language's own jitted helpers, are decorated then. The interpreter multiplies
bfloat16 in `tl.dot` as raw integers, so there the operands are widened to float32 first (`_dot`): the same exact
products a tensor core makes.

For a GPU session to measure (nothing here is timed; tests run in the interpreter with 16 x 16 tiles): the kernels'
time against sdpa's blocked path and the public DeBERTa kernels (`benchmarks.device_check`), the tiles per GPU
(`benchmarks.tune_kernel`), and the atomics that remain between the "alone" and "one column" tiles at long lengths.

In `modeling/`'s layering (`__init__.py`): layer 4, the GPU kernel, which sdpa calls on CUDA.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .disentangled_attention import PositionScores, RelativePositions
from .triton_tiles import tiles_for
from .workspace import int32_column, per_forward

try:  # optional: the Hub bundle and CPU installs run without it (sdpa serves them)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = tl = None

logger = logging.getLogger(__name__)

# Decorated at import, as triton's own helpers are: TRITON_INTERPRET (Triton's interpreter, for tests on the CPU) must
# be set before triton is imported, since triton.language's jitted helpers (`tl.zeros`, `tl.rand`) are built then.
_jit = triton.jit if triton is not None else (lambda function: function)
# The kernels themselves. Triton compiles a kernel once per specialisation of its arguments: an integer equal to 1 as a
# constant, an integer or pointer divisible by 16 with that fact (which can change vectorisation, and so registers).
# Facts no load can use are not specialised, so that a real call makes one of two compiles per kind of call, length a
# multiple of 16 or not (`length: tl.int32` compiles a length of 1 as any other ragged length), which
# `benchmarks.kernel_resources` compiles for every GPU: the dropout seed (data, drawn afresh for each training call: 1
# would be a constant, and 1 draw in 16 divisible by 16), the head count and the key mask's batch stride (scalars),
# the position tables' strides (their loads gather by column) and the alignment of the second row of the runs
# (scalar loads; it follows the parity of the length).
_NOT_SPECIALISED = ["seed", "heads", "keep_b"] + [
    f"{table}_{axis}" for table in ("c2p", "p2c", "dc2p", "dp2c") for axis in "bhl"
] + ["p2p_h", "dp2p_h"]  # fmt: skip


def _kernel(function):
    if triton is None:
        return function
    return triton.jit(function, do_not_specialize=_NOT_SPECIALISED, do_not_specialize_on_alignment=["Changes"])


INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)  # the kernels below are the interpreter's

TRITON_AVAILABLE = triton is not None
HEAD_SIZES = (32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_DROPOUT_LENGTH = 46_340  # dropout's Philox counter i * L + j is int32

# Launches that failed on a GPU (an unlisted GPU whose compiler or memory the tiles do not suit): (GPU name,
# capability, dtype, head size) -> the reason. Each is warned about once, and sdpa's own path serves it afterwards.
FAILED_LAUNCHES: dict[tuple, str] = {}


def _device_facts(device: torch.device) -> tuple[str, tuple[int, int]]:
    """The GPU's name and compute capability (asked once per device: the dispatcher reads them on every call)."""
    return _device_facts_of(torch.device(device).index or 0)


@functools.cache
def _device_facts_of(index: int) -> tuple[str, tuple[int, int]]:
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)


class KernelLaunchError(RuntimeError):
    """The Triton kernel could not be compiled or launched for this GPU (out of shared memory, registers, ...); the
    call has not run, and `sdpa_disentangled` serves it with its own path."""


def launch_failed(query: Tensor, error: Exception) -> None:
    """Remember a failed launch for this GPU, dtype and head size, and warn once, naming the GPU and the reason."""
    gpu, capability = _device_facts(query.device)
    key = (gpu, tuple(capability), query.dtype, query.shape[-1])
    reason = str(error.__cause__ or error)
    if key not in FAILED_LAUNCHES:
        FAILED_LAUNCHES[key] = reason
        warnings.warn(
            f"the Triton disentangled-attention kernel could not run on {gpu} (compute capability "
            f"{capability[0]}.{capability[1]}) for {query.dtype} and head size {query.shape[-1]}: {reason}. "
            "sdpa's own path serves these calls instead (slower on long inputs); report the GPU, or run "
            "`python -m benchmarks.tune_kernel` on it to add tiles that fit.",
            RuntimeWarning,
            stacklevel=3,
        )


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
    and Qr; the kernel reads them tile by tile. `seed` fixes the dropout draw (tests); `blocks` overrides the tiles
    of each kernel (`tiles_for`; the tests use tiny tiles in the interpreter). Raises KernelLaunchError, before
    anything ran, where the kernels cannot be compiled or launched on this GPU.
    """
    c2p = p2c = p2p = column = runs = None
    if position_scores is not None:
        c2p, p2c, p2p = position_scores.c2p, position_scores.p2c, position_scores.p2p  # [B, H, L, W], [H, 2L - 1]
        column = int32_column(position_scores.positions)  # [2L - 1]: the table column of i - j at i - j + L - 1
        runs = column_runs(position_scores.positions)  # [2, 2L]: which tiles share columns (table gradients)
    keep = attention_mask[:, 0, 0] if attention_mask is not None else None  # [B | 1, L]: True = attend
    if dropout > 0 and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()))  # torch's CPU generator: no device sync, repeatable
    if blocks is None:
        gpu, capability = _device_facts(query.device)
        blocks = tiles_for(capability, query.dtype, query.shape[-1], gpu)
    context = TritonDisentangledAttention.apply(
        query, key, value, c2p, p2c, p2p, column, runs, keep, scaling, dropout, seed or 0, blocks
    )
    return context, None


def column_runs(positions: RelativePositions) -> Tensor:
    """[2, 2L] int32 prefix counts over the column vector, for the kernels' table gradients, made once per forward
    (columns are monotone in d, so distances that share a column are neighbours). Row 0 at d: how many distances in
    [0, d) share their column with another; a tile whose distances [lo, hi] count none there writes each of its
    gradient entries alone. Row 1 at d: how many times the column changes in (0, d]; a tile whose distances count
    none reads one column (its last entry, past the distances, is never read)."""
    return per_forward(positions, "column runs", _column_runs)


def _column_runs(positions: RelativePositions) -> Tensor:
    column = positions.column
    changed = column[1:] != column[:-1]  # [2L - 2]
    shared = torch.zeros_like(column, dtype=torch.bool)
    shared[1:] |= ~changed
    shared[:-1] |= ~changed
    runs = torch.zeros(2, column.numel() + 1, dtype=torch.int32, device=column.device)
    runs[0, 1:] = shared.cumsum(0)
    runs[1, 1:-1] = changed.cumsum(0)
    return runs


class Launch(NamedTuple):
    """One kernel launch: the kernel, its grid, its arguments and its compile options (tiles, switches)."""

    kernel: Any
    grid: tuple[int, int]
    args: tuple
    options: dict

    def __call__(self):
        return self.kernel[self.grid](*self.args, **self.options)

    def prepare(self):
        """Compile for this GPU and load it, launching nothing: raises Triton's OutOfResources where the GPU lacks the
        shared memory or threads. Returns the compiled kernel (its `n_spills` is the loaded kernel's)."""
        compiled = self.kernel.warmup(*self.args, grid=self.grid, **self.options)
        compiled._init_handles()  # loads it for this GPU: where Triton raises OutOfResources (shared memory, threads)
        return compiled


def forward_launch(inputs: tuple, outputs: tuple, scaling, dropout, seed, tiles) -> Launch:
    """The forward kernel's launch. inputs: (q, k, v, c2p, p2c, p2p, column, runs, keep); outputs: (context [B, L,
    H, D], row max and log row sum [B, H, L] float32)."""
    query = inputs[0]
    batch, heads, length, _ = query.shape
    block_m, block_n, warps, stages = tiles["forward"]
    context, row_max, log_sum = outputs
    args = (
        *_arguments(*inputs), context, *context.stride(), row_max, log_sum,
        heads, length, scaling, dropout, seed, torch.finfo(query.dtype).min,
    )  # fmt: skip
    options = dict(_flags(*inputs, dropout), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return Launch(_forward_kernel, (triton.cdiv(length, block_m), batch * heads), args, options)


def backward_launches(
    inputs: tuple, saved: tuple, grads: tuple, scaling, dropout, seed, tiles
) -> tuple[Launch, Launch]:
    """The two backward kernels' launches. saved: (dO, row max, log row sum, rowsum(dO * O)); grads: (dq, dk, dv
    like q, k, v; d_c2p, d_p2c, d_p2p float32 zeros like the tables, or None)."""
    query = inputs[0]
    batch, heads, length, _ = query.shape
    grad_context, row_max, log_sum, delta = saved
    grad_query, grad_key, grad_value, grad_c2p, grad_p2c, grad_p2p = grads
    common = (
        *_arguments(*inputs), grad_context, *grad_context.stride(), row_max, log_sum, delta,
        heads, length, scaling, dropout, seed, torch.finfo(query.dtype).min,
    )  # fmt: skip
    flags = _flags(*inputs, dropout)
    block_m, block_n, warps, stages = tiles["keys"]
    keys = Launch(
        _backward_keys_kernel,
        (triton.cdiv(length, block_n), batch * heads),
        (*common, grad_key, *_strides(grad_key), grad_value, *_strides(grad_value),
         grad_p2c, *_strides(grad_p2c), grad_p2p, *_strides(grad_p2p, 2)),
        dict(flags, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages),
    )  # fmt: skip
    block_m, block_n, warps, stages = tiles["queries"]
    queries = Launch(
        _backward_queries_kernel,
        (triton.cdiv(length, block_m), batch * heads),
        (*common, grad_query, *_strides(grad_query), grad_c2p, *_strides(grad_c2p)),
        dict(flags, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages),
    )
    return keys, queries


class TritonDisentangledAttention(torch.autograd.Function):
    """softmax(scaling q kᵀ + c2p + p2c [+ p2p], key mask), dropout, @ v, by the kernels below; see the module
    docstring. Inputs q, k, v [B, H, L, D] (any strides), tables [B, H, L, W] or None, p2p [H, 2L - 1] or None,
    column int32 [2L - 1], runs int32 [2, 2L], keep bool [B | 1, L] or None. Returns the context [B, L, H, D]."""

    @staticmethod
    def forward(ctx, query, key, value, c2p, p2c, p2p, column, runs, keep, scaling, dropout, seed, blocks):
        batch, heads, length, dim = query.shape
        inputs = (query, key, value, c2p, p2c, p2p, column, runs, keep)
        context = query.new_empty(batch, length, heads, dim)
        row_max = query.new_empty(batch, heads, length, dtype=torch.float32)
        log_sum = torch.empty_like(row_max)
        launch = forward_launch(inputs, (context, row_max, log_sum), scaling, dropout, seed, blocks)
        try:
            if not INTERPRETED and any(ctx.needs_input_grad):  # the backward's kernels must fit this GPU too
                _prepare_backward(inputs, (context, row_max, log_sum), scaling, dropout, seed, blocks)
            launch()
        except Exception as error:  # OutOfResources, a compiler or driver error: nothing has run yet
            if INTERPRETED:
                raise
            raise KernelLaunchError(f"{type(error).__name__}: {error}") from error
        ctx.save_for_backward(*inputs, context, row_max, log_sum)
        ctx.scaling, ctx.dropout, ctx.seed, ctx.blocks = scaling, dropout, seed, blocks
        return context

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_context):
        *inputs, context, row_max, log_sum = ctx.saved_tensors
        query, key, value, c2p, p2c, p2p = inputs[:6]
        # rowsum(dO * O) = rowsum(P * dP), [B, H, L]; O includes dropout, so this holds with it too
        delta = (grad_context.float() * context.float()).sum(-1).transpose(1, 2).contiguous()
        grads = (
            *(torch.empty_like(t) for t in (query, key, value)),
            *(torch.zeros(t.shape, dtype=torch.float32, device=t.device) if t is not None else None
              for t in (c2p, p2c, p2p)),
        )  # fmt: skip
        for launch in backward_launches(
            tuple(inputs),
            (grad_context, row_max, log_sum, delta),
            grads,
            ctx.scaling,
            ctx.dropout,
            ctx.seed,
            ctx.blocks,
        ):
            launch()
        grad_query, grad_key, grad_value, grad_c2p, grad_p2c, grad_p2p = grads
        grad_c2p, grad_p2c, grad_p2p = (
            grad.to(t.dtype) if grad is not None else None
            for grad, t in ((grad_c2p, c2p), (grad_p2c, p2c), (grad_p2p, p2p))
        )
        return (grad_query, grad_key, grad_value, grad_c2p, grad_p2c, grad_p2p) + (None,) * 7


_PREPARED: set = set()  # the backward kernels compiled and checked for a GPU, dtype, head size, switches and tiles


def _prepare_backward(inputs: tuple, outputs: tuple, scaling, dropout, seed, tiles) -> None:
    """Compile the backward's kernels for this call and check that this GPU can launch them, once per kind of call,
    so that a kernel that cannot run fails in the forward, where sdpa's path can still take the call. The gradient
    buffers are stand-ins (dtype and contiguous strides are what the compiler specialises on)."""
    query = inputs[0]
    key = (query.device, query.dtype, query.shape[-1], tuple(sorted(_flags(*inputs, dropout).items())),
           tuple(sorted(tiles.items())))  # fmt: skip
    if key in _PREPARED:
        return
    from triton.runtime.jit import MockTensor

    float32 = (MockTensor(torch.float32, list(t.shape)) if t is not None else None for t in inputs[3:6])
    grads = (query, inputs[1], inputs[2], *float32)  # dq, dk, dv are allocated like q, k, v
    context, row_max, log_sum = outputs
    for launch in backward_launches(inputs, (context, row_max, log_sum, row_max), grads, scaling, dropout, seed, tiles):
        launch.prepare()
    _PREPARED.add(key)


def _strides(tensor: Tensor | None, count: int = 4) -> tuple[int, ...]:
    """A tensor's strides for a kernel; zeros for an absent tensor (its code is compiled out)."""
    return tuple(tensor.stride()) if tensor is not None else (0,) * count


def _arguments(query, key, value, c2p, p2c, p2p, column, runs, keep) -> tuple:
    """The inputs every kernel reads, each followed by its strides."""
    # tables [B, H, L, W]: strides of (b, h, row, column); p2p [H, 2L - 1]; keep [B | 1, L] (batch stride 0 if 1)
    keep_strides = (
        keep.stride(0) if keep is not None and keep.shape[0] > 1 else 0,
        keep.stride(1) if keep is not None else 0,
    )
    shared, changes = (runs[0], runs[1]) if runs is not None else (None, None)
    return (
        query, *_strides(query), key, *_strides(key), value, *_strides(value),
        c2p, *_strides(c2p), p2c, *_strides(p2c), p2p, *_strides(p2p, 2), column, shared, changes, keep, *keep_strides,
    )  # fmt: skip


def _flags(query: Tensor, key, value, c2p, p2c, p2p, column, runs, keep, dropout: float) -> dict:
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


def table_tile_kinds(runs: Tensor, length: int, block_m: int, block_n: int) -> list[str]:
    """How the backward adds each tile's dS into the position tables' gradients (`_table_tile_kind`, in Python):
    "alone" (plain stores), "one column" (summed per row, one atomic each) or "atomics". For tests."""
    shared, changes = runs.tolist()
    kinds = []
    for i0 in range(0, length, block_m):
        for j0 in range(0, length, block_n):
            lo = i0 - (min(j0 + block_n, length) - 1) + length - 1
            hi = min(i0 + block_m, length) - 1 - j0 + length - 1
            alone, one = shared[hi + 1] == shared[lo], changes[hi] == changes[lo]
            kinds.append("one column" if one else "alone" if alone else "atomics")
    return kinds


# The kernels. Without triton they stay plain functions that nothing calls. Offsets inside a (batch, head) plane are
# int32 from that plane's base pointers (an int32 [M, N] tile costs half the registers of a tile of 64-bit pointers).


@_jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """a @ b with float32 accumulation. WIDEN_DOTS (Triton's interpreter with bfloat16, whose dot would multiply
    bfloat16's raw bits as integers): the operands as float32 first, which gives the same exact products."""
    if WIDEN_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@_jit
def _kept(seed, plane, rows, cols, length, dropout):
    """Dropout's decision for each (i, j) of a tile: Philox keyed by seed + plane, at counter i * L + j (int32)."""
    return tl.rand(seed + plane, rows[:, None] * length + cols[None, :]) >= dropout


@_jit
def _scores_tile(
    q, k, rows, cols, attend, length, scaling, masked,
    C2P, c2p_l, c2p_w, P2C, p2c_l, p2c_w, P2P, p2p_d, Column,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_P2P: tl.constexpr, HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
):  # fmt: skip
    """A_ij for rows x cols, float32 [BLOCK_M, BLOCK_N]: masked keys finfo.min (as eager), keys past L -inf. The
    table pointers are this plane's; `attend` is the key mask of cols."""
    inside = (rows[:, None] < length) & (cols[None, :] < length)
    distance = rows[:, None] - cols[None, :] + length - 1  # i - j + L - 1
    scores = _dot(q, tl.trans(k), PRECISION, WIDEN_DOTS) * scaling  # c2c: q_i . k_j
    if HAS_C2P or HAS_P2C:
        r = tl.load(Column + distance, mask=inside, other=0)  # δ(i, j)'s table column, once for both terms
        if HAS_C2P:  # c2p: q_i . Kr[δ(i,j)]
            scores += tl.load(C2P + (rows[:, None] * c2p_l + r * c2p_w), mask=inside, other=0.0).to(tl.float32)
        if HAS_P2C:  # p2c: k_j . Qr[δ(i,j)]
            scores += tl.load(P2C + (cols[None, :] * p2c_l + r * p2c_w), mask=inside, other=0.0).to(tl.float32)
    if HAS_P2P:  # p2p: Qr[δ(i,j)] . Kr[δ(j,i)], by distance
        scores += tl.load(P2P + distance * p2p_d, mask=inside, other=0.0).to(tl.float32)
    if HAS_MASK:
        scores = tl.where(attend[None, :], scores, masked)
    return tl.where(cols[None, :] < length, scores, float("-inf"))


@_jit
def _key_mask(Keep, keep_l, cols, length, HAS_MASK: tl.constexpr):
    """The key mask of cols (True = attend), from this batch row's mask; all True without one."""
    if HAS_MASK:
        return tl.load(Keep + cols * keep_l, mask=cols < length, other=0) != 0
    return cols < length


@_kernel
def _forward_kernel(
    Q, q_b, q_h, q_l, q_d, K, k_b, k_h, k_l, k_d, V, v_b, v_h, v_l, v_d,
    C2P, c2p_b, c2p_h, c2p_l, c2p_w, P2C, p2c_b, p2c_h, p2c_l, p2c_w, P2P, p2p_h, p2p_d,
    Column, Shared, Changes, Keep, keep_b, keep_l,
    Out, o_b, o_l, o_h, o_d, RowMax, LogSum,
    heads, length: tl.int32, scaling, dropout, seed, masked,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_P2P: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    plane = tl.program_id(1).to(tl.int64)  # b * H + h
    b, h = plane // heads, plane % heads
    Q += b * q_b + h * q_h  # this plane's base pointers; offsets within it are int32
    K += b * k_b + h * k_h
    V += b * v_b + h * v_h
    if HAS_C2P:  # (an absent input is None, and its code compiled out)
        C2P += b * c2p_b + h * c2p_h
    if HAS_P2C:
        P2C += b * p2c_b + h * p2c_h
    if HAS_P2P:
        P2P += h * p2p_h
    if HAS_MASK:
        Keep += b * keep_b
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    valid = rows[:, None] < length
    q = tl.load(Q + (rows[:, None] * q_l + dims[None, :] * q_d), mask=valid, other=0.0)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, length, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_keys = cols[:, None] < length
        k = tl.load(K + (cols[:, None] * k_l + dims[None, :] * k_d), mask=in_keys, other=0.0)
        attend = _key_mask(Keep, keep_l, cols, length, HAS_MASK)
        scores = _scores_tile(
            q, k, rows, cols, attend, length, scaling, masked, C2P, c2p_l, c2p_w, P2C, p2c_l, p2c_w, P2P, p2p_d,
            Column, HAS_C2P, HAS_P2C, HAS_P2P, HAS_MASK, PRECISION, WIDEN_DOTS,
        )  # fmt: skip
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        rescale = tl.exp(row_max - new_max)  # the earlier tiles' terms, to the new max
        p = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, 1)  # the normaliser counts dropped entries too
        if HAS_DROPOUT:
            p = tl.where(_kept(seed, plane, rows, cols, length, dropout), p, 0.0)
        v = tl.load(V + (cols[:, None] * v_l + dims[None, :] * v_d), mask=in_keys, other=0.0)
        acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN_DOTS)
        row_max = new_max
    acc = acc / row_sum[:, None]
    if HAS_DROPOUT:
        acc = acc / (1.0 - dropout)
    Out += b * o_b + h * o_h  # [B, L, H, D]
    tl.store(Out + (rows[:, None] * o_l + dims[None, :] * o_d), acc.to(Out.dtype.element_ty), mask=valid)
    tl.store(RowMax + plane * length + rows, row_max, mask=rows < length)
    tl.store(LogSum + plane * length + rows, tl.log(row_sum), mask=rows < length)


@_jit
def _probabilities_tile(
    q, k, v, do, rows, cols, attend, plane, row_max, log_sum, delta, length, scaling, masked, dropout, seed,
    C2P, c2p_l, c2p_w, P2C, p2c_l, p2c_w, P2P, p2p_d, Column,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_P2P: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
):  # fmt: skip
    """A tile's P after dropout (what multiplied v, without 1 / (1 - p)) and dS, both float32 [M, N]."""
    scores = _scores_tile(
        q, k, rows, cols, attend, length, scaling, masked, C2P, c2p_l, c2p_w, P2C, p2c_l, p2c_w, P2P, p2p_d,
        Column, HAS_C2P, HAS_P2C, HAS_P2P, HAS_MASK, PRECISION, WIDEN_DOTS,
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
        grad_scores = tl.where(attend[None, :], grad_scores, 0.0)
    return dropped, grad_scores


@_jit
def _add_to_table(
    Grad, grad_l, grad_w, grad_scores, rows, cols, first_row, first_col, length, Column, Shared, Changes,
    BY_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Add a tile's dS into a table's gradient, this plane's: d_c2p[i, δ(i,j)] (BY_ROWS: the queries' program owns
    rows i) or d_p2c[j, δ(i,j)] (the keys' program owns rows j). A program owns its rows' entries; within them,
    where the tile's distances [lo, hi] share no column with any other distance, each entry is this tile's alone:
    plain stores. Where they all read one column: summed per owned row, one atomic each. Otherwise (buckets or
    clipping merge some of them): an atomic per score."""
    last_row, last_col = tl.minimum(first_row + BLOCK_M, length) - 1, tl.minimum(first_col + BLOCK_N, length) - 1
    lo, hi = first_row - last_col + length - 1, last_row - first_col + length - 1  # the tile's distances, + L - 1
    alone = tl.load(Shared + hi + 1) == tl.load(Shared + lo)
    one_column = tl.load(Changes + hi) == tl.load(Changes + lo)
    inside = (rows[:, None] < length) & (cols[None, :] < length)
    if one_column:
        only = tl.load(Column + lo)
        if BY_ROWS:
            tl.atomic_add(
                Grad + (rows * grad_l + only * grad_w), tl.sum(grad_scores, 1), mask=rows < length, sem="relaxed"
            )
        else:
            tl.atomic_add(
                Grad + (cols * grad_l + only * grad_w), tl.sum(grad_scores, 0), mask=cols < length, sem="relaxed"
            )
    else:
        r = tl.load(Column + (rows[:, None] - cols[None, :] + length - 1), mask=inside, other=0)
        if BY_ROWS:
            target = Grad + (rows[:, None] * grad_l + r * grad_w)
        else:
            target = Grad + (cols[None, :] * grad_l + r * grad_w)
        if alone:
            tl.store(target, grad_scores, mask=inside)
        else:
            tl.atomic_add(target, grad_scores, mask=inside, sem="relaxed")


@_kernel
def _backward_keys_kernel(
    Q, q_b, q_h, q_l, q_d, K, k_b, k_h, k_l, k_d, V, v_b, v_h, v_l, v_d,
    C2P, c2p_b, c2p_h, c2p_l, c2p_w, P2C, p2c_b, p2c_h, p2c_l, p2c_w, P2P, p2p_h, p2p_d,
    Column, Shared, Changes, Keep, keep_b, keep_l,
    DO, do_b, do_l, do_h, do_d, RowMax, LogSum, Delta,
    heads, length: tl.int32, scaling, dropout, seed, masked,
    DK, dk_b, dk_h, dk_l, dk_d, DV, dv_b, dv_h, dv_l, dv_d, DP2C, dp2c_b, dp2c_h, dp2c_l, dp2c_w, DP2P, dp2p_h, dp2p_d,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_P2P: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dk, dv of BLOCK_N keys over all queries; dS into d_p2c's rows of these keys (and d_p2p)."""
    plane = tl.program_id(1).to(tl.int64)
    b, h = plane // heads, plane % heads
    Q += b * q_b + h * q_h
    K += b * k_b + h * k_h
    V += b * v_b + h * v_h
    if HAS_C2P:  # (an absent input is None, and its code compiled out)
        C2P += b * c2p_b + h * c2p_h
    if HAS_P2C:
        P2C += b * p2c_b + h * p2c_h
    if HAS_P2P:
        P2P += h * p2p_h
    if HAS_MASK:
        Keep += b * keep_b
    DO += b * do_b + h * do_h
    if HAS_P2C:
        DP2C += b * dp2c_b + h * dp2c_h
    if HAS_P2P:
        DP2P += h * dp2p_h
    RowMax += plane * length
    LogSum += plane * length
    Delta += plane * length
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    in_keys = cols[:, None] < length
    k = tl.load(K + (cols[:, None] * k_l + dims[None, :] * k_d), mask=in_keys, other=0.0)
    v = tl.load(V + (cols[:, None] * v_l + dims[None, :] * v_d), mask=in_keys, other=0.0)
    attend = _key_mask(Keep, keep_l, cols, length, HAS_MASK)
    grad_k = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    grad_v = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start in range(0, length, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        valid = rows[:, None] < length
        q = tl.load(Q + (rows[:, None] * q_l + dims[None, :] * q_d), mask=valid, other=0.0)
        do = tl.load(DO + (rows[:, None] * do_l + dims[None, :] * do_d), mask=valid, other=0.0)
        row_max = tl.load(RowMax + rows, mask=rows < length, other=0.0)
        log_sum = tl.load(LogSum + rows, mask=rows < length, other=0.0)
        delta = tl.load(Delta + rows, mask=rows < length, other=0.0)
        dropped, grad_scores = _probabilities_tile(
            q, k, v, do, rows, cols, attend, plane, row_max, log_sum, delta, length, scaling, masked, dropout, seed,
            C2P, c2p_l, c2p_w, P2C, p2c_l, p2c_w, P2P, p2p_d, Column,
            HAS_C2P, HAS_P2C, HAS_P2P, HAS_MASK, HAS_DROPOUT, PRECISION, WIDEN_DOTS,
        )  # fmt: skip
        grad_v += _dot(tl.trans(dropped).to(do.dtype), do, PRECISION, WIDEN_DOTS)
        grad_k += _dot(tl.trans(grad_scores).to(q.dtype), q, PRECISION, WIDEN_DOTS)
        if HAS_P2C:  # p2c[j, δ(i,j)] received dS[i, j]
            _add_to_table(
                DP2C, dp2c_l, dp2c_w, grad_scores, rows, cols, start, tl.program_id(0) * BLOCK_N, length,
                Column, Shared, Changes, False, BLOCK_M, BLOCK_N,
            )  # fmt: skip
        if HAS_P2P:  # p2p[h, i - j + L - 1] received dS[i, j], from every batch row and tile
            inside = (rows[:, None] < length) & (cols[None, :] < length)
            distance = rows[:, None] - cols[None, :] + length - 1
            tl.atomic_add(DP2P + distance * dp2p_d, grad_scores, mask=inside, sem="relaxed")
    DK += b * dk_b + h * dk_h
    tl.store(
        DK + (cols[:, None] * dk_l + dims[None, :] * dk_d), (grad_k * scaling).to(DK.dtype.element_ty), mask=in_keys
    )
    if HAS_DROPOUT:
        grad_v = grad_v / (1.0 - dropout)
    DV += b * dv_b + h * dv_h
    tl.store(DV + (cols[:, None] * dv_l + dims[None, :] * dv_d), grad_v.to(DV.dtype.element_ty), mask=in_keys)


@_kernel
def _backward_queries_kernel(
    Q, q_b, q_h, q_l, q_d, K, k_b, k_h, k_l, k_d, V, v_b, v_h, v_l, v_d,
    C2P, c2p_b, c2p_h, c2p_l, c2p_w, P2C, p2c_b, p2c_h, p2c_l, p2c_w, P2P, p2p_h, p2p_d,
    Column, Shared, Changes, Keep, keep_b, keep_l,
    DO, do_b, do_l, do_h, do_d, RowMax, LogSum, Delta,
    heads, length: tl.int32, scaling, dropout, seed, masked,
    DQ, dq_b, dq_h, dq_l, dq_d, DC2P, dc2p_b, dc2p_h, dc2p_l, dc2p_w,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, HAS_P2P: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dq of BLOCK_M queries over all keys; dS into d_c2p's rows of these queries."""
    plane = tl.program_id(1).to(tl.int64)
    b, h = plane // heads, plane % heads
    Q += b * q_b + h * q_h
    K += b * k_b + h * k_h
    V += b * v_b + h * v_h
    if HAS_C2P:  # (an absent input is None, and its code compiled out)
        C2P += b * c2p_b + h * c2p_h
    if HAS_P2C:
        P2C += b * p2c_b + h * p2c_h
    if HAS_P2P:
        P2P += h * p2p_h
    if HAS_MASK:
        Keep += b * keep_b
    DO += b * do_b + h * do_h
    if HAS_C2P:
        DC2P += b * dc2p_b + h * dc2p_h
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    valid = rows[:, None] < length
    q = tl.load(Q + (rows[:, None] * q_l + dims[None, :] * q_d), mask=valid, other=0.0)
    do = tl.load(DO + (rows[:, None] * do_l + dims[None, :] * do_d), mask=valid, other=0.0)
    row_max = tl.load(RowMax + plane * length + rows, mask=rows < length, other=0.0)
    log_sum = tl.load(LogSum + plane * length + rows, mask=rows < length, other=0.0)
    delta = tl.load(Delta + plane * length + rows, mask=rows < length, other=0.0)
    grad_q = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, length, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_keys = cols[:, None] < length
        k = tl.load(K + (cols[:, None] * k_l + dims[None, :] * k_d), mask=in_keys, other=0.0)
        v = tl.load(V + (cols[:, None] * v_l + dims[None, :] * v_d), mask=in_keys, other=0.0)
        attend = _key_mask(Keep, keep_l, cols, length, HAS_MASK)
        _, grad_scores = _probabilities_tile(
            q, k, v, do, rows, cols, attend, plane, row_max, log_sum, delta, length, scaling, masked, dropout, seed,
            C2P, c2p_l, c2p_w, P2C, p2c_l, p2c_w, P2P, p2p_d, Column,
            HAS_C2P, HAS_P2C, HAS_P2P, HAS_MASK, HAS_DROPOUT, PRECISION, WIDEN_DOTS,
        )  # fmt: skip
        grad_q += _dot(grad_scores.to(k.dtype), k, PRECISION, WIDEN_DOTS)
        if HAS_C2P:  # c2p[i, δ(i,j)] received dS[i, j]
            _add_to_table(
                DC2P, dc2p_l, dc2p_w, grad_scores, rows, cols, tl.program_id(0) * BLOCK_M, start, length,
                Column, Shared, Changes, True, BLOCK_M, BLOCK_N,
            )  # fmt: skip
    DQ += b * dq_b + h * dq_h
    tl.store(DQ + (rows[:, None] * dq_l + dims[None, :] * dq_d), (grad_q * scaling).to(DQ.dtype.element_ty), mask=valid)


@_kernel
def _keep_mask_kernel(Out, length: tl.int32, dropout, seed, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`kept` for a whole [B * H, L, L] int8 tensor: the tests' copy of the kernels' dropout decisions."""
    plane = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < length) & (cols[None, :] < length)
    decision = _kept(seed, plane, rows, cols, length, dropout)
    target = Out + (plane * length + rows[:, None]) * length + cols[None, :]
    tl.store(target, decision.to(tl.int8), mask=inside)
