"""What the blocked paths share (sdpa-blocked in `sdpa_attention.py`, cpu-training and cpu-training-kernel in
`cpu_training.py`): the blocks of query rows (`_tiles`), the keys in reverse order (j' = L - 1 - j), so that
i - j + L - 1 = i + j' and a block's index is a stride-(1, 1) view of the [2L - 1] column vector (a Hankel matrix,
`_hankel`), and a block's bias gathered along that view (`_block_bias`).

In `modeling/`'s layering (`__init__.py`): layer 2, beside the backends that use it, over layer 1's tables.
"""

from __future__ import annotations

from torch import Tensor

from .disentangled_attention import RelativePositions

# Bias elements per query block on the CPU (8 MiB in float32): bounded; the fastest of 2^18 ... 2^22 at 8x128 to 1x4096
SDPA_BLOCK_ELEMENTS = 1 << 21
# On an accelerator the block is bounded too, but large enough that a batch takes a few kernel launches, not
# hundreds (256 MiB in float32).
SDPA_BLOCK_ELEMENTS_ACCELERATOR = 1 << 26


def _hankel(positions: RelativePositions, first: int, rows: int, columns: int) -> Tensor:
    """index[a, b] = column[first + a + b], [rows, columns], a view (strides (1, 1)) of the column vector: the column
    of query row first + a and reversed key b (i - j + L - 1 = i + j')."""
    column = positions.column
    return column.as_strided((rows, columns), (1, 1), column.storage_offset() + first)


def _tiles(query: Tensor, block_elements: int | None = None) -> list[tuple[slice, int, int]]:
    """(sequences, first row, last row) of each block for `_attend_in_blocks` and `BlockedAttention`.

    A block holds at most `block_elements` scores (by default SDPA_BLOCK_ELEMENTS on the CPU,
    SDPA_BLOCK_ELEMENTS_ACCELERATOR elsewhere). On the CPU it covers a cache-sized group of sequences (one, when L is
    large); an accelerator takes the whole batch at once.
    """
    batch, heads, length, _ = query.shape
    if block_elements is None:
        block_elements = SDPA_BLOCK_ELEMENTS if query.device.type == "cpu" else SDPA_BLOCK_ELEMENTS_ACCELERATOR
    group = batch if query.device.type != "cpu" else max(1, min(batch, block_elements // (heads * length * length)))
    rows = max(1, min(length, block_elements // (group * heads * length)))
    return [
        (slice(start, min(start + group, batch)), first, min(first + rows, length))
        for start in range(0, batch, group)
        for first in range(0, length, rows)
    ]


def _block_bias(
    positions: RelativePositions,
    c2p_rows: Tensor | None,
    p2c_rows: Tensor | None,
    p2p: Tensor | None,
    first: int,
    last: int,
    batch_heads: tuple[int, int],
    keys: slice | None = None,
) -> Tensor:
    """The position terms of query rows [first, last) against reversed keys `keys` (all by default), summed in
    place: [g, H, n, len(keys)].

    `c2p_rows` is c2p of those rows ([g, H, n, W]); `p2c_rows` the p2c table of the reversed keys read by
    table row ([g, H, W, L], `p2c_by_row`). Both read column[i + j'], a Hankel view of the by-distance column (no index tensor is built).
    """
    keys = keys if keys is not None else slice(0, positions.length)
    width = keys.stop - keys.start
    index = _hankel(positions, first + keys.start, last - first, width).expand(*batch_heads, last - first, width)
    bias = c2p_rows.gather(-1, index) if c2p_rows is not None else None  # c2p: q_i . Kr[δ(i,j)]
    if p2c_rows is not None:  # p2c: k_j . Qr[δ(i,j)]
        p2c = p2c_rows[..., keys].gather(-2, index)
        bias = p2c if bias is None else bias.add_(p2c)
    if p2p is not None:  # Qr[δ(i,j)] . Kr[δ(j,i)], by distance: index first + a + b, a view as well
        offset = p2p.storage_offset() + first + keys.start
        p2p = p2p.as_strided((p2p.shape[0], last - first, width), (p2p.stride(0), 1, 1), offset)
        bias = bias.add_(p2p) if bias is not None else p2p.expand_as(index).clone()
    return bias


def _by_batch_head(tensor: Tensor) -> Tensor:
    """[g, H, n, m] as [g * H, n, m] for a batched product (a view where the layout allows, else a copy)."""
    return tensor.reshape(-1, *tensor.shape[-2:])
