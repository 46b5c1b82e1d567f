"""The attention backends of disentangled attention, and the relative-position bookkeeping they share.

DeBERTa scores query i against key j as a sum of separately projected terms (content H, relative
embeddings P, δ(i, j) the bucketed distance i - j):

    A_ij = [ q_i . k_j                     c2c: H_i Wq_c . H_j Wk_c
           + q_i . Kr[δ(i, j)]             c2p: H_i Wq_c . P_δ(i,j) Wk_p
           + k_j . Qr[δ(i, j)]             p2c: H_j Wk_c . P_δ(i,j) Wq_p
           + Qr[δ(i, j)] . Kr[δ(j, i)] ]   p2p: optional, no released checkpoint uses it
           / sqrt(head_dim * number_of_terms)

p2p follows the formula (query side δ(i, j) through the position-query projection, key side δ(j, i) through
the position-key projection, scaled like the other terms). Microsoft's experimental p2p differs: it reads the
position-query row of the query's absolute position (span + i) against the position key of δ(i, j), unscaled.

Index convention: c2p and p2c both read the bucket of i - j. The paper writes p2c with δ(j, i), but the
released checkpoints were trained with δ(i, j) (microsoft/DeBERTa #47, #162), and parity decides.

The position terms are never stored as [L, L] per layer here: a layer hands its backend `PositionScores`,
the c2p and p2c scores against every relative bucket ([B, H, L, 2S] tables, with the scaling already folded
into the small position projections), plus the [L, L] bucket index that the whole forward shares. The eager
backend gathers them into a dense bias; faster backends read the tables directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F


def log_bucket(distance: Tensor, bucket_size: int, max_position: int) -> Tensor:
    """DeBERTa-v2's log buckets of a relative distance (int64 in, int64 out).

    Distances with |d| <= bucket_size // 2 keep their value; beyond it, |d| up to `max_position` is mapped
    logarithmically onto the remaining buckets. The float operations follow DeBERTa's own, in float32, so
    that the ceil lands on the same side at every boundary.
    """
    mid = bucket_size // 2
    sign = torch.sign(distance)
    near = (distance < mid) & (distance > -mid)
    magnitude = torch.where(near, torch.full_like(distance, mid - 1), distance.abs())
    log_ratio = torch.log(magnitude / mid) / torch.log(torch.tensor((max_position - 1) / mid))
    far = torch.ceil(log_ratio * (mid - 1)) + mid
    return torch.where(magnitude <= mid, distance.to(far.dtype), far * sign).long()


def relative_index_by_distance(length: int, span: int, bucket_size: int, max_position: int, device) -> Tensor:
    """Table column of each distance d = i - j in [-(length - 1), length - 1], at position d + length - 1.

    The column is δ(i, j) + span, the bucket shifted into [0, 2 * span), clipped at both ends.
    """
    distance = torch.arange(1 - length, length, device=device)
    bucket = log_bucket(distance, bucket_size, max_position) if bucket_size > 0 else distance
    return (bucket + span).clamp(0, 2 * span - 1)


def relative_index(length: int, span: int, bucket_size: int, max_position: int, device) -> Tensor:
    """rel_index[i, j] = δ(i, j) + span: [L, L] int64, built once per forward for all layers."""
    by_distance = relative_index_by_distance(length, span, bucket_size, max_position, device)
    positions = torch.arange(length, device=device)
    return by_distance[positions[:, None] - positions[None, :] + length - 1]


def gather_relative(by_offset: Tensor, rel_index: Tensor) -> Tensor:
    """For each (i, j), take column rel_index[i, j]: [B, H, L, 2S] -> [B, H, L, L]."""
    return by_offset.gather(-1, rel_index.expand(*by_offset.shape[:-2], *rel_index.shape))


@dataclass
class PositionScores:
    """One layer's position terms, by relative bucket, scaled.

    c2p[b, h, i, r] = q_i . Kr[r] * scaling and p2c[b, h, j, r] = k_j . Qr[r] * scaling ([B, H, L, 2S]);
    p2p[h, r] = Qr[r] . Kr[mirror(r)] * scaling ([H, 2S]), where mirror(r) is the column of -δ. A term the
    config does not use is None.
    """

    c2p: Tensor | None
    p2c: Tensor | None
    p2p: Tensor | None
    rel_index: Tensor  # [L, L] int64, δ(i, j) + span

    def bias(self, rows: slice = slice(None)) -> Tensor | float:
        """The summed position terms for query rows `rows`: [B or 1, H, len(rows), L]."""
        rel_index = self.rel_index[rows]
        c2p = gather_relative(self.c2p[:, :, rows], rel_index) if self.c2p is not None else 0.0  # q_i . Kr[δ(i,j)]
        p2c = gather_relative(self.p2c, rel_index.T).mT if self.p2c is not None else 0.0  # k_j . Qr[δ(i,j)]
        p2p = self.p2p[:, rel_index].unsqueeze(0) if self.p2p is not None else 0.0  # Qr[δ(i,j)] . Kr[δ(j,i)]
        return c2p + p2c + p2p


def mirror_columns(span: int, device) -> Tensor:
    """Column of -δ for each column r of δ: the bucket table is odd, so it is 2S - r, clipped like r."""
    return (2 * span - torch.arange(2 * span, device=device)).clamp(max=2 * span - 1)


def _masked_scores(scores: Tensor, attention_mask: Tensor | None) -> Tensor:
    if attention_mask is None:
        return scores
    return scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)


def eager_disentangled(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_scores: PositionScores | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """The reference: softmax(c2c + c2p + p2c [+ p2p], masked) @ v. Shapes [B, H, L, D]; mask bool [B, 1, L|1, L].

    Returns the context as [B, L, H, D] and the attention probabilities [B, H, L, L].
    """
    c2c = (query * scaling) @ key.mT  # q_i . k_j, scaled first: q . k itself can overflow float16 (mDeBERTa)
    scores = c2c + position_scores.bias() if position_scores is not None else c2c
    probs = torch.softmax(_masked_scores(scores, attention_mask), dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout > 0:  # a branch, not training=dropout > 0: under torch.compile that is a SymBool
        probs = F.dropout(probs, p=dropout)
    return (probs @ value).transpose(1, 2), probs


def sdpa_disentangled(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_scores: PositionScores | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """`scaled_dot_product_attention` with the position terms (and the mask) as an additive float bias."""
    bias = None
    if position_scores is not None:
        bias = position_scores.bias().to(query.dtype)
    if attention_mask is not None:
        bias = torch.zeros((), dtype=query.dtype, device=query.device) if bias is None else bias
        bias = _masked_scores(bias.expand(*bias.shape[:2], query.shape[-2], key.shape[-2]), attention_mask)
    context = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling)
    context = context.transpose(1, 2)  # [B, L, H, D]
    if torch.compiler.is_compiling():  # torch.export's decomposition of sdpa yields other strides than it traced
        context = context.clone(memory_format=torch.contiguous_format)
    return context, None


DISENTANGLED_ATTENTION_FUNCTIONS = {
    "eager": eager_disentangled,
    "sdpa": sdpa_disentangled,
}


def dense_position_bias(position_scores: PositionScores | None, attention_mask: Tensor | None, dtype) -> Tensor | None:
    """Position terms and mask as one additive [B, H, L, L] bias, for attention functions registered elsewhere."""
    if position_scores is None and attention_mask is None:
        return None
    bias = position_scores.bias() if position_scores is not None else torch.zeros(())
    if attention_mask is not None:
        bias = torch.where(attention_mask, bias, torch.finfo(dtype).min)
    return bias.to(dtype)


def head_scaling(head_dim: int, number_of_terms: int) -> float:
    """DeBERTa's scaling 1 / sqrt(head_dim * number_of_terms), c2c counted."""
    return 1.0 / math.sqrt(head_dim * number_of_terms)
