"""Disentangled attention for ONNX Runtime's fused attention: the position terms as one additive bias, built from
products and copies, and `com.microsoft.MultiHeadAttention` on top.

    A_ij = q_i . k_j * scaling + c2p[i, j] + p2c[i, j] + mask[j]      (scaling folded into Kr and Qr, as in PyTorch)

While a model is exported to ONNX (`torch.onnx.export`, the exporter torch uses by default; `disentangled
export-onnx`; also transformers' DeBERTa after `disentangled.accelerate(model)`), our sdpa backend asks
`fused_attention` for the attention of each layer. It writes:

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

`graph("portable")` (`export-onnx --portable`) keeps the standard-operator graph that any ONNX runtime runs (the
dense bias and plain attention). Under torch's older TorchScript exporter (`dynamo=False`), p2p terms, or a torch
without `torch.onnx.ops`, the portable graph is written too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.nn import functional as F

from ..modeling import native, sdpa_attention
from ..modeling.disentangled_attention import PositionScores, relative_index_by_distance
from ..modeling.workspace import int32_column, per_forward
from . import ort_operator

GRAPHS = ("fused", "kernel", "portable")
_graph = "fused"
MS_DOMAIN = "com.microsoft"


def current_graph() -> str:
    """The graph the next ONNX export writes: "fused" (the default) or "portable"."""
    return _graph


@contextlib.contextmanager
def graph(kind: str) -> Iterator[None]:
    """Within the block, ONNX exports write `kind` attention: "fused" (ONNX Runtime's MultiHeadAttention with the
    position terms as its bias), "kernel" (our `disentangled::Attention` operator, `ort_operator.py`) or "portable"
    (standard operators only)."""
    global _graph
    if kind not in GRAPHS:
        raise ValueError(f"ONNX attention graph {kind!r} is not one of {list(GRAPHS)}")
    previous, _graph = _graph, kind
    try:
        yield
    finally:
        _graph = previous


def fused_available() -> bool:
    """Whether this torch can write the fused graph (`torch.onnx.ops.symbolic`, torch 2.8 on)."""
    return hasattr(getattr(torch.onnx, "ops", None), "symbolic")


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
) -> Tensor | None:
    """The attention of one layer for the fused graph: [B, L, H, D], or None where the portable graph is written."""
    if _graph == "portable" or not fused_available() or torch.jit.is_tracing() or scores.p2p is not None:
        return None
    batch, heads, length, dim = query.shape
    if _graph == "kernel" and dim == 64 and (attention_mask is None or attention_mask.shape[-2] == 1):
        return kernel_attention(query, key, value, attention_mask, scaling, scores)
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


KERNEL_DOMAIN = "disentangled"
TILE_ROWS = 16  # the kernel's tables come in blocks of 16 rows (native.as_key_tiles)


def kernel_tables(relative: Tensor, reverse: bool) -> Tensor:
    """Kr (rows reversed) or Qr [H, W, 64] as the kernel reads it: zero rows to a multiple of 16, then
    `native.as_key_tiles`' float32 layout [H, W / 16, 64, 16]. Made from the weights alone (a constant folded
    by ONNX Runtime)."""
    width = relative.shape[1]
    rows = relative.flip(1) if reverse else relative
    return native.as_key_tiles(F.pad(rows, (0, 0, 0, -(-width // TILE_ROWS) * TILE_ROWS - width)))


def kernel_columns(positions) -> tuple[Tensor, Tensor]:
    """`native.kernel_columns`' two int32 vectors, made once per forward, without its check that the tiles can read
    them (`native.tiles_hold`: a data-dependent branch a traced graph cannot hold; `refuse_untileable` checks the
    configuration before the export, and the operator checks the vectors on every call)."""
    column = int32_column(positions)
    return column, per_forward(positions, "c2p column", lambda positions: (positions.width - 1) - column.flip(0))


def refuse_untileable(config) -> None:
    """A ValueError where the kernel graph could not be right for `config` (its own or transformers' DeBERTa's): the
    operator refuses columns whose tiles it cannot read (`native.tiles_hold`), and `kernel_columns` writes them without
    that check, so the export refuses the configuration first, checking every column its buckets reach."""
    buckets = config.position_buckets
    reach = config.max_relative_positions if config.max_relative_positions > 0 else config.max_position_embeddings
    column = relative_index_by_distance(reach + 17, buckets if buckets > 0 else reach, buckets, reach, "cpu")
    if not native.tiles_hold(column):
        raise ValueError(
            f"--kernel cannot serve this configuration: its buckets (position_buckets={buckets} reaching {reach} "
            "positions) step by more than one table column per unit of distance, which the operator's tiles cannot "
            "read. Export without --kernel (the default graph, ONNX Runtime's own attention)"
        )


def kernel_attention(
    query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float, scores: PositionScores
) -> Tensor:
    """The attention of one layer for the kernel graph: one `disentangled::Attention` node ([B, L, H, D]). Its inputs
    are the projections in their own [B, L, H * D] layout, the tables of the weights, the two int32 column vectors
    of the distances (as `native.kernel_columns` makes them) and the key mask as uint8."""
    batch, heads, length, dim = query.shape
    positions = scores.positions
    column, c2p_column = kernel_columns(positions)  # of distance d at d + L - 1; Kr reversed: of i - j at L - 1 - i + j
    tables = [
        kernel_tables(t, reverse) if t is not None else None
        for t, reverse in ((scores.pos_key, True), (scores.pos_query, False))
    ]
    keep = None
    if attention_mask is not None:  # [B | 1, 1, 1, L] bool: the keys to attend to
        keep = attention_mask[:, 0, 0, :].expand(batch, length).to(torch.uint8)
    inputs = [x.transpose(1, 2).reshape(batch, length, heads * dim) for x in (query, key, value)]
    context = torch.onnx.ops.symbolic(
        f"{KERNEL_DOMAIN}::Attention",
        [*inputs, *tables, column, c2p_column, keep],
        {"heads": heads, "scale": float(scaling), "version": ort_operator.OPERATOR_VERSION},  # checked by the library
        dtype=query.dtype,
        shape=(batch, length, heads * dim),
        version=ort_operator.OPERATOR_VERSION,
    )
    return context.unflatten(-1, (heads, dim))


sdpa_attention.set_onnx_attention(fused_attention)
