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

What is never materialised: the position terms are not stored as [L, L] per layer, and no [L, L] index
exists outside the eager reference. The encoder builds `RelativePositions` once per forward: the table
column of each distance d = i - j ([2L - 1] entries) and the range of relative rows an L-token input can
reach (255 rows for 128 tokens, not 2S = 512); only those rows are projected. A layer hands its backend
`PositionScores`: the content streams and the projected relative rows Kr, Qr ([H, W, D], the scaling folded
in), from which the c2p and p2c tables against the reachable rows ([B, H, L, W]) are built when and where
the backend needs them. Then:

- eager (the reference) gathers the tables into a dense [B, H, L, L] bias with an [L, L] index;
- sdpa builds the bias one block of query rows at a time and hands it to
  `torch.nn.functional.scaled_dot_product_attention`. In CPU inference (`_attend_by_distance`) the terms are
  products with the relative rows by distance rather than by bucket, T = q Kr[δ(d)]ᵀ per block and
  U = k Qr[δ(d)]ᵀ per block and band of keys, so that a block's c2p and p2c are strided views of T and U (d = i - j
  moves by one along a row or a column): one add makes the bias, no index is read per element. Keys beyond the
  buckets' reach (where the column stops changing) need no dense bias at all: c2p is a constant of the row there
  and p2c a bias of the key, so for each block the keys before and after its band run as two plain attentions
  with a key bias, merged with the band's by log-sum-exp. Elsewhere (training, accelerators, p2p) the keys go
  in reverse order (j' = L - 1 - j), so that i - j + L - 1 = i + j' and the index of a block is a stride-(1, 1)
  view of the [2L - 1] column vector (a Hankel matrix) that the gathers read in order. CPU training, where SDPA
  would run its math path with a bias gradient, runs `BlockedAttention`: the same blocks, each making its own
  c2p table (and each group of sequences its p2c table), with a backward that scatters dS into those tables and
  from there into q, k, Kr and Qr;
- flex_attention reads the tables inside a `score_mod`, so no [L, L] tensor exists at all.
"""

from __future__ import annotations

import bisect
import inspect
import math
import threading
import warnings
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from torch.nn import functional as F

from .validation import is_tracing

try:  # torch >= 2.5; the Hub bundle must still import without it
    from torch.nn.attention.flex_attention import BlockMask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # pragma: no cover
    BlockMask = _flex_attention = None


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
    # Buffers that the blocks and layers of a forward reuse (sdpa on the CPU: in inference T, U's bands and the
    # bias; in training the c2p and p2c tables of a block and their gradients): a tensor above glibc's mmap
    # threshold is fresh memory on every allocation, whose pages fault on first touch.
    # The encoder passes `kept_workspace(encoder)`, so that later forwards (and training steps) reuse them too.
    workspace: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls, length: int, span: int, bucket_size: int, max_position: int, device, workspace: dict | None = None
    ) -> RelativePositions:
        if is_tracing():  # no data-dependent Python values in a graph: all rows, and no far split (sdpa runs dense)
            column = relative_index_by_distance(length, span, bucket_size, max_position, device)
            return cls(column=column, rows=slice(0, 2 * span), near=(1 - length, length - 1), far_columns=(0, 0))
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

    def hankel(self, first: int, rows: int, columns: int) -> Tensor:
        """index[a, b] = column[first + a + b], [rows, columns], a view (strides (1, 1)) of the column vector."""
        return self.column.as_strided((rows, columns), (1, 1), self.column.storage_offset() + first)


_workspaces = threading.local()  # per thread: {module: workspace}, weakly keyed (freed with the module)
KEEP_WORKSPACE = True  # False: every forward allocates its own buffers (tests, A/B timing)


def kept_workspace(module: torch.nn.Module) -> dict | None:
    """The buffers `module`'s forwards share on this thread (see `RelativePositions.workspace`).

    Kept between calls, as a caching allocator would keep them, so that a forward does not fault in fresh pages
    each time: in inference three block buffers, T, U's bands and the bias; in training a block's c2p table and a
    group's p2c table, which the backward reuses for their gradients; each as large as the largest block has
    needed (`benchmarks.cpu_inference` times fresh ones and prints what is held after a call). Every use is
    within one call of a forward or a backward, never across them. Per thread, so that threads serving one model
    never share a buffer; `release_workspace(model)` frees them."""
    if not KEEP_WORKSPACE:
        return None
    held = getattr(_workspaces, "by_module", None)
    if held is None:
        held = _workspaces.by_module = weakref.WeakKeyDictionary()
    return held.setdefault(module, {})


def release_workspace(model: torch.nn.Module) -> None:
    """Free the buffers that `model` (or any of its modules) keeps on this thread."""
    held = getattr(_workspaces, "by_module", None)
    for module in model.modules() if held is not None else ():
        held.pop(module, None)


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


# The CPU flash kernel, which also returns the log-sum-exp (None on torch without it)
cpu_flash_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
CPU_FLASH_WITH_LSE = cpu_flash_attention is not None
# Bias elements per query block on the CPU (8 MiB in float32): bounded; the fastest of 2^18 ... 2^22 at 8x128 to 1x4096
SDPA_BLOCK_ELEMENTS = 1 << 21
# On an accelerator the block is bounded too, but large enough that a batch takes a few kernel launches, not
# hundreds (256 MiB in float32).
SDPA_BLOCK_ELEMENTS_ACCELERATOR = 1 << 26


def sdpa_disentangled(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_scores: PositionScores | None = None,
    block_elements: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """`scaled_dot_product_attention` with the position terms (and the mask) as an additive float bias.

    The bias exists one block of query rows at a time ([B, H, rows, L], at most `block_elements`); the keys
    go in reverse order so that the block's index is a view (see `_block_bias`).
    Attention is invariant to the order of the keys, so the result is unchanged.
    """
    batch, heads, length, _ = query.shape
    on_cpu = query.device.type == "cpu"
    if position_scores is None or is_tracing():  # one dense bias: a graph compile and export can follow
        bias = position_scores.bias().to(query.dtype) if position_scores is not None else None
        if attention_mask is not None:  # finfo.min, not -inf: a fully masked row is uniform, as in eager
            bias = torch.zeros((), dtype=query.dtype, device=query.device) if bias is None else bias
            bias = _masked_scores(bias.expand(*bias.shape[:2], length, key.shape[-2]), attention_mask)
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling)
        context = context.transpose(1, 2)  # [B, L, H, D]
        if is_tracing():  # torch.export's decomposition of sdpa yields other strides than it traced
            context = context.clone(memory_format=torch.contiguous_format)
        return context, None

    tensors = (query, key, value, position_scores.pos_key, position_scores.pos_query)
    inference = not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))
    if on_cpu and inference and dropout == 0 and position_scores.p2p is None:
        block_elements = block_elements or DISTANCE_BLOCK_ELEMENTS
        context = _attend_by_distance(position_scores, query, key, value, attention_mask, scaling, block_elements)
        return context, None
    block_elements = block_elements or (SDPA_BLOCK_ELEMENTS if on_cpu else SDPA_BLOCK_ELEMENTS_ACCELERATOR)
    key, value = key.flip(-2), value.flip(-2)  # j' = L - 1 - j
    mask = attention_mask.flip(-1) if attention_mask is not None else None
    positions = position_scores.positions
    if not inference and on_cpu and position_scores.p2p is None:  # CPU training: the tables made block by block
        pos_key, pos_query = position_scores.pos_key, position_scores.pos_query
        context = BlockedAttention.apply(
            query, key, value, pos_key, pos_query, mask, positions, scaling, dropout, block_elements
        )
        return context, None
    context = _attend_in_blocks(position_scores, query, key, value, mask, scaling, dropout, block_elements, inference)
    return context, None


def _tiles(query: Tensor, block_elements: int) -> list[tuple[slice, int, int]]:
    """(sequences, first row, last row) of each block for `_attend_in_blocks` and `BlockedAttention`.

    A block holds at most `block_elements` scores. On the CPU it covers a cache-sized group of sequences
    (one, when L is large); an accelerator takes the whole batch at once.
    """
    batch, heads, length, _ = query.shape
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
    index = positions.hankel(first + keys.start, last - first, width).expand(*batch_heads, last - first, width)
    bias = c2p_rows.gather(-1, index) if c2p_rows is not None else None  # c2p: q_i . Kr[δ(i,j)]
    if p2c_rows is not None:  # p2c: k_j . Qr[δ(i,j)]
        p2c = p2c_rows[..., keys].gather(-2, index)
        bias = p2c if bias is None else bias.add_(p2c)
    if p2p is not None:  # Qr[δ(i,j)] . Kr[δ(j,i)], by distance: index first + a + b, a view as well
        offset = p2p.storage_offset() + first + keys.start
        p2p = p2p.as_strided((p2p.shape[0], last - first, width), (p2p.stride(0), 1, 1), offset)
        bias = bias.add_(p2p) if bias is not None else p2p.expand_as(index).clone()
    return bias


def _block_mask(mask: Tensor, sequences: slice, first: int, last: int) -> Tensor:
    """Rows [first, last) of sequences `sequences` of a [B | 1, 1, 1 | L, L] mask."""
    mask = mask[sequences] if mask.shape[0] > 1 else mask
    return mask if mask.shape[-2] == 1 else mask[:, :, first:last]


def _attend_in_blocks(
    position_scores: PositionScores,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    scaling: float,
    dropout: float,
    block_elements: int,
    inference: bool,
) -> Tensor:
    """SDPA one block of query rows at a time, keys reversed. Returns [B, L, H, D].

    In inference the tables are built as they are needed and nothing [B, H, L, W] is kept: p2c for one group
    of sequences, c2p for one block of rows, so on the CPU (one sequence per group when L is large) tables
    and bias stay in cache. With gradients (training off the CPU, or with p2p) the whole tables are built
    once and each block's bias is gathered from them, so that autograd sees one table per term.
    """
    batch, heads, length, dim = query.shape
    positions, pos_key, pos_query = position_scores.positions, position_scores.pos_key, position_scores.pos_query
    if not inference:
        c2p, p2c = position_scores.c2p, p2c_by_row(key, pos_query)
    context = query.new_empty(batch, length, heads, dim)
    group = group_p2c = None
    for sequences, first, last in _tiles(query, block_elements):
        if not inference:
            c2p_rows = c2p[sequences, :, first:last] if c2p is not None else None
            group_p2c = p2c[sequences] if p2c is not None else None
        else:
            if pos_query is not None and sequences != group:  # p2c of this group's reversed keys: k_j' . Qr[r]
                group_p2c, group = p2c_by_row(key[sequences], pos_query), sequences
            c2p_rows = position_table(query[sequences, :, first:last], pos_key)  # c2p of these rows: q_i . Kr[r]
        group_heads = (sequences.stop - sequences.start, heads)
        bias = _block_bias(positions, c2p_rows, group_p2c, position_scores.p2p, first, last, group_heads)
        bias = bias.to(query.dtype)
        if mask is not None:
            bias.masked_fill_(~_block_mask(mask, sequences, first, last), torch.finfo(query.dtype).min)
        attended = F.scaled_dot_product_attention(
            query[sequences, :, first:last],
            key[sequences],
            value[sequences],
            attn_mask=bias,
            dropout_p=dropout,
            scale=scaling,
        )
        context[sequences, first:last] = attended.transpose(1, 2)
    return context


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
    other [B, H, L, L] tensor and no whole [B, H, L, W] table is made. The workspace is kept between calls (on the
    forward's thread), so a step does not fault in fresh pages for tables that the last step also wrote.
    """

    @staticmethod
    def forward(ctx, query, key, value, pos_key, pos_query, mask, positions, scaling, dropout, block_elements=None):
        batch, heads, length, dim = query.shape
        tiles = _tiles(query, block_elements or SDPA_BLOCK_ELEMENTS)
        probs, keeps = [], []  # per block: P, and where dropout keeps it
        context = query.new_empty(batch, length, heads, dim)
        # in the query's dtype: under autocast the relative rows may be float32
        kr, qr = (rows.to(query.dtype) if rows is not None else None for rows in (pos_key, pos_query))
        group, p2c_rows = None, None
        with torch.autocast(query.device.type, enabled=False):  # the inputs already carry autocast's dtype
            scaled_query = query * scaling  # scaled before q . k, as in eager: q . k itself can overflow float16
            for sequences, first, last in tiles:
                rows = slice(first, last)
                if qr is not None and sequences != group:  # p2c of this group's reversed keys, read by table row
                    p2c_rows = _position_rows(positions, "p2c", key[sequences], qr).mT
                    group = sequences
                c2p_rows = _position_rows(positions, "c2p", query[sequences, :, rows], kr) if kr is not None else None
                group_heads = (sequences.stop - sequences.start, heads)
                scores = _block_bias(positions, c2p_rows, p2c_rows, None, first, last, group_heads)  # c2p + p2c
                scores.view(-1, *scores.shape[-2:]).baddbmm_(  # + c2c: q_i . k_j (the bias is fresh, contiguous)
                    _by_batch_head(scaled_query[sequences, :, rows]), _by_batch_head(key[sequences]).mT
                )
                if mask is not None:
                    scores.masked_fill_(~_block_mask(mask, sequences, first, last), torch.finfo(scores.dtype).min)
                block_probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
                block_probs = block_probs.to(query.dtype)
                probs.append(block_probs)
                if dropout > 0:
                    block_keep = dropout_keep_mask(block_probs.shape, dropout, block_probs.device)
                    keeps.append(block_keep)
                    block_probs = block_probs * block_keep  # a bool factor: cheaper than a `where` on the CPU
                attended = block_probs @ value[sequences]
                if dropout > 0:  # 1 / (1 - p) on the [n, D] product rather than on the [n, L] probabilities
                    attended.mul_(1 / (1 - dropout))
                context[sequences, rows] = attended.transpose(1, 2)
        ctx.save_for_backward(query, key, value, kr, qr, context, *probs, *keeps)
        ctx.tiles, ctx.positions, ctx.scaling, ctx.dropout = tiles, positions, scaling, dropout
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
        group = grad_p2c = None
        for (sequences, first, last), block_probs, block_keep in zip(tiles, probs, keeps):
            rows = slice(first, last)
            if qr is not None and sequences != group:  # the p2c table's gradient, one group of sequences at a time
                if group is not None:
                    _position_rows_backward(grad_p2c, key[group], qr, grad_key[group], grad_qr)
                grad_p2c = _position_rows(positions, "p2c", key[sequences], qr, zeroed=True)
                group = sequences
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
            index = positions.hankel(first, last - first, positions.length).expand_as(grad_scores)
            if kr is not None:  # c2p[i, column[i + j']] received dS[i, j'], and passes it on to q_i and Kr
                grad_c2p = _position_rows(positions, "c2p", block_query, kr, zeroed=True)
                grad_c2p.scatter_add_(-1, index, grad_scores)
                _position_rows_backward(grad_c2p, block_query, kr, grad_query[sequences, :, rows], grad_kr)
            if qr is not None:  # p2c[j', column[i + j']] received dS[i, j']
                grad_p2c.mT.scatter_add_(-2, index, grad_scores)
        if group is not None:
            _position_rows_backward(grad_p2c, key[group], qr, grad_key[group], grad_qr)
        grad_pos_key, grad_pos_query = (
            grad.to(dtype) if grad is not None else None for grad, dtype in zip((grad_kr, grad_qr), ctx.relative_dtypes)
        )
        return grad_query, grad_key, grad_value, grad_pos_key, grad_pos_query, None, None, None, None, None


def _position_rows(positions: RelativePositions, kind: str, content: Tensor, relative: Tensor, zeroed=False) -> Tensor:
    """content [g, H, n, D] against relative rows [H, W, D]: the table [g, H, n, W] in the workspace's `kind` buffer
    (laid out [H, g, n, W]: one product per head), or, `zeroed`, a zeroed buffer of that shape for its gradient."""
    groups, heads, count, _ = content.shape
    table = _scratch(positions, kind, (heads, groups * count, relative.shape[-2]), content)
    if zeroed:
        table.zero_()
    else:
        _by_head(content, relative, out=table)
    return table.view(heads, groups, count, -1).transpose(0, 1)


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
    count = math.prod(shape)
    words = torch.empty(-(-count // 4), dtype=torch.int64, device=device).random_()  # 63 random bits each
    lanes = words.view(torch.int16)[:count].bitwise_and_((1 << DROPOUT_BITS) - 1)  # 15 bits per lane
    return (lanes < round((1 - dropout) * (1 << DROPOUT_BITS))).view(shape)


def _by_batch_head(tensor: Tensor) -> Tensor:
    """[g, H, n, m] as [g * H, n, m] for a batched product (a view where the layout allows, else a copy)."""
    return tensor.reshape(-1, *tensor.shape[-2:])


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
    block_elements: int,
) -> Tensor:
    """CPU inference: the position terms read from tables by distance, so that a block's bias is a view, not a gather.

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
    (`_unpadded_span`), take part in no product and no call. Returns [B, L, H, D].
    """
    batch, heads, length, dim = query.shape
    positions, pos_key, pos_query = position_scores.positions, position_scores.pos_key, position_scores.pos_query
    # in the query's dtype: under autocast the projections may be float32 (matmul's out= is not autocast)
    pos_key, pos_query = (t.to(query.dtype) if t is not None else None for t in (pos_key, pos_query))
    lowest = torch.finfo(query.dtype).min
    key_mask = mask is not None and mask.shape[-2] == 1
    near_low, near_high = positions.near
    split = CPU_FLASH_WITH_LSE and (mask is None or key_mask) and near_high - near_low + 1 < length
    if not split:  # every distance is in the band
        near_low, near_high = -length, length
    width = min(length, near_high - near_low - 1)  # keys of a row in the band
    groups = -(-batch // max(1, block_elements // (heads * length * width)))  # sequences per block: balanced
    group = -(-batch // groups)
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
    fill_keys = key_mask and pos_query is not None and query.dtype != torch.float16
    # Kr by distance descending from `high`, Qr ascending from `low`: the distances T and U read
    kr_descending = _rows_by_distance(pos_key, positions, high, -1, high - low + 1) if pos_key is not None else None
    qr_ascending = _rows_by_distance(pos_query, positions, low, 1, high - low + 1) if pos_query is not None else None
    context = query.new_empty(batch, length, heads, dim)
    for start in range(0, batch, group):
        sequences = slice(start, min(start + group, batch))
        group_mask = mask[sequences] if mask is not None and mask.shape[0] > 1 else mask
        group_query, group_key, group_value = query[sequences], key[sequences], value[sequences]
        padded_keys = _padded_keys(group_mask) if fill_keys else []  # U's rows of these keys are masked
        span = _unpadded_span(group_mask, length) if key_mask else slice(0, length)
        far = []  # the keys beyond the reach of every row of a block: the far terms of each side (`_far_terms`)
        if split:
            far = _far_terms(positions, pos_key, pos_query, group_query, group_key, group_mask, span)
        for rows, band_keys in blocks:
            keys = slice(max(band_keys.start, span.start), min(band_keys.stop, span.stop))
            if keys.start >= keys.stop:  # the band holds padding only: it keeps its keys, all masked
                keys = band_keys
            shape = (rows.stop - rows.start, keys.stop - keys.start)
            bias = None
            if pos_key is not None:  # c2p = T[a, (rows - 1) - a + b]: T's columns descend from the block's highest d
                block_high, block_low = rows.stop - 1 - keys.start, rows.start - keys.stop + 1
                count, members = block_high - block_low + 1, sequences.stop - sequences.start
                # T's first `above` and last `below` columns are distances beyond the reach, where c2p is the row
                # constant of that side: they are filled with it; only the columns within the reach are a product
                # (into a column slice of T: a strided out=, slower per column than a contiguous one, on fewer columns).
                above, below = max(0, block_high - near_high + 1), max(0, near_low - block_low + 1)
                columns = _round_up(count - above - below)
                width = _round_up(max(count, above + columns))
                product = _scratch(positions, "c2p", (heads, members * shape[0], width), query)
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
            if pos_query is not None:  # p2c from U by band of keys, for these rows (`_band_table`)
                table = _band_table(positions, group_key, qr_ascending, low, (rows, keys), padded_keys)
                parts = _band_views(table, shape[0])
                bias_shape = (sequences.stop - sequences.start, heads, *shape)
                bias = _add_by_key_chunks(bias, parts, _scratch(positions, "bias", bias_shape, query))
            if group_mask is not None and not fill_keys:
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
    if key_mask and not mask.all():  # a sequence of padding only: uniform attention over every key, as in eager (its
        # rows saw only the group's unpadded span, and the split parts' log-sum-exps all round to the dtype's minimum)
        for sequence in (~mask.flatten(1).any(-1)).nonzero().flatten().tolist():
            if mask.shape[0] > 1:
                context[sequence] = value[sequence].mean(-2).unsqueeze(0)
            else:
                context[:] = value.mean(-2).unsqueeze(1)
    return context


def _scratch(positions: RelativePositions, kind: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A contiguous tensor of `shape` from a buffer of the workspace that only grows (a fresh allocation above
    glibc's mmap threshold costs page faults on every call; blocks, layers and later calls reuse this one)."""
    count = math.prod(shape)
    buffer = positions.workspace.get(kind)
    if (
        buffer is None
        or buffer.numel() < count
        or (buffer.dtype, buffer.device) != (like.dtype, like.device)
        or (buffer.is_inference() and not torch.is_inference_mode_enabled())  # no in-place writes outside it
    ):
        buffer = positions.workspace[kind] = like.new_empty(count)
        positions.workspace.pop(f"{kind} layout", None)  # what was written into the old buffer is not in this one
    return buffer[:count].view(shape)


ADD_CHUNK_KEYS = 512  # keys per add of the c2p and p2c views (see `_add_by_key_chunks`)


def _add_by_key_chunks(c2p: Tensor | None, parts: list[tuple[slice, Tensor]], out: Tensor) -> Tensor:
    """out = c2p + p2c ([g, H, rows, keys]; c2p, a view of T, may be None), one part of p2c's keys at a time.

    Each part is (keys, view) from `_band_views`: [g, H, rows, bands, keys per band] for whole bands of U, or
    [g, H, rows, keys] for a partial one. Along a row of the block, the p2c view steps from one row of U to the
    next, one cache line per key; the next query row reads the same lines one element on. In parts of at most 512
    keys those lines (32 KiB) stay in L1 from one query row to the next; a whole row of 1,000 keys or more would not
    (`benchmarks.cpu_inference` times both)."""
    for keys, p2c in parts:
        target = out[..., keys]
        c2p_keys = c2p[..., keys] if c2p is not None else None
        if p2c.dim() == 5:  # whole bands: the block's keys as [bands, keys per band]
            target = target.unflatten(-1, p2c.shape[-2:])
            c2p_keys = c2p_keys.unflatten(-1, p2c.shape[-2:]) if c2p_keys is not None else None
        if c2p_keys is None:
            target.copy_(p2c)
        else:
            torch.add(c2p_keys, p2c, out=target)
    return out


def _by_head(rows: Tensor, relative: Tensor, out: Tensor | None = None) -> Tensor:
    """rows [g, H, n, D] against relative [H, E, D]: [g, H, n, E], one [g * n, D] x [D, E] product per head (a
    broadcast matmul would copy `relative` g times). `out`, if given, is [H, g * n, E] (a view is fine)."""
    groups, heads, count, dim = rows.shape
    flat = rows.transpose(0, 1).reshape(heads, groups * count, dim)  # a view when g = 1
    product = torch.bmm(flat, relative.mT, out=out)
    return product.view(heads, groups, count, relative.shape[-2]).transpose(0, 1)  # explicit: B or L may be 0


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
    buffer = _scratch(positions, "band table", (heads * groups * sum(map(math.prod, zip(sizes, widths))),), key)
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
    matrix-vector bmm, many times slower on the CPU than the [1, D] x [D, n] product einsum chooses.)"""
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


_compiled_flex = None
FLEX_COMPILED = True  # False runs flex_attention's dense reference of the same score_mod (tests)


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
    compiled: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """FlexAttention whose `score_mod` reads the [B, H, L, W] tables: memory linear in L, no [L, L] tensor.

    Takes no dropout (the caller falls back to sdpa when it is needed). Uncompiled, flex_attention runs
    the same `score_mod` densely, which the tests use to check it cheaply.
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

    compiled = FLEX_COMPILED if compiled is None else compiled
    attend = compiled_flex_attention() if compiled else _flex_attention
    blocks = full_block_mask(length, key.shape[-2], query.device) if compiled and FLEX_TILES else None
    context = attend(query, key, value, score_mod=score_mod, block_mask=blocks, scale=scaling)
    return context.transpose(1, 2), None


FLEX_AVAILABLE = _flex_attention is not None

DISENTANGLED_ATTENTION_FUNCTIONS = {
    "eager": eager_disentangled,
    "sdpa": sdpa_disentangled,
    "flex_attention": flex_disentangled,
}


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
