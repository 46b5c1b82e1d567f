"""CPU inference of disentangled attention by distance, for `sdpa_disentangled` (no gradients, no dropout, no p2p).

The terms are products with the relative rows by distance rather than by bucket, T = q Kr[δ(d)]ᵀ per block and
U = k Qr[δ(d)]ᵀ per block and band of keys, so that a block's c2p and p2c are strided views of T and U (d = i - j
moves by one along a row or a column): one add makes the bias, no index is read per element. Keys beyond the
buckets' reach (where the column stops changing) need no dense bias at all: c2p is a constant of the row there and
p2c a bias of the key, so for each block the keys before and after its band run as two plain attentions with a key
bias, merged with the band's by log-sum-exp (`_attend_by_distance` gives the details).

Where the compiled kernel runs (`native.py`: float32 or bfloat16, a processor with AVX-512, AVX2 + FMA or NEON and a C compiler), it makes
each block's bias instead, from T and U by bucket (one product per block and one per group of sequences), in one
pass that PyTorch's operators would take three for (a gather or transposing copy, a copy, an add); the far keys are
then split off from KERNEL_SPLIT_LENGTH tokens on only. With 64 dimensions per head and no mask or a key mask, the
compiled kernel runs the whole attention instead (`_attend_fused`: bfloat16 on AMX, float32 on AVX-512), the
bias made inside its tiles and never written. Which of the three serves a call is decided by `dispatch.decide`; each
has its runner here for sdpa's table (cpu-fused: `_run_cpu_fused`; cpu-bias-kernel and cpu-by-distance:
`_run_by_distance`).

In `modeling/`'s layering (`__init__.py`): layer 3, the CPU kernels' path, which sdpa calls.
"""

from __future__ import annotations

import bisect
import math

import torch
from torch import Tensor
from torch.nn import functional as F

from .disentangled_attention import PositionScores, RelativePositions, _block_mask, _by_head
from .dispatch import KERNEL_TABLE_ELEMENTS, native
from .workspace import _scratch

# The CPU flash kernel, which also returns the log-sum-exp (None on torch without it)
cpu_flash_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
CPU_FLASH_WITH_LSE = cpu_flash_attention is not None


# Bias elements per block of the CPU inference path (4 MiB in float32, so that bias and T stay in cache; 2^19 to
# 2^21 timed alike within the noise of a shared AVX-512 Xeon)
DISTANCE_BLOCK_ELEMENTS = 1 << 20
DISTANCE_MIN_ROWS = 192  # query rows per block at least (see `_attend_by_distance`)
# Columns of each T and U product rounded up to a multiple of this (spare columns are computed and never read):
# 64-deep products of 255, 639 or 1,017 columns took 1.1-1.9x the time of 256, 640 or 1,024 on an AVX-512 EPYC
# (`python -m benchmarks.cpu_inference --products`).
PRODUCT_COLUMNS_MULTIPLE = 16
# Keys per band of U (`_band_table`): a band computes rows + 63 distances per key for the `rows` it is read at
# (1.33x at 192 rows), in one product; bands of 32 and 128 keys timed slower at 4x512 and 1x2048 on a 2-core Xeon
BAND_TABLE_KEYS = 64
# With the kernel the far keys are split off (below) only from this length on: a dense bias of the band and the far
# keys costs the kernel little to make, and below 4,096 tokens one SDPA call timed faster than three and a merge.
KERNEL_SPLIT_LENGTH = 4096
# Bias elements per block with the kernel in bfloat16 (8 MiB): fewer, larger SDPA calls, which timed a little faster
# at 4x512 and 1x2048 on a 2-core Xeon with AMX in a one-off A/B (float32 timed best at DISTANCE_BLOCK_ELEMENTS)
KERNEL_BFLOAT16_BLOCK_ELEMENTS = 1 << 22
# Which of the three paths below serves a call is `dispatch.decide`'s (switches CPU_KERNEL and CPU_FUSED there).
# float32 runs the fused attention too (AVX-512 products), at every length: with the values packed per plane
# it timed 1.18 / 1.33 times BERT at 1x4096 / 1x8192 against the bias kernel's 1.38 / 1.61 (far keys split off), one
# process, 2 threads, 1 layer (before the packing, 1.42 against 1.39 at 1x4096).


# The runners of sdpa's table (`sdpa_attention.RUNNERS`) for the paths of this file: (decision, module, query, key,
# value, attention_mask, scaling, dropout, position_scores, block_elements) -> (context [B, L, H, D], None).


def _run_cpu_fused(
    decision, module, query, key, value, attention_mask, scaling, dropout, position_scores, block_elements
):
    """cpu-fused: the whole attention by the compiled kernel, the bias made inside its tiles (`_attend_fused`)."""
    positions = position_scores.positions
    # in the query's dtype: under autocast the projections may be float32
    rows = (position_scores.pos_key, position_scores.pos_query)
    pos_key, pos_query = (t.to(query.dtype) if t is not None else None for t in rows)
    kernel = _KernelTables(positions, pos_key, pos_query)
    context = _attend_fused(kernel, positions, query, key, value, attention_mask, scaling)
    return _uniform_where_padding(context, value, attention_mask), None


def _run_by_distance(
    decision, module, query, key, value, attention_mask, scaling, dropout, position_scores, block_elements
):
    """cpu-bias-kernel and cpu-by-distance (`_attend_by_distance`, as the path says)."""
    context = _attend_by_distance(
        position_scores, query, key, value, attention_mask, scaling, block_elements, path=decision.path
    )
    return context, None


def _round_up(columns: int) -> int:
    return -(-columns // PRODUCT_COLUMNS_MULTIPLE) * PRODUCT_COLUMNS_MULTIPLE


def _rows_by_distance(relative: Tensor, positions: RelativePositions, first: int, step: int, count: int) -> Tensor:
    """relative[:, column of d] ([H, count + spare, D]) for the distances d = first, first + step, ... (step 1 or
    -1), and PRODUCT_COLUMNS_MULTIPLE - 1 spare rows after them, so that a product over any run of the rows can be
    widened to a multiple of PRODUCT_COLUMNS_MULTIPLE columns (the spare distances are clamped into [1 - L, L - 1])."""
    length, spare = positions.length, PRODUCT_COLUMNS_MULTIPLE - 1
    distances = torch.arange(count + spare, device=positions.column.device) * step + first
    return relative.index_select(-2, positions.column[distances.clamp(1 - length, length - 1) + length - 1])


def _skewed(table: Tensor, offset: int, row_step: int, column_step: int, shape: tuple[int, int]) -> Tensor:
    """A [g, H, rows, columns] view of a [g, H, x, y] table: element (a, b) of each (g, H) slice is
    `offset + a * row_step + b * column_step` elements after that slice's first element."""
    strides = (table.stride(0), table.stride(1), row_step, column_step)
    return table.as_strided((*table.shape[:2], *shape), strides, table.storage_offset() + offset)


def _attend_by_distance(
    position_scores: PositionScores,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    scaling: float,
    block_elements: int | None = None,
    path: str = "cpu-by-distance",
) -> Tensor:
    """CPU inference: the position terms read from tables by distance, so that a block's bias is a view, not a gather.

    `path` is `dispatch.decide`'s: "cpu-by-distance" (PyTorch alone, as below) or "cpu-bias-kernel" (each block's bias
    by the compiled kernel, from the tables by bucket; "cpu-fused" is `_attend_fused`'s).

    For query rows [first, last) against keys [k0, k1), the distances d = i - j cover an interval of
    (rows + keys - 1) values, so each term is a product with the relative rows of those distances, and its bias
    is a strided view of the product (no index is read per element):

      c2p[i, j] = q_i . Kr[δ(i - j)] = T[i, high - (i - j)],  T = q_rows [Kr[δ(high)], ..., Kr[δ(low)]]ᵀ
      p2c[i, j] = k_j . Qr[δ(i - j)] = U[j, (i - j) - low],   U = k [Qr[δ(low)], ..., Qr[δ(high)]]ᵀ

    One add of the two views makes a block's bias. U is computed for each block, by band of 64 keys, each band
    only at the distances the block's rows read it at (`_band_table`), just before the add reads it; a padded
    key's row of U, filled with the dtype's minimum, masks it.

    Distances beyond the buckets' reach (d <= near[0] or d >= near[1]) all read one column, so there c2p is a
    constant of the row and p2c a bias of the key. A block's keys are those of its band (near[0] < i - j < near[1]
    for some row i of the block), where T and U hold every distance, beyond the reach too; the keys before them
    and after them are beyond the reach for every row of the block, and each side runs as one plain attention over
    them with its key bias (no dense bias, no causal mask), its row constant added to its log-sum-exp. The three
    parts are merged by log-sum-exp, which the CPU flash kernel returns, so that SDPA covers each query-key pair
    once. Keys that are padding in every sequence of a group, before its first kept key or after its last
    (`_unpadded_span`), take part in no product and no call. A block holds at most `block_elements` bias elements
    (DISTANCE_BLOCK_ELEMENTS by default). Returns [B, L, H, D].
    """
    batch, heads, length, dim = query.shape
    positions, pos_key, pos_query = position_scores.positions, position_scores.pos_key, position_scores.pos_query
    # in the query's dtype: under autocast the projections may be float32 (matmul's out= is not autocast)
    pos_key, pos_query = (t.to(query.dtype) if t is not None else None for t in (pos_key, pos_query))
    lowest = torch.finfo(query.dtype).min
    key_mask = mask is not None and mask.shape[-2] == 1
    near_low, near_high = positions.near
    # the kernel's tables by bucket; None: T and U by distance, below
    kernel = _KernelTables(positions, pos_key, pos_query) if path == "cpu-bias-kernel" else None
    if block_elements is None:
        bfloat16_kernel = kernel is not None and query.dtype == torch.bfloat16
        block_elements = KERNEL_BFLOAT16_BLOCK_ELEMENTS if bfloat16_kernel else DISTANCE_BLOCK_ELEMENTS
    # With the kernel a dense bias costs little to make; the split pays from KERNEL_SPLIT_LENGTH tokens on
    split = CPU_FLASH_WITH_LSE and (mask is None or key_mask) and near_high - near_low + 1 < length
    split = split and (kernel is None or length >= KERNEL_SPLIT_LENGTH)
    if not split:  # every distance is in the band
        near_low, near_high = -length, length
    width = min(length, near_high - near_low - 1)  # keys of a row in the band
    groups = -(-batch // max(1, block_elements // (heads * length * width)))  # sequences per block: balanced
    group = -(-batch // groups)
    if kernel is not None:  # the group's p2c table within KERNEL_TABLE_ELEMENTS (one sequence's is, or no kernel)
        group = min(group, KERNEL_TABLE_ELEMENTS // (heads * length * kernel.width))
    step = max(1, min(length, block_elements // (group * heads * width)))
    # The CPU flash kernel splits the queries of a call into tiles of 32 rows below 192 rows and of 64 from there
    # on; each tile reads all its keys, so blocks of 192 rows or more read the keys half as often.
    step = max(step, min(length, DISTANCE_MIN_ROWS))
    blocks = []  # (rows, band keys): keys j with near_low < i - j < near_high for some row i of the block
    for first in range(0, length, step):
        last = min(first + step, length)
        blocks.append((slice(first, last), slice(max(0, first - near_high + 1), min(length, last - near_low))))
    low = min(rows.start - keys.stop + 1 for rows, keys in blocks)  # the distances the bands read
    high = max(rows.stop - 1 - keys.start for rows, keys in blocks)
    # The masked keys' value in U: the dtype's minimum absorbs every term added to it (float16's would not).
    fill_keys = key_mask and pos_query is not None and query.dtype != torch.float16 and kernel is None
    masked_in_bias = fill_keys or (kernel is not None and key_mask)  # else a masked_fill of each block's bias
    # Kr by distance descending from `high`, Qr ascending from `low`: the distances T and U read
    kr_descending = qr_ascending = None
    if kernel is None:
        kr_descending = _rows_by_distance(pos_key, positions, high, -1, high - low + 1) if pos_key is not None else None
        qr_ascending = (
            _rows_by_distance(pos_query, positions, low, 1, high - low + 1) if pos_query is not None else None
        )
    context = query.new_empty(batch, length, heads, dim)
    for start in range(0, batch, group):
        sequences = slice(start, min(start + group, batch))
        group_mask = mask[sequences] if mask is not None and mask.shape[0] > 1 else mask
        group_query, group_key, group_value = query[sequences], key[sequences], value[sequences]
        padded_keys = _padded_keys(group_mask) if fill_keys else []  # U's rows of these keys are masked
        span = _unpadded_span(group_mask, length) if key_mask else slice(0, length)
        group_p2c = group_keep = None
        if kernel is not None:  # U of the group's keys, and its key mask as the kernel reads it
            group_p2c = kernel.p2c(positions, group_key, span)
            group_keep = group_mask[:, 0, 0].to(torch.uint8) if key_mask else None
        far = []  # the keys beyond the reach of every row of a block: the far terms of each side (`_far_terms`)
        if split:
            far = _far_terms(positions, pos_key, pos_query, group_query, group_key, group_mask, span)
        for rows, band_keys in blocks:
            keys = slice(max(band_keys.start, span.start), min(band_keys.stop, span.stop))
            if keys.start >= keys.stop:  # the band holds padding only: it keeps its keys, all masked
                keys = band_keys
            shape = (rows.stop - rows.start, keys.stop - keys.start)
            bias = None
            if kernel is not None:  # both terms and the key mask in one pass
                bias = kernel.bias(positions, group_query, group_p2c, group_keep, rows, keys, span)
            elif pos_key is not None:  # c2p = T[a, (rows - 1) - a + b]: T's columns descend from the block's highest d
                block_high, block_low = rows.stop - 1 - keys.start, rows.start - keys.stop + 1
                count, members = block_high - block_low + 1, sequences.stop - sequences.start
                # T's first `above` and last `below` columns are distances beyond the reach, where c2p is the row
                # constant of that side: they are filled with it; only the columns within the reach are a product
                # (into a column slice of T: a strided out=, slower per column than a contiguous one, on fewer columns).
                above, below = max(0, block_high - near_high + 1), max(0, near_low - block_low + 1)
                columns = _round_up(count - above - below)
                width = _round_up(max(count, above + columns))
                product = _scratch(positions.workspace, "c2p", (heads, members * shape[0], width), query)
                offset = high - block_high + above  # Kr's row of distance block_high - above
                within = kr_descending[:, offset : offset + columns]
                _by_head(group_query[:, :, rows], within, out=product[..., above : above + columns])
                table_c2p = product.view(heads, members, shape[0], width).transpose(0, 1)
                if above:  # far left: q_i . Kr[column] (`_far_terms`)
                    table_c2p[..., :above] = far[0][1][:, :, rows, None]
                if below:  # far right, after the product, whose spare columns may reach into these
                    table_c2p[..., count - below : count] = far[1][1][:, :, rows, None]
                row, column = table_c2p.stride(2), table_c2p.stride(3)
                bias = _skewed(table_c2p, (shape[0] - 1) * column, row - column, column, shape)
            if pos_query is not None and kernel is None:  # p2c from U by band of keys, for these rows (`_band_table`)
                table = _band_table(positions, group_key, qr_ascending, low, (rows, keys), padded_keys)
                parts = _band_views(table, shape[0])
                bias_shape = (sequences.stop - sequences.start, heads, *shape)
                bias = _add_by_key_chunks(bias, parts, _scratch(positions.workspace, "bias", bias_shape, query))
            if group_mask is not None and not masked_in_bias:
                bias = bias.masked_fill(~_block_mask(group_mask, slice(None), rows.start, rows.stop)[..., keys], lowest)
            block_query = group_query[:, :, rows]
            block_key, block_value = group_key[:, :, keys], group_value[:, :, keys]
            sides = []  # the span's keys before and after the band: beyond the reach of every row of the block
            if far:
                sides = [
                    slice(span.start, min(span.stop, band_keys.start)),
                    slice(max(span.start, band_keys.stop), span.stop),
                ]
            if not any(side.start < side.stop for side in sides):  # the band alone: no merge
                attended = F.scaled_dot_product_attention(
                    block_query, block_key, block_value, attn_mask=bias, scale=scaling
                )
                context[sequences, rows] = attended.transpose(1, 2)
                continue
            parts = [cpu_flash_attention(block_query, block_key, block_value, attn_mask=bias, scale=scaling)]
            for side, (key_bias, row_constant) in zip(sides, far):
                if side.start < side.stop:  # one call with the side's key bias, no mask of rows
                    part, lse = cpu_flash_attention(
                        block_query,
                        group_key[:, :, side],
                        group_value[:, :, side],
                        attn_mask=key_bias[..., side.start - span.start : side.stop - span.start],
                        scale=scaling,
                    )
                    parts.append((part, lse + row_constant[..., rows] if row_constant is not None else lse))
            _merge_parts(context[sequences, rows].transpose(1, 2), parts)
    return _uniform_where_padding(context, value, mask)


def _uniform_where_padding(context: Tensor, value: Tensor, mask: Tensor | None) -> Tensor:
    """A sequence of padding only attends uniformly to every key, as in eager: its rows saw only the group's
    unpadded span (or no key at all), and the split parts' log-sum-exps all round to the dtype's minimum."""
    if mask is not None and mask.shape[-2] == 1 and not mask.all():
        for sequence in (~mask.flatten(1).any(-1)).nonzero().flatten().tolist():
            if mask.shape[0] > 1:
                context[sequence] = value[sequence].mean(-2).unsqueeze(0)
            else:
                context[:] = value.mean(-2).unsqueeze(1)
    return context


def _attend_fused(
    kernel: _KernelTables,
    positions: RelativePositions,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    scaling: float,
) -> Tensor:
    """Attention with the position terms made inside the tile (`native.attend`, on AMX): one kernel call for the batch,
    or one per sequence over the keys of its unpadded span where a [B, 1, 1, L] key mask differs between sequences;
    the kernel makes T and U from Kr and Qr itself, in cache, and no bias is written. Returns [B, L, H, D]."""
    batch, heads, length, _ = query.shape
    pos_key, pos_query = (native.as_key_tiles(t) if t is not None else None for t in (kernel.pos_key, kernel.pos_query))
    context = query.new_empty(batch, length, heads, query.shape[-1])
    groups = [slice(0, batch)] if mask is None or mask.shape[0] == 1 else [slice(b, b + 1) for b in range(batch)]
    for sequences in groups:  # each sequence its own span of keys (one group where every sequence has the same)
        group_mask = mask[sequences] if mask is not None and mask.shape[0] > 1 else mask
        span = _unpadded_span(group_mask, length) if group_mask is not None else slice(0, length)
        keep = group_mask[:, 0, 0, span].to(torch.uint8) if group_mask is not None else None
        workspace = _scratch(
            positions.workspace, "attend", (native.workspace_bytes(span.stop - span.start, kernel.width),), _BYTES
        )
        native.attend(
            context[sequences],
            query[sequences],
            key[sequences],
            value[sequences],
            pos_key,
            pos_query,
            kernel.column,
            kernel.c2p_column,
            keep,
            span,
            scaling,
            workspace,
        )
    return context


_BYTES = torch.empty(0, dtype=torch.uint8)


class _KernelTables:
    """The tables the compiled kernel reads, by bucket (`native.position_bias`): Kr in reverse row order and Qr,
    each padded with zero rows to a multiple of 16 columns, and the int32 column of each distance for either."""

    spare = 16  # elements after each table: the kernel loads 16 columns at a time, past a row's end too

    def __init__(self, positions: RelativePositions, pos_key: Tensor | None, pos_query: Tensor | None):
        width = _round_up(positions.width)
        # Kr's rows reversed: along a row of the bias (i - j descending) both tables are read in ascending columns
        pos_key = pos_key.flip(1) if pos_key is not None else None
        self.pos_key, self.pos_query = (
            F.pad(t, (0, 0, 0, width - t.shape[1])) if t is not None else None for t in (pos_key, pos_query)
        )
        self.width = width
        self.column, self.c2p_column = native.kernel_columns(positions)

    def _product(self, positions: RelativePositions, kind: str, rows: Tensor, relative: Tensor) -> Tensor:
        groups, heads, count, _ = rows.shape
        buffer = _scratch(positions.workspace, kind, (heads * groups * count * self.width + self.spare,), rows)
        return _by_head(rows, relative, out=buffer[: -self.spare].view(heads, groups * count, self.width))

    def p2c(self, positions: RelativePositions, key: Tensor, span: slice) -> Tensor | None:
        """U = k Qrᵀ for the keys of `span`, [g, H, keys, W]: one product per group of sequences."""
        return (
            self._product(positions, "p2c table", key[:, :, span], self.pos_query)
            if self.pos_query is not None
            else None
        )

    def bias(self, positions, query, p2c, keep, rows: slice, keys: slice, span: slice) -> Tensor:
        """The block's bias [g, H, rows, keys]: T = q Krᵀ of its rows (one product), then the kernel; the keys that
        `keep` (uint8 [g | 1, L], or None) marks 0 hold the dtype's minimum."""
        shape = (query.shape[0], query.shape[1], rows.stop - rows.start, keys.stop - keys.start)
        out = _scratch(positions.workspace, "bias", shape, query)
        if keys.start >= span.stop or keys.stop <= span.start:  # a band of padding only (keys the key mask drops)
            return out.fill_(torch.finfo(query.dtype).min)
        c2p = self._product(positions, "c2p", query[:, :, rows], self.pos_key) if self.pos_key is not None else None
        if p2c is not None:
            p2c = p2c[:, :, keys.start - span.start : keys.stop - span.start]
        keep = keep[:, keys] if keep is not None else None
        return native.position_bias(out, c2p, p2c, self.column, self.c2p_column, keep, rows.start, keys.start)


ADD_CHUNK_KEYS = 512  # keys per add of the c2p and p2c views (see `_add_by_key_chunks`)


def _add_by_key_chunks(c2p: Tensor | None, parts: list[tuple[slice, Tensor]], out: Tensor) -> Tensor:
    """out = c2p + p2c ([g, H, rows, keys]; c2p, a view of T, may be None), one part of p2c's keys at a time.

    Each part is (keys, view) from `_band_views`: [g, H, rows, bands, keys per band] for whole bands of U, or
    [g, H, rows, keys] for a partial one. Along a row of the block, the p2c view steps from one row of U to the
    next, one cache line per key; the next query row reads the same lines one element on. In parts of at most 512
    keys those lines (32 KiB) stay in L1 from one query row to the next; a whole row of 1,000 keys or more would not
    (`benchmarks.cpu_inference` times both).

    In bfloat16 and float16 the add is a copy of the p2c view and an add of c2p in place: one add that reads a strided
    operand converts element by element (1.7 ms for a [12, 192, 512] block in bfloat16, 3.4 ms in float16, against
    1.0 ms for the two, on a Xeon with AMX), while a copy needs no conversion and the add then reads two operands in
    order. Both round c2p + p2c once: the sums are the same."""
    split = out.dtype in (torch.bfloat16, torch.float16)
    for keys, p2c in parts:
        target = out[..., keys]
        c2p_keys = c2p[..., keys] if c2p is not None else None
        if p2c.dim() == 5:  # whole bands: the block's keys as [bands, keys per band]
            target = target.unflatten(-1, p2c.shape[-2:])
            c2p_keys = c2p_keys.unflatten(-1, p2c.shape[-2:]) if c2p_keys is not None else None
        if c2p_keys is None:
            target.copy_(p2c)
        elif split:
            target.copy_(p2c).add_(c2p_keys)
        else:
            torch.add(c2p_keys, p2c, out=target)
    return out


def _band_table(
    positions: RelativePositions,
    key: Tensor,
    qr_ascending: Tensor,
    low: int,
    block: tuple[slice, slice],
    padded: list[tuple[int | None, list[int]]],
) -> list[Tensor]:
    """U of a block's keys for its query rows only, `block` = (rows, keys), by band of `BAND_TABLE_KEYS` keys, over a
    group of sequences ([g, H, L, D] `key`): built for each block, just before its add reads it.

    Band [s, e) is [H, g, e - s, columns], contiguous: U[j, c] = k_j . Qr[δ(c + first + 1 - e)] for key j of the
    band and rows [first, last), so that row i reads key j at column c = (i - first) - (j - s) + (e - s - 1), and
    0 <= c < rows + (e - s) - 1. A band's row holds the distances its key is read at by these rows (a parallelogram
    in bands, 1.33x the block's pairs for 192 rows), and each band is one product written where it stays. Until
    1d6c8aa U was one table by distance per sequence, computed once: at 512 tokens and more it was no longer in
    cache when the blocks read it, and the add, which reads one cache line per key, waited on memory
    (`python -m benchmarks.cpu_inference --baseline 713ad96` times the two). Bands lie one after another, so that
    `_band_view` reads several whole bands in one view. `qr_ascending` is Qr by distance from `low`. The rows of
    the `padded` keys (`_padded_keys`) hold the dtype's minimum.
    """
    (rows, keys), (groups, heads, _, _) = block, key.shape
    sizes = [min(BAND_TABLE_KEYS, keys.stop - first) for first in range(keys.start, keys.stop, BAND_TABLE_KEYS)]
    widths = [_round_up(rows.stop - rows.start + size - 1) for size in sizes]
    buffer = _scratch(
        positions.workspace, "band table", (heads * groups * sum(map(math.prod, zip(sizes, widths))),), key
    )
    bands, offset, start = [], 0, keys.start
    for size, width in zip(sizes, widths):
        table = buffer[offset : offset + heads * groups * size * width].view(heads, groups, size, width)
        nearest = rows.start + 1 - (start + size)  # the distance of column 0
        product = table.view(heads, groups * size, width)
        _by_head(key[:, :, start : start + size], qr_ascending[:, nearest - low : nearest - low + width], out=product)
        for sequence, padded_keys in padded:  # sorted: the band's are one run of them
            inside = padded_keys[bisect.bisect_left(padded_keys, start) : bisect.bisect_left(padded_keys, start + size)]
            if inside:
                inside = [index - start for index in inside]
                target = table[:, sequence] if sequence is not None else table
                target.index_fill_(-2, torch.tensor(inside, device=table.device), torch.finfo(key.dtype).min)
        bands.append(table)
        offset, start = offset + table.numel(), start + size
    return bands


def _unpadded_span(mask: Tensor, length: int) -> slice:
    """The keys from the first to the last that a [g | 1, 1, 1, L] mask keeps in any sequence (all of them if it keeps
    none). Keys outside it are padding in every sequence of the group: their weight after the softmax is exactly 0 in
    every row that keeps a key, so `_attend_by_distance` leaves them out of its products and calls."""
    kept = mask[:, 0, 0].any(0).nonzero().flatten()
    return slice(int(kept[0]), int(kept[-1]) + 1) if len(kept) else slice(0, length)


def _padded_keys(mask: Tensor) -> list[tuple[int | None, list[int]]]:
    """(sequence, or None for every sequence, and the keys the [g | 1, 1, 1, L] mask leaves out, ascending) where
    there are any."""
    padded = []
    for sequence, padding in enumerate(~mask[:, 0, 0]):
        keys = padding.nonzero().flatten().tolist()
        if keys:
            padded.append((sequence if len(mask) > 1 else None, keys))
    return padded


def _band_view(table: Tensor, rows: int, bands: int | None = None) -> Tensor:
    """p2c of the block's `rows` query rows from a band of `_band_table` ([H, g, keys, columns]): [g, H, rows, keys];
    with `bands`, that band and the `bands` - 1 whole bands after it: [g, H, rows, bands, keys]."""
    heads, groups, size, width = table.shape
    shape, strides = [groups, heads, rows, size], [table.stride(1), table.stride(0), 1, width - 1]
    if bands is not None:
        shape.insert(3, bands)
        strides.insert(3, table.numel())
    return table.as_strided(shape, strides, table.storage_offset() + size - 1)  # row first, key s: column size - 1


def _band_views(bands: list[Tensor], rows: int) -> list[tuple[slice, Tensor]]:
    """p2c of the block's `rows` query rows against every key as (keys, view) parts for `_add_by_key_chunks`: whole
    bands `ADD_CHUNK_KEYS` keys at a time, [g, H, rows, bands, keys per band], then a partial last band."""
    band = bands[0].shape[-2]
    whole = len(bands) - (bands[-1].shape[-2] != band)
    per_part = max(1, ADD_CHUNK_KEYS // band)
    parts = []
    for first in range(0, whole, per_part):
        count = min(per_part, whole - first)
        parts.append((slice(first * band, (first + count) * band), _band_view(bands[first], rows, count)))
    if whole < len(bands):
        parts.append((slice(whole * band, whole * band + bands[-1].shape[-2]), _band_view(bands[-1], rows)))
    return parts


def _dot_each(rows: Tensor, vector: Tensor) -> Tensor:
    """[g, H, n, D] rows against one [H, D] vector per head: [g, H, n]. (matmul with a [D, 1] operand runs a
    matrix-vector bmm, many times slower on the CPU in float32 than the [1, D] x [D, n] product einsum chooses; in
    bfloat16 einsum's product copies the rows transposed first, and the [n, D] x [D, 1] product is the faster: 0.46
    against 1.8 ms for 2,048 keys on a Xeon with AMX.)"""
    if rows.dtype == torch.bfloat16:
        return _by_head(rows, vector.unsqueeze(1)).squeeze(-1)
    return torch.einsum("ghnd,hd->ghn", rows, vector)


def _far_terms(
    positions: RelativePositions,
    pos_key: Tensor | None,
    pos_query: Tensor | None,
    query: Tensor,
    key: Tensor,
    mask: Tensor | None,
    span: slice,
) -> list[tuple[Tensor, Tensor | None]]:
    """Beyond the buckets' reach, on each side (keys far left, d >= near[1], then far right, d <= near[0]), every
    pair reads one column: p2c is the key bias k_j . Qr[column] and c2p the row constant q_i . Kr[column]. For a
    group ([g, H, L, D] `query` and `key`, projected rows in the queries' dtype): (key bias [g, H | 1, 1, keys] over
    the keys of `span`, the padded ones at the dtype's minimum; row constant [g, H, L] in the queries' dtype, None
    without c2p) per side."""
    terms, kept = [], key[:, :, span]
    for column in (positions.far_columns[1], positions.far_columns[0]):
        key_bias = query.new_zeros(1, 1, span.stop - span.start)
        if pos_query is not None:
            key_bias = _dot_each(kept, pos_query[:, column])  # [g, H, keys]
        if mask is not None:
            key_bias = key_bias.masked_fill(~mask[:, 0, :, span], torch.finfo(query.dtype).min)
        row_constant = _dot_each(query, pos_key[:, column]) if pos_key is not None else None
        terms.append((key_bias.unsqueeze(-2), row_constant))
    return terms


def _merge_parts(out: Tensor, parts: list[tuple[Tensor, Tensor]]) -> None:
    """out = the attention of one block's query rows over the keys of all `parts`, from each part's attention
    ([g, H, n, D]) and log-sum-exp ([g, H, n]) over its own keys: each part weighted by exp(lse - total).
    `out` is a [g, H, n, D] view of the context."""
    total = parts[0][1]
    for _, lse in parts[1:]:
        total = torch.logaddexp(total, lse)
    for index, (part, lse) in enumerate(parts):
        weight = (lse - total).exp().unsqueeze(-1).to(part.dtype)
        if index == 0:
            torch.mul(part, weight, out=out)
        else:
            out.addcmul_(part, weight)
