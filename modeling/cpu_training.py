"""CPU training (paths cpu-training-kernel and cpu-training): `BlockedAttention`, an autograd function that runs
softmax(c2c + c2p + p2c, masked), dropout, @ v one block of query rows at a time (`blocks.py`), with its own backward,
where SDPA with a bias that needs a gradient would run its math path.

Each block makes its own c2p table (and each group of sequences its p2c table), and the backward scatters dS into
those tables and from there into q, k, Kr and Qr; on cpu-training-kernel the bias and the scatter are the compiled
kernel's (`native.hankel_bias`), from banded tables where they save enough (`BAND_MOST`). Dropout's keep mask is
drawn here too (`dropout_keep_mask`, four decisions per 64-bit draw, or the compiled kernel's generator), for the
attention's blocks and for the model's other dropouts on the CPU.

In `modeling/`'s layering (`__init__.py`): layer 2, a PyTorch backend over layer 1's tables; sdpa's runners table
calls it.
"""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import torch
from torch import Tensor

from .blocks import _block_bias, _by_batch_head, _hankel, _tiles
from .disentangled_attention import RelativePositions, _block_mask, _by_head
from .dispatch import native, native_built, switch_value
from .validation import is_tracing
from .workspace import _scratch, int32_column, per_forward

# CPU training's kernel reads banded tables (`native.Band`) where they save enough: a tile of BAND_LINES lines of T
# (rows) or U (keys) reads only the columns of BAND_LINES + L - 2 consecutive distances (160 of 255 columns at 128
# tokens with v3's buckets), so each tile's product is made against those rows of Kr or Qr alone. Banded where the
# band is at most BAND_MOST of the table's width and a group holds BAND_SEQUENCES sequences or more, so that each
# tile's product has 128 lines at least (v3's buckets and 12 heads: 90 to 209 tokens). Whole tables took 1.02 and 1.03
# times as long a training step at 4x128 and 8x128 on a 2-core EPYC (docs/performance.md, c9ac370); one
# layer's attention with one sequence per group timed slower banded at 1x256, and alike at 2x512 (400 of 511 columns).
BAND_LINES = 32
BAND_MOST = 0.7
BAND_SEQUENCES = 4


def _run_cpu_training(
    decision, module, query, key, value, attention_mask, scaling, dropout, position_scores, block_elements
):
    """CPU training: the tables made block by block (`BlockedAttention`), the bias by the kernel where the path says."""
    mask = attention_mask.flip(-1) if attention_mask is not None else None
    pos_key, pos_query = position_scores.pos_key, position_scores.pos_query
    context = BlockedAttention.apply(
        query, key.flip(-2), value.flip(-2), pos_key, pos_query, mask, position_scores.positions, scaling,
        dropout, block_elements, decision.path == "cpu-training-kernel",
    )  # fmt: skip
    return context, None


class BlockedAttention(torch.autograd.Function):
    """softmax(c2c + c2p + p2c, masked), dropout, @ v: one block of query rows at a time, with its own backward.

    For training on the CPU, where SDPA with a bias that needs a gradient runs its math path. Inputs: query,
    reversed key and value [B, H, L, D], the projected relative rows Kr and Qr [H, W, D] (either may be None), a
    reversed bool mask [B, 1, 1 | L, L] or None. Returns the context [B, L, H, D].

    The position tables exist only where a block reads them, in buffers of the workspace: c2p of the block's rows
    (q_i . Kr[r]) and p2c of its group's reversed keys (k_j' . Qr[r]), each one product per head. The forward keeps
    each block's probabilities (and dropout mask), as eager and SDPA's math path keep the whole [B, H, L, L]; q . k
    is added to the gathered position terms by the product itself (`baddbmm_`). The backward sends
    dS = P * (dP - rowsum(dO * O)) into the same two tables' buffers with `scatter_add_`, along the Hankel views the
    forward gathered with, and from there into q and Kr (for each block) and k and Qr (for each group), so no
    other [B, H, L, L] tensor and no whole [B, H, L, W] table is made. Where the compiled kernel runs, it gathers
    each block's bias and sums dS into the tables' gradients in one pass each (`native.hankel_bias`,
    `hankel_bias_backward`; `dispatch.TRAINING_KERNEL`), from banded tables where they save enough (`BAND_MOST`: each
    tile of BAND_LINES lines one product against the rows of Kr or Qr it reads). The workspace is kept between calls
    (on the forward's thread), so a step does not fault in fresh pages for tables that the last step also wrote.
    """

    @staticmethod
    def forward(
        ctx, query, key, value, pos_key, pos_query, mask, positions, scaling, dropout, block_elements=None, kernel=False
    ):
        batch, heads, length, dim = query.shape
        tiles = _tiles(query, block_elements)
        probs, keeps = [], []  # per block: P, and where dropout keeps it
        context = query.new_empty(batch, length, heads, dim)
        # in the query's dtype: under autocast the relative rows may be float32
        kr, qr = (rows.to(query.dtype) if rows is not None else None for rows in (pos_key, pos_query))
        column, tiled = _kernel_column(positions, kernel)
        bands = _band_width(positions) if column is not None else None
        if bands is not None:  # [H, W, D] laid out so, so that a band of its rows is a batch of matrices for bmm
            kr, qr = (rows.contiguous() if rows is not None else None for rows in (kr, qr))
        group, p2c_keys, p2c_first, c2p_first = None, None, None, None
        with torch.autocast(query.device.type, enabled=False):  # the inputs already carry autocast's dtype
            scaled_query = query * scaling  # scaled before q . k, as in eager: q . k itself can overflow float16
            for sequences, first, last in tiles:
                rows = slice(first, last)
                band = _group_band(bands, sequences)
                if qr is not None and sequences != group:  # p2c of this group's reversed keys: k_j' . Qr[r]
                    if band is None:
                        p2c_keys, p2c_first = _position_rows(positions, "p2c", key[sequences], qr), None
                    else:
                        p2c_keys, p2c_first = _banded_rows(positions, "p2c", key[sequences], qr, 0, band)
                    group = sequences
                block_query = query[sequences, :, rows]
                c2p_rows = c2p_first = None
                if kr is not None and band is None:
                    c2p_rows = _position_rows(positions, "c2p", block_query, kr)
                elif kr is not None:
                    c2p_rows, c2p_first = _banded_rows(positions, "c2p", block_query, kr, first, band)
                group_heads = (sequences.stop - sequences.start, heads)
                if column is not None:  # c2p + p2c by the kernel
                    scores = query.new_empty(*group_heads, last - first, length)
                    banded = _band_spec(band, c2p_first, p2c_first)
                    native.hankel_bias(scores, c2p_rows, p2c_keys, column[first:], tiled, banded)
                else:  # p2c read by table row
                    p2c_rows = p2c_keys.mT if p2c_keys is not None else None
                    scores = _block_bias(positions, c2p_rows, p2c_rows, None, first, last, group_heads)
                scores.view(-1, *scores.shape[-2:]).baddbmm_(  # + c2c: q_i . k_j (the bias is fresh, contiguous)
                    _by_batch_head(scaled_query[sequences, :, rows]), _by_batch_head(key[sequences]).mT
                )
                if mask is not None:
                    scores.masked_fill_(~_block_mask(mask, sequences, first, last), torch.finfo(scores.dtype).min)
                block_probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
                block_probs = block_probs.to(query.dtype)
                probs.append(block_probs)
                if dropout > 0:
                    # as 0 / 1 bytes: a float times a uint8 converts it inside the product's loop, where a bool is
                    # first copied into a float tensor (0.65 against 1.22 ms at [12, 341, 512], 2 threads)
                    block_keep = dropout_keep_mask(block_probs.shape, dropout, block_probs.device).view(torch.uint8)
                    keeps.append(block_keep)
                    block_probs = block_probs * block_keep  # a factor: cheaper than a `where` on the CPU
                attended = block_probs @ value[sequences]
                if dropout > 0:  # 1 / (1 - p) on the [n, D] product rather than on the [n, L] probabilities
                    attended.mul_(1 / (1 - dropout))
                context[sequences, rows] = attended.transpose(1, 2)
        ctx.save_for_backward(query, key, value, kr, qr, context, *probs, *keeps)
        ctx.tiles, ctx.positions, ctx.scaling, ctx.dropout, ctx.kernel = tiles, positions, scaling, dropout, kernel
        ctx.bands = bands
        ctx.thread = threading.get_ident()
        ctx.relative_dtypes = tuple(rows.dtype if rows is not None else None for rows in (pos_key, pos_query))
        return context

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_context):
        query, key, value, kr, qr, context, *blocks = ctx.saved_tensors
        tiles, scaling, dropout, positions = ctx.tiles, ctx.scaling, ctx.dropout, ctx.positions
        if ctx.thread != threading.get_ident():  # the workspace is the forward thread's: take fresh buffers
            positions = replace(positions, workspace={})
        probs, keeps = blocks[: len(tiles)], blocks[len(tiles) :] or [None] * len(tiles)
        grad_query, grad_key, grad_value = torch.empty_like(query), torch.zeros_like(key), torch.zeros_like(value)
        # contiguous (the rows are a permuted view of the projection): a product into it runs as one batched call
        grad_kr, grad_qr = (rows.new_zeros(rows.shape) if rows is not None else None for rows in (kr, qr))
        delta = (grad_context * context).sum(-1).transpose(1, 2)  # [B, H, L]: rowsum(dO * O) = rowsum(P * dP)
        column, tiled = _kernel_column(positions, ctx.kernel)
        bands = ctx.bands  # banded as the forward was
        group = grad_p2c = p2c_first = None
        first_of_group = True  # the kernel writes a group's p2c gradient at its first block, and adds to it after
        for (sequences, first, last), block_probs, block_keep in zip(tiles, probs, keeps):
            rows = slice(first, last)
            band = _group_band(bands, sequences)
            if qr is not None and sequences != group:  # the p2c table's gradient, one group of sequences at a time
                if group is not None:
                    _table_backward(positions, "p2c", grad_p2c, p2c_first, key[group], qr, grad_key[group], grad_qr)
                if band is None:
                    grad_p2c = _position_rows(
                        positions, "p2c", key[sequences], qr, fill="zeros" if column is None else None
                    )
                    p2c_first = None
                else:
                    grad_p2c, p2c_first = _banded_rows(positions, "p2c", key[sequences], qr, 0, band, product=False)
                group, first_of_group = sequences, True
            grad_out = grad_context[sequences, rows].transpose(1, 2)  # dO [g, H, n, D]
            dropped = block_probs  # what multiplied v, but for 1 / (1 - p)
            if block_keep is not None:
                grad_out = grad_out * (1 / (1 - dropout))  # [n, D], not [n, L]
                dropped = block_probs * block_keep
            grad_probs = grad_out @ value[sequences].mT  # dP
            if block_keep is not None:
                grad_probs.mul_(block_keep)
            grad_value[sequences] += dropped.mT @ grad_out
            grad_scores = grad_probs.sub_(delta[sequences, :, rows, None]).mul_(block_probs)  # dS, softmax's backward
            block_query = query[sequences, :, rows]
            grad_query[sequences, :, rows] = (grad_scores @ key[sequences]) * scaling
            grad_key[sequences].add_(grad_scores.mT @ block_query, alpha=scaling)
            # c2p[i, column[i + j']] and p2c[j', column[i + j']] received dS[i, j']
            grad_c2p = c2p_first = None
            if kr is not None and band is None:
                grad_c2p = _position_rows(positions, "c2p", block_query, kr, fill=None)
            elif kr is not None:
                grad_c2p, c2p_first = _banded_rows(positions, "c2p", block_query, kr, first, band, product=False)
            if column is not None:  # by the kernel: dS summed into grad_c2p (written) and grad_p2c (added to)
                banded = _band_spec(band, c2p_first, p2c_first)
                native.hankel_bias_backward(
                    grad_scores, grad_c2p, grad_p2c, column[first:], tiled, not first_of_group, banded
                )
                first_of_group = False
            else:
                index = _hankel(positions, first, last - first, positions.length).expand_as(grad_scores)
                if grad_c2p is not None:
                    grad_c2p.zero_().scatter_add_(-1, index, grad_scores)
                if grad_p2c is not None:
                    grad_p2c.mT.scatter_add_(-2, index, grad_scores)
            if grad_c2p is not None:  # c2p passes its gradient on to q_i and Kr
                _table_backward(
                    positions, "c2p", grad_c2p, c2p_first, block_query, kr, grad_query[sequences, :, rows], grad_kr
                )
        if group is not None:
            _table_backward(positions, "p2c", grad_p2c, p2c_first, key[group], qr, grad_key[group], grad_qr)
        grad_pos_key, grad_pos_query = (
            grad.to(dtype) if grad is not None else None for grad, dtype in zip((grad_kr, grad_qr), ctx.relative_dtypes)
        )
        return grad_query, grad_key, grad_value, grad_pos_key, grad_pos_query, None, None, None, None, None, None


def _position_rows(
    positions: RelativePositions, kind: str, content: Tensor, relative: Tensor, fill: str | None = "product"
) -> Tensor:
    """content [g, H, n, D] against relative rows [H, W, D]: the table [g, H, n, W] in the workspace's `kind` buffer
    (laid out [H, g, n, W]: one product per head); with `fill` "zeros" or None, a zeroed or an unwritten buffer of
    that shape, for its gradient."""
    groups, heads, count, _ = content.shape
    table = _scratch(positions.workspace, kind, (heads, groups * count, relative.shape[-2]), content)
    if fill == "zeros":
        table.zero_()
    elif fill == "product":
        _by_head(content, relative, out=table)
    return table.view(heads, groups, count, -1).transpose(0, 1)


def _band_width(positions: RelativePositions) -> int | None:
    """The width of CPU training's banded tables for this forward (`BAND_LINES`), a multiple of 16: the most columns
    that BAND_LINES consecutive lines read, from any line on; None where that is more than BAND_MOST of the width."""

    def make(positions: RelativePositions) -> int | None:
        length, width, column = positions.length, positions.width, positions.column
        starts = torch.arange(length, device=column.device)
        ends = (starts + BAND_LINES + length - 2).clamp(max=2 * length - 2)  # line + BAND_LINES - 1, key L - 1
        band = -(-(int((column[ends] - column[starts]).max()) + 1) // 16) * 16
        return band if band <= BAND_MOST * width else None

    return per_forward(positions, "band width", make)


def _group_band(bands: int | None, sequences: slice) -> int | None:
    """The band width for a group of sequences (`_band_width`), or None: banded where a tile's product has at least
    BAND_SEQUENCES x BAND_LINES lines (fewer timed slower than whole tables at 1x256 and 2x512)."""
    return bands if bands is not None and sequences.stop - sequences.start >= BAND_SEQUENCES else None


def _band_first(positions: RelativePositions, first: int, count: int, band: int) -> tuple[list[int], Tensor]:
    """The table column of column 0 of each tile of `count` lines from line `first` on (Python ints, and int32 for the
    kernel): the tile's first line's column (key 0), or as far as the band still fits in the table."""

    def make(positions: RelativePositions) -> tuple[list[int], Tensor]:
        starts = torch.arange(first, first + count, BAND_LINES).clamp(max=2 * positions.length - 2)
        firsts = positions.column[starts].clamp(max=positions.width - band)
        return firsts.tolist(), firsts.to(torch.int32)

    return per_forward(positions, f"band first {first} {count}", make)


def _band_spec(band: int | None, c2p_first, p2c_first) -> native.Band | None:
    """What the kernel is told of the tables: banded (`_band_first`'s int32 columns of each) where `band` is set."""
    if band is None:
        return None
    return native.Band(BAND_LINES, *(first[1] if first is not None else None for first in (c2p_first, p2c_first)))


def _lines(positions: RelativePositions, kind: str, content: Tensor) -> Tensor:
    """content [g, H, n, D] in tiles of BAND_LINES lines: [tiles, H, g, BAND_LINES, D] in the workspace's `kind`
    buffer, zeros after the last line (one product per tile against its band)."""
    groups, heads, count, dim = content.shape
    tiles, whole = -(-count // BAND_LINES), count // BAND_LINES
    packed = _scratch(positions.workspace, kind, (tiles, heads, groups, BAND_LINES, dim), content)
    if whole:
        packed[:whole].permute(2, 1, 0, 3, 4).copy_(
            content[:, :, : whole * BAND_LINES].unflatten(2, (whole, BAND_LINES))
        )
    if whole < tiles:
        rest = count - whole * BAND_LINES
        packed[whole, :, :, :rest].copy_(content[:, :, whole * BAND_LINES :].transpose(0, 1))
        packed[whole, :, :, rest:].zero_()
    return packed


def _banded_rows(
    positions: RelativePositions, kind: str, content: Tensor, relative: Tensor, first: int, band: int, product=True
) -> tuple[Tensor, tuple[list[int], Tensor]]:
    """The banded table of content [g, H, n, D] (lines first .. first + n - 1) against the relative rows [H, W, D]:
    [tiles, H, g, BAND_LINES, band] in the workspace's `kind` buffer, tile k against rows firsts[k] .. firsts[k] +
    band - 1 only (`native.Band`); with `product` False, an unwritten buffer of that shape for its gradient. Returns
    it with the tiles' first columns (`_band_first`)."""
    groups, heads, count, dim = content.shape
    firsts = _band_first(positions, first, count, band)
    table = _scratch(positions.workspace, kind, (-(-count // BAND_LINES), heads, groups, BAND_LINES, band), content)
    if product:
        packed = _lines(positions, f"{kind} lines", content)
        for k, start in enumerate(firsts[0]):
            flat = table[k].view(heads, groups * BAND_LINES, band)
            torch.bmm(packed[k].view(heads, groups * BAND_LINES, dim), relative[:, start : start + band].mT, out=flat)
    return table, firsts


def _table_backward(
    positions: RelativePositions,
    kind: str,
    grad_table: Tensor,
    firsts: tuple[list[int], Tensor] | None,
    content: Tensor,
    relative: Tensor,
    grad_content: Tensor,
    grad_relative: Tensor,
) -> None:
    """The gradient of a `_position_rows` table (`firsts` None) or a `_banded_rows` one into `grad_content` and
    `grad_relative`: dcontent += dT R and drelative += dTᵀ content, for a banded table tile by tile (the lines after
    the last, which the kernel leaves unwritten, zeroed first)."""
    if firsts is None:
        _position_rows_backward(grad_table, content, relative, grad_content, grad_relative)
        return
    tiles, heads, groups, lines, band = grad_table.shape
    count, dim = content.shape[2], content.shape[3]
    grad_table[-1, :, :, count - (tiles - 1) * lines :].zero_()
    packed = _lines(positions, f"{kind} lines", content)
    for k, start in enumerate(firsts[0]):
        flat_grad = grad_table[k].view(heads, groups * lines, band)
        # into a fresh product, then added: baddbmm_ into a band of rows (not one contiguous tensor) runs head by head
        grad_relative[:, start : start + band] += torch.bmm(flat_grad.mT, packed[k].view(heads, groups * lines, dim))
        part = torch.bmm(flat_grad, relative[:, start : start + band]).view(heads, groups, lines, dim).transpose(0, 1)
        used = min(lines, count - k * lines)
        grad_content[:, :, k * lines : k * lines + used] += part[:, :, :used]


def _kernel_column(positions: RelativePositions, kernel: bool) -> tuple[Tensor | None, bool]:
    """The int32 column vector for `hankel_bias` where CPU training's kernel serves the call (`kernel`, decided by
    `dispatch.decide`; else None), and whether its tiles can run (`native.kernel_columns`)."""
    if not kernel:
        return None, False
    return int32_column(positions), native.kernel_columns(positions) is not None


def _position_rows_backward(
    grad_table: Tensor, content: Tensor, relative: Tensor, grad_content: Tensor, grad_relative: Tensor
) -> None:
    """The gradient of a `_position_rows` table [g, H, n, W]: dcontent = dT R is added to `grad_content`
    [g, H, n, D] and drelative = dTᵀ content to `grad_relative` [H, W, D], one product per head."""
    groups, heads, count, dim = content.shape
    flat_grad = grad_table.transpose(0, 1).reshape(heads, groups * count, -1)  # a view of the [H, g * n, W] buffer
    flat_content = content.transpose(0, 1).reshape(heads, groups * count, dim)  # a view when g = 1
    grad_content += torch.bmm(flat_grad, relative).view(heads, groups, count, dim).transpose(0, 1)
    grad_relative.baddbmm_(flat_grad.mT, flat_content)


DROPOUT_BITS = 15  # random bits per dropout decision (`dropout_keep_mask`)


def dropout_keep_mask(shape: tuple[int, ...], dropout: float, device) -> Tensor:
    """A bool mask of `shape`, each entry True with probability 1 - dropout, independently.

    Each entry compares 15 random bits with round((1 - dropout) * 2^15), and one 64-bit draw gives four entries:
    PyTorch's CPU generator costs the same per element whatever the element's width (`torch.rand` and
    `bernoulli_` draw one float per entry, and were the largest single cost of a CPU training step at 512
    tokens). The keep probability is thus rounded to a multiple of 2^-15 (0.9 becomes 0.899994); PyTorch's
    CUDA flash attention rounds it to a multiple of 1/255.
    """
    count, threshold = math.prod(shape), round((1 - dropout) * (1 << DROPOUT_BITS))
    if torch.device(device).type == "cpu" and switch_value("DROPOUT_KERNEL") and not is_tracing() and native_built():
        # the compiled kernel: the same layout of 15-bit lanes, from a counter-based generator seeded by one draw of
        # PyTorch's, in one pass (`benchmarks.train_step --pytorch-dropout` times it against the passes below)
        seed = int(torch.empty((), dtype=torch.int64).random_())
        return native.keep_mask(torch.empty(count, dtype=torch.uint8), seed, threshold).view(torch.bool).view(shape)
    words = torch.empty(-(-count // 4), dtype=torch.int64, device=device).random_()  # 63 random bits each
    lanes = words.view(torch.int16)[:count].bitwise_and_((1 << DROPOUT_BITS) - 1)  # 15 bits per lane
    return (lanes < threshold).view(shape)
