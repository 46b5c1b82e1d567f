"""Disentangled attention: the formula, the relative-position bookkeeping every backend shares, and the reference.

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

What is never materialised: the position terms are not stored as [L, L] per layer, and no [L, L] index
exists outside the eager reference. The encoder builds `RelativePositions` once per forward: the table
column of each distance d = i - j ([2L - 1] entries) and the range of relative rows an L-token input can
reach (255 rows for 128 tokens, not 2S = 512); only those rows are projected. A layer hands its backend
`PositionScores`: the content streams and the projected relative rows Kr, Qr ([H, W, D], the scaling folded
in), from which the c2p and p2c tables against the reachable rows ([B, H, L, W]) are built when and where
the backend needs them. The backends, each in a file of its own:

- eager (here, the reference) gathers the tables into a dense [B, H, L, L] bias with an [L, L] index;
- sdpa (`sdpa_attention.py`) builds the bias one block of query rows at a time and hands it to
  `torch.nn.functional.scaled_dot_product_attention`; CPU training runs its own autograd function there;
- CPU inference (`cpu_inference.py`, which sdpa calls) takes the position terms by distance, so that a block's
  bias is a view of two products, and the keys beyond the buckets' reach as plain attention;
- flex_attention (`flex_attention.py`) reads the tables inside a `score_mod`, so no [L, L] tensor exists at all.

`workspace.py` keeps the buffers the blocked paths reuse between blocks, layers and calls.

In `modeling/`'s layering (`__init__.py`): layer 1, the reference every other layer is checked against.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import functional as F

from .validation import is_tracing


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


def gather_relative(by_offset: Tensor, rel_index: Tensor) -> Tensor:
    """For each (i, j), take column rel_index[i, j]: [B, H, L, 2S] -> [B, H, L, L]."""
    return by_offset.gather(-1, rel_index.expand(*by_offset.shape[:-2], *rel_index.shape))


@dataclass
class RelativePositions:
    """Where each distance d = i - j of an L-token input reads the position tables; one per forward.

    `rows` are the reachable rows of the 2S relative-embedding table (a contiguous range, since buckets are
    monotone in d); `column[d + L - 1]` is δ(i, j) + span - rows.start, a column of a table over those rows.
    `column` is int64 because `gather` takes no other index type; it has 2L - 1 entries, never L x L.
    """

    column: Tensor  # [2L - 1] int64
    rows: slice  # of the 2S relative embeddings
    # Beyond the log buckets' reach the column stops changing: it is `far_columns[0]` for every d <= near[0]
    # and `far_columns[1]` for every d >= near[1]. Python ints, so that reading them costs no device sync.
    near: tuple[int, int] = (0, 0)
    far_columns: tuple[int, int] = (0, 0)
    # A distance from which on (|d| >= reach) the column is the one at +-reach, for any length: from the bucket
    # settings alone, so that a traced graph can use it (the ONNX export's products by distance); None: unknown.
    reach: int | None = None
    # Buffers that the blocks and layers of a forward reuse (sdpa on the CPU: in inference T, U's bands and the
    # bias; in training the c2p and p2c tables of a block and their gradients): a tensor above glibc's mmap
    # threshold is fresh memory on every allocation, whose pages fault on first touch.
    # The encoder passes `kept_workspace(encoder)`, so that later forwards (and training steps) reuse them too.
    workspace: dict = field(default_factory=dict, repr=False, compare=False)
    # What a backend derives from `column` for its kernels, made once for every layer (`workspace.per_forward`)
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls, length: int, span: int, bucket_size: int, max_position: int, device, workspace: dict | None = None
    ) -> RelativePositions:
        if is_tracing():  # no data-dependent Python values in a graph: all rows, and no far split (sdpa runs dense)
            column = relative_index_by_distance(length, span, bucket_size, max_position, device)
            # log buckets reach the last one at max_position at the latest; without them the clip is at +-span
            reach = max_position if bucket_size > 0 else span
            return cls(column=column, rows=slice(0, 2 * span), near=(1 - length, length - 1), reach=reach)
        # Built on the CPU (a few thousand integers), so that the reachable range costs no device sync.
        by_distance = relative_index_by_distance(length, span, bucket_size, max_position, "cpu")
        first, last = by_distance.min().item(), by_distance.max().item()
        column = by_distance - first
        lowest, highest = column[0].item(), column[-1].item()
        near = (
            int((column == lowest).nonzero().max()) - (length - 1),  # the last distance that still reads `lowest`
            int((column == highest).nonzero().min()) - (length - 1),  # the first distance that reads `highest`
        )
        return cls(
            column=column.to(device),
            rows=slice(first, last + 1),
            near=near,
            far_columns=(lowest, highest),
            workspace=workspace if workspace is not None else {},
        )

    @property
    def length(self) -> int:
        return (self.column.shape[0] + 1) // 2

    @property
    def width(self) -> int:
        return self.rows.stop - self.rows.start

    def cut(self, length: int) -> RelativePositions:
        """The same tables read by a shorter input (one sequence of a packed batch)."""
        middle = self.length - 1
        return RelativePositions(
            column=self.column[middle - (length - 1) : middle + length],
            rows=self.rows,
            near=self.near,
            far_columns=self.far_columns,
            workspace=self.workspace,
        )

    def distance(self, rows: slice = slice(None)) -> Tensor:
        """[len(rows), L] index of the distance i - j into by-distance vectors: i - j + L - 1."""
        length = self.length
        positions = torch.arange(length, device=self.column.device)
        return positions[rows, None] - positions[None, :] + length - 1

    def dense(self, rows: slice = slice(None)) -> Tensor:
        """[len(rows), L] column of δ(i, j): the eager reference's index."""
        return self.column[self.distance(rows)]


def position_table(content: Tensor, rows: Tensor | None) -> Tensor | None:
    """[B, H, L, D] content against [H, W, D] projected relative rows: [B, H, L, W] dot products.

    einsum runs one [B * L, D] x [D, W] product per head (a broadcast matmul would run B * H small ones).
    """
    return torch.einsum("bhld,hrd->bhlr", content, rows) if rows is not None else None


def p2c_by_row(key: Tensor, pos_query: Tensor | None) -> Tensor | None:
    """The p2c table of `key` laid out by table row: [B, H, W, L] (contiguous), k_j . Qr[r], so that gathering
    along its rows gives a bias in [i, j'] order directly, and a row (the far keys' bias) is contiguous.

    Contiguous rather than a transposed view of `position_table`: the gather then reads along rows (about a third
    faster at 1x2048), for the same product."""
    return torch.einsum("bhld,hrd->bhrl", key, pos_query) if pos_query is not None else None


def _by_head(rows: Tensor, relative: Tensor, out: Tensor | None = None) -> Tensor:
    """rows [g, H, n, D] against relative [H, E, D]: [g, H, n, E], one [g * n, D] x [D, E] product per head (a
    broadcast matmul would copy `relative` g times). `out`, if given, is [H, g * n, E] (a view is fine).

    In bfloat16 `relative` (a slice of the relative rows) is copied to a contiguous tensor first: the oneDNN product
    takes only a contiguous operand or the transpose of one, and would otherwise copy `relative.mT` element by
    element (a transposing copy that cost more than the product: 0.13 against 0.07 ms for a 64 x 256 band of U, 0.70
    against 0.46 ms for a 192 x 704 T, on a Xeon with AMX). In float32 the product reads the slice as it is."""
    groups, heads, count, dim = rows.shape
    flat = rows.transpose(0, 1).reshape(heads, groups * count, dim)  # a view when g = 1
    if relative.dtype == torch.bfloat16:
        relative = relative.contiguous()
    product = torch.bmm(flat, relative.mT, out=out)
    return product.view(heads, groups, count, relative.shape[-2]).transpose(0, 1)  # explicit: B or L may be 0


@dataclass
class PositionScores:
    """One layer's position terms: the content streams and the projected relative rows, scaled.

    `pos_key` (Kr) and `pos_query` (Qr) are the reachable relative rows through the key and query
    projections, [H, W, D], the scaling folded in; each is None when its term (c2p, p2c) is off. The tables
    c2p[b, h, i, r] = q_i . Kr[r] and p2c[b, h, j, r] = k_j . Qr[r] ([B, H, L, W]) are computed where a
    backend asks for them (`position_table`), so that one that builds them block by block never holds them whole.
    p2p[h, d + L - 1] = Qr[δ(d)] . Kr[δ(-d)] * scaling for each distance d = i - j ([H, 2L - 1]: by distance, not
    by bucket, since where distances are clipped one bucket of δ(i, j) meets two buckets of δ(j, i)), or None.
    """

    query: Tensor  # [B, H, L, D]
    key: Tensor  # [B, H, L, D]
    pos_key: Tensor | None  # Kr [H, W, D], for c2p
    pos_query: Tensor | None  # Qr [H, W, D], for p2c
    p2p: Tensor | None
    positions: RelativePositions

    @property
    def c2p(self) -> Tensor | None:
        """[B, H, L, W]: q_i . Kr[r], computed on each access."""
        return position_table(self.query, self.pos_key)

    @property
    def p2c(self) -> Tensor | None:
        """[B, H, L, W]: k_j . Qr[r], computed on each access."""
        return position_table(self.key, self.pos_query)

    def bias(self, rows: slice = slice(None)) -> Tensor | float:
        """The summed position terms for query rows `rows`: [B or 1, H, len(rows), L]. The reference."""
        distance = self.positions.distance(rows)  # [len(rows), L]: i - j + L - 1
        rel_index = self.positions.column[distance]  # [len(rows), L] columns of δ(i, j)
        c2p, p2c = self.c2p, self.p2c
        c2p = gather_relative(c2p[:, :, rows], rel_index) if c2p is not None else 0.0  # q_i . Kr[δ(i,j)]
        p2c = gather_relative(p2c, rel_index.T).mT if p2c is not None else 0.0  # k_j . Qr[δ(i,j)]
        p2p = self.p2p[:, distance].unsqueeze(0) if self.p2p is not None else 0.0  # Qr[δ(i,j)] . Kr[δ(j,i)]
        return c2p + p2c + p2p

    def cut(self, first: int, last: int) -> PositionScores:
        """The position terms of tokens [first, last) as an input of their own (one packed sequence)."""
        length, middle = last - first, self.positions.length - 1  # p2p is by distance: keep |d| < length
        p2p = self.p2p[:, middle - (length - 1) : middle + length] if self.p2p is not None else None
        tokens = slice(first, last)
        return PositionScores(
            self.query[:, :, tokens],
            self.key[:, :, tokens],
            self.pos_key,
            self.pos_query,
            p2p,
            self.positions.cut(length),
        )


def _masked_scores(scores: Tensor, attention_mask: Tensor | None) -> Tensor:
    if attention_mask is None:
        return scores
    return scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)


def _block_mask(mask: Tensor, sequences: slice, first: int, last: int) -> Tensor:
    """Rows [first, last) of sequences `sequences` of a [B | 1, 1, 1 | L, L] mask."""
    mask = mask[sequences] if mask.shape[0] > 1 else mask
    return mask if mask.shape[-2] == 1 else mask[:, :, first:last]


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


def dense_position_bias(position_scores: PositionScores | None, attention_mask: Tensor | None, dtype) -> Tensor | None:
    """Position terms and mask as one additive [B, H, L, L] bias, for attention functions registered elsewhere."""
    if position_scores is None and attention_mask is None:
        return None
    bias = position_scores.bias() if position_scores is not None else torch.zeros(())
    if attention_mask is not None:
        bias = torch.where(attention_mask, bias, torch.finfo(dtype).min)
    return bias.to(dtype)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A fallback warning, once per process and message."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def head_scaling(head_dim: int, number_of_terms: int) -> float:
    """DeBERTa's scaling 1 / sqrt(head_dim * number_of_terms), c2c counted."""
    return 1.0 / math.sqrt(head_dim * number_of_terms)
