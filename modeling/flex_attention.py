"""The flex_attention backend: a `score_mod` that reads the [B, H, L, W] position tables, so that no [L, L] tensor
exists at all; compiled and in tiles, its memory stays linear in L.

In `modeling/`'s layering (`__init__.py`): layer 2, a PyTorch backend over layer 1's tables.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from .disentangled_attention import PositionScores

try:  # torch >= 2.5; the Hub bundle must still import without it
    from torch.nn.attention.flex_attention import BlockMask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # pragma: no cover
    BlockMask = _flex_attention = None


_compiled_flex = None


def compiled_flex_attention():
    """`torch.compile(flex_attention)`, built on first use (building a module changes no global state)."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(_flex_attention, dynamic=False)
    return _compiled_flex


FLEX_BLOCK_SIZE = 128
# Tiles need a block mask that knows the sequence lengths (torch >= 2.6); older torch runs one tile.
FLEX_TILES = BlockMask is not None and "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters


def full_block_mask(query_length: int, key_length: int, device) -> BlockMask:
    """Every key block for every query block, in tiles of FLEX_BLOCK_SIZE.

    Without a block mask flex_attention takes the whole input as one block, and its CPU kernel then keeps a
    [L, L] score buffer per thread (8 GiB at 32k tokens); with tiles its memory stays linear in L.
    """
    query_blocks, key_blocks = -(-query_length // FLEX_BLOCK_SIZE), -(-key_length // FLEX_BLOCK_SIZE)
    indices = torch.arange(key_blocks, dtype=torch.int32, device=device).expand(1, 1, query_blocks, key_blocks)
    return BlockMask.from_kv_blocks(
        kv_num_blocks=torch.full((1, 1, query_blocks), key_blocks, dtype=torch.int32, device=device),
        kv_indices=indices.contiguous(),
        BLOCK_SIZE=FLEX_BLOCK_SIZE,
        seq_lengths=(query_length, key_length),
    )


def flex_disentangled(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_scores: PositionScores | None = None,
    compiled: bool = True,
    **kwargs,
) -> tuple[Tensor, None]:
    """FlexAttention whose `score_mod` reads the [B, H, L, W] tables: memory linear in L, no [L, L] tensor.

    Takes no dropout (the caller falls back to sdpa when it is needed). Uncompiled (`compiled=False`, the model's
    choice where `dispatch.FLEX_COMPILED` is off), flex_attention runs the same `score_mod` densely, which the tests
    use to check it cheaply.
    """
    if dropout > 0:
        raise ValueError("flex_disentangled takes no attention dropout")
    length = query.shape[-2]
    keep = None
    if attention_mask is not None:  # [B, 1, 1 | L, L] bool
        keep = attention_mask[:, 0, 0] if attention_mask.shape[-2] == 1 else attention_mask[:, 0]
    masked = torch.finfo(query.dtype).min
    c2p = p2c = p2p = None
    column = None
    if position_scores is not None:
        c2p, p2c, p2p = position_scores.c2p, position_scores.p2c, position_scores.p2p
        column = position_scores.positions.column

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if column is not None:
            r = column[q_idx - kv_idx + length - 1]  # δ(i, j)'s column
            if c2p is not None:
                score = score + c2p[b, h, q_idx, r]  # q_i . Kr[δ(i,j)]
            if p2c is not None:
                score = score + p2c[b, h, kv_idx, r]  # k_j . Qr[δ(i,j)]
            if p2p is not None:
                score = score + p2p[h, q_idx - kv_idx + length - 1]  # Qr[δ(i,j)] . Kr[δ(j,i)], by distance
        if keep is not None:
            allowed = keep[b, kv_idx] if keep.dim() == 2 else keep[b, q_idx, kv_idx]
            score = torch.where(allowed, score, masked)
        return score

    attend = compiled_flex_attention() if compiled else _flex_attention
    blocks = full_block_mask(length, key.shape[-2], query.device) if compiled and FLEX_TILES else None
    context = attend(query, key, value, score_mod=score_mod, block_mask=blocks, scale=scaling)
    return context.transpose(1, 2), None


FLEX_AVAILABLE = _flex_attention is not None
