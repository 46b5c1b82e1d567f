"""The ONNX export's kernel graph (path `onnx-kernel`): each layer's attention as one node of our operator
`disentangled::Attention` (`ort_operator.py` builds its library for ONNX Runtime), and `graph(kind)`, which chooses the
graph an export writes.

While a model is exported to ONNX, `dispatch.decide` sends each layer's attention to the graph asked for
(`dispatch.onnx_graph`): "fused" by default (ONNX Runtime's MultiHeadAttention with the position terms as its bias,
`modeling/onnx_fused.py`), "kernel" within `graph("kernel")` (`export-onnx --kernel`), "portable" within
`graph("portable")` (`export-onnx --portable`: standard operators, which any ONNX runtime runs). Where a call cannot
take the graph asked for (the kernel graph: 64 dimensions per head, no mask or a key mask; the fused and the kernel
graph: no p2p term, torch's current exporter, `torch.onnx.ops`), the decision says why and takes the next.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.nn import functional as F

from ..modeling import dispatch, native
from ..modeling.disentangled_attention import PositionScores, relative_index_by_distance
from ..modeling.workspace import int32_column, per_forward
from . import ort_operator


@contextlib.contextmanager
def graph(kind: str) -> Iterator[None]:
    """Within the block, ONNX exports write `kind` attention: "fused" (ONNX Runtime's MultiHeadAttention with the
    position terms as its bias), "kernel" (our `disentangled::Attention` operator, `kernel_attention`) or "portable"
    (standard operators only)."""
    with dispatch.onnx_graph(kind, kernel_attention if kind == "kernel" else None):
        yield


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
