"""The ONNX export's fused graph (path `onnx-fused`): the position terms as one additive bias, built from products and
copies, and ONNX Runtime's `com.microsoft.MultiHeadAttention` on top.

    A_ij = q_i . k_j * scaling + c2p[i, j] + p2c[i, j] + mask[j]      (scaling folded into Kr and Qr, as in PyTorch)

While a model is exported to ONNX (`torch.onnx.export`, the exporter torch uses by default; `disentangled
export-onnx`; also transformers' DeBERTa after `disentangled.accelerate(model)`), `dispatch.decide` sends each layer's
attention here unless the export asked for another graph (`dispatch.onnx_graph`). It writes:

- c2p without gathers over [B, H, L, L]: the relative rows are taken once per distance, in descending order of
  d = i - j, and one product gives X[i, e] = q_i . Kr[δ(L - 1 - e)] ([B, H, L, 2L]; `by_distance`). Only the
  distances up to the bucket settings' reach are products (beyond it every distance reads the same row): an edge pad
  gives the farther columns. Row i of c2p reads X[i, L - 1 - i + j], so c2p is X flattened, shifted by L - 1 and read
  with rows of 2L - 1 (`relative_shift`: a slice and a reshape, no index);
- p2c the same way from the keys' side: Y[j, e] = k_j . Qr[δ(e - L + 1)], ascending d, gives p2c transposed
  ([B, H, j, i]); one transpose turns it round;
- the key mask added to the bias ([B, 1, 1, L]), finfo.min where a key is padding, as in PyTorch;
- `com.microsoft.MultiHeadAttention` (ONNX Runtime's CPU and CUDA providers) with that bias as attention_bias.

The products read at most 2 * reach + 1 relative rows (the eager graph reads all 2S by bucket) and none of the eager
graph's [B, H, L, L] int64 gathers, which onnxruntime's CPU provider runs element by element. What remains are
copies over [B, H, L, L] (the pad, the shift's slices, p2c's transpose, the adds) and MultiHeadAttention's own: on
the CPU it keeps the whole [B, H, L, L] probabilities and copies the bias into them (`python -m
benchmarks.onnx_runtime` has the figures). What is never made: an [L, L] index, a gather over [B, H, L, L].

The package's (the Hub bundle does not carry it, so that a model loaded as remote code exports the portable graph,
which any ONNX runtime runs, as before). The kernel graph (`onnx-kernel`) is written by the package's
`disentangled.serving.onnx_attention`, whose `graph("kernel")` hands its writer to the decision.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from .disentangled_attention import PositionScores

MS_DOMAIN = "com.microsoft"


def relative_shift(by_distance: Tensor) -> Tensor:
    """[..., L, 2L] -> [..., L, L]: out[i, j] = by_distance[i, L - 1 - i + j], a slice and a reshape of the flat rows."""
    length = by_distance.shape[-2]
    flat = by_distance.flatten(-2)[..., length - 1 : length - 1 + length * (2 * length - 1)]
    return flat.unflatten(-1, (length, 2 * length - 1))[..., :length]


def near_distances(scores: PositionScores) -> int | torch.SymInt:
    """How far the products go: to the bucket settings' reach, where the column stops changing, or to L - 1."""
    positions = scores.positions
    longest = positions.length - 1
    return longest if positions.reach is None else torch.sym_min(longest, positions.reach)


def by_distance(content: Tensor, relative: Tensor, scores: PositionScores, descending: bool) -> Tensor:
    """content [B, H, L, D] against the relative row of each distance d, L - 1 down to -L (or -(L - 1) up to L):
    [B, H, L, 2L]. Only the distances up to `near_distances` are products; the columns beyond copy the last of them
    (an edge pad), as every farther distance reads the same row. The column of -L (or L) is a spare no entry reads."""
    positions = scores.positions
    length, near = positions.length, near_distances(scores)
    steps = torch.arange(2 * near + 1, device=relative.device)
    distance = near - steps if descending else steps - near  # [2 * near + 1]
    rows = relative.index_select(-2, positions.column[distance + (length - 1)])  # [H, 2 * near + 1, D]
    products = content @ rows.mT  # [B, H, L, 2 * near + 1]
    return F.pad(products, (length - 1 - near, length - near, 0, 0), mode="replicate")  # 4-D: last two axes


def terms_by_distance(query: Tensor, key: Tensor, scores: PositionScores) -> Tensor | None:
    """c2p + p2c [B, H, L, L] from products by distance and relative shifts."""
    bias = None
    if scores.pos_key is not None:  # c2p: q_i . Kr[δ(i, j)], from X[i, e] = q_i . Kr[δ(L - 1 - e)]
        bias = relative_shift(by_distance(query, scores.pos_key, scores, descending=True))  # [B, H, L, L]
    if (
        scores.pos_query is not None
    ):  # p2c: k_j . Qr[δ(i, j)], made as [B, H, j, i] from Y[j, e] = k_j . Qr[δ(e - L + 1)]
        p2c = relative_shift(by_distance(key, scores.pos_query, scores, descending=False)).mT
        bias = p2c if bias is None else bias + p2c
    return bias


def fused_attention(
    query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float, scores: PositionScores
) -> Tensor:
    """The attention of one layer for the fused graph: [B, L, H, D] (`dispatch.decide` chose it: c2p and p2c only,
    torch's current exporter, `torch.onnx.ops`)."""
    batch, heads, length, dim = query.shape
    bias = terms_by_distance(query, key, scores)  # c2p + p2c, or None
    if attention_mask is not None:  # [B, 1, 1 | L, L] bool -> additive
        minimum = torch.finfo(query.dtype).min
        mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(~attention_mask, minimum)
        bias = mask.expand(batch, heads, length, length) if bias is None else bias + mask
    inputs = [x.transpose(1, 2).reshape(batch, length, heads * dim) for x in (query, key, value)]
    if bias is not None and bias.shape[0] != batch:  # no mask: the terms' batch is 1 only if the input's is
        bias = bias.expand(batch, heads, length, length)
    context = torch.onnx.ops.symbolic(
        f"{MS_DOMAIN}::MultiHeadAttention",
        [
            *inputs,
            None,
            None,
            bias,
        ],  # query, key, value, bias (of the projections: none), key_padding_mask, attention_bias
        {"num_heads": heads, "scale": float(scaling)},
        dtype=query.dtype,
        shape=(batch, length, heads * dim),
        version=1,
    )
    return context.unflatten(-1, (heads, dim))
