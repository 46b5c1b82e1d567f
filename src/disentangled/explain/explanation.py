"""See the terms of disentangled attention: each term's scores, their sizes, and what the position terms learned.

`explain_attention(model, **inputs)` recomputes, for every layer and head, the score of the model's attention
term by term, from the attention modules' own weights and the hidden states the model itself produced:

    A_ij = c2c + c2p + p2c [+ p2p], each term scaled by 1 / sqrt(head_dim * number_of_terms)
    c2c = q_i . k_j                   q = H Wq_c, k = H Wk_c
    c2p = q_i . Kr[δ(i, j)]           Kr = P Wk_p  (Wk_p = Wk_c with share_att_key)
    p2c = k_j . Qr[δ(i, j)]           Qr = P Wq_p  (Wq_p = Wq_c with share_att_key)
    p2p = Qr[δ(i, j)] . Kr[δ(j, i)]   only when pos_att_type lists "p2p"; no released checkpoint does

δ(i, j) is the relative distance i - j, log-bucketed (v2/v3) or clipped (v1), as the model buckets it; both c2p
and p2c read δ(i, j), as the released checkpoints were trained. A_ij is the score the model's eager attention
masks and softmaxes (the tests check the sum against it to 1e-5 in float32).

The model's forward is not changed and costs nothing when this is not used: one ordinary forward returns the
hidden states (entry l is the input of layer l) and the attention probabilities; the terms of layer l are then
computed from entry l. Weights are read through the public modules (`query_proj`, `key_proj`, `pos_key_proj`,
`pos_query_proj`, `scaling`, `use_c2p`/`use_p2c`/`use_p2p`, `share_att_key`) and the encoder's
`get_rel_embedding()`, never through the attention backends' internal tables. Everything runs in eval mode.

Statistics, over valid pairs only (query and key both real tokens, or the pairs a [B, L, L] mask allows):

- `mean_abs`: mean |term|; `std`: its standard deviation.
- `share`: Cov(term, A) / Var(A), the term's share of the variance of the summed score. The shares of a layer
  add up to 1; a term that works against the others has a negative share.
- `row_share`: the same with every term centred on each query row's mean over its valid keys. Softmax ignores
  what is constant along a row, so this is each term's share of the variation that moves attention.

The distance profile is the mean of each term over the valid pairs at each relative distance δ(i, j): a c2p
that peaks at δ = 1 is a head that reads the previous token.

`explain_texts(model, tokenizer, texts)` gives the same statistics and profiles over many texts: `TermSums` adds
each batch's per-head sums (pairs, Σx, Σx², Σ|x|, Σx·A, and the same within rows; each term's sum at each distance)
and divides once, so every valid pair of every text weighs the same, whatever the batch size or padding. Its
distance profiles leave out pairs with a special token by default: [CLS] sits at i = 0 and [SEP] at the end, so
their scores would show up as effects of distance.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from torch import Tensor

from ..modeling.disentangled_attention import log_bucket
from .terms import AttentionTerms, LayerSummary, LayerTerms


@torch.no_grad()
def explain_attention(model: torch.nn.Module, **inputs: Tensor) -> AttentionTerms:
    """The attention terms of every layer and head of `model` (any of our models or heads) on `inputs`.

    `inputs` are the model's own (`input_ids` or `inputs_embeds`, `attention_mask`, `token_type_ids`,
    `position_ids`); multiple-choice inputs [B, C, L] are flattened to [B * C, L].
    """
    inputs = _flat(inputs)
    layers = []
    for terms, probabilities, valid, delta in layers_terms(model, **inputs):
        if probabilities is None:  # a backend that returns none: the eager definition, keys masked
            pairs_given = inputs.get("attention_mask") is not None and inputs["attention_mask"].dim() == 3
            allowed = valid if pairs_given else valid.any(-2, keepdim=True)  # [B, L or 1, L]
            masked = sum(terms.values()).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
            probabilities = masked.softmax(-1)
        statistics, head_statistics = term_statistics(terms, valid)
        scores = sum(terms.values()).double().transpose(0, 1)[:, valid]
        total = {"mean_abs": scores.abs().mean().item(), "std": scores.std(correction=0).item()}
        distances, profile = distance_profile(terms, valid, delta)
        layers.append(LayerTerms(statistics, total, head_statistics, distances, profile, terms, probabilities.float()))
    return _result(model, layers, valid)


def _flat(inputs: dict) -> dict:
    if inputs.get("input_ids") is not None and inputs["input_ids"].dim() == 3:
        return {name: value.flatten(0, 1) if value is not None else None for name, value in inputs.items()}
    return inputs


def _result(model: torch.nn.Module, layers: list, valid: Tensor | None, **counts) -> AttentionTerms:
    config = model.base_model.config
    return AttentionTerms(
        layers=layers,
        valid_pairs=valid,
        term_names=tuple(layers[0].statistics),
        relative_attention=bool(config.relative_attention),
        scaling=float(model.base_model.encoder.layer[0].attention.self.scaling),
        **counts,
    )


@torch.no_grad()
def layers_terms(model: torch.nn.Module, **inputs: Tensor):
    """For each layer, in order: (its terms [B, H, L, L], its probabilities or None, valid pairs [B, L, L], δ [L, L]).

    One forward (eval mode, restored after) gives the hidden states and probabilities; each layer's terms are
    computed from its input only when the loop reaches it.
    """
    base = model.base_model
    encoder = base.encoder
    config = base.config
    was_training = model.training
    model.eval()
    try:
        outputs = base(**inputs, output_hidden_states=True, output_attentions=True, return_dict=True)
        rel_embeddings = encoder.get_rel_embedding() if config.relative_attention else None
        hidden_states = outputs.hidden_states
        batch, length = hidden_states[0].shape[:2]
        valid = valid_pairs(inputs.get("attention_mask"), batch, length, hidden_states[0].device)
        column, delta = relative_columns(config, length, hidden_states[0].device)
        for index, layer in enumerate(encoder.layer):
            terms = layer_terms(layer.attention.self, hidden_states[index], rel_embeddings, column)
            probabilities = outputs.attentions[index] if outputs.attentions is not None else None
            yield terms, probabilities, valid, delta
    finally:
        model.train(was_training)


def valid_pairs(attention_mask: Tensor | None, batch: int, length: int, device) -> Tensor:
    """[B, L, L] bool: query i and key j both real tokens ([B, L] mask), or the pairs a [B, L, L] mask allows."""
    if attention_mask is None:
        return torch.ones(batch, length, length, dtype=torch.bool, device=device)
    if attention_mask.dim() == 2:
        real = attention_mask != 0
        return real[:, :, None] & real[:, None, :]
    return attention_mask != 0


def relative_columns(config, length: int, device) -> tuple[Tensor | None, Tensor]:
    """The row of the relative embeddings each pair reads, and its relative distance δ(i, j), both [L, L].

    δ(i, j) is i - j, log-bucketed when `position_buckets > 0`, clipped to [-span, span - 1] like the
    embedding rows (column = δ + span). Without relative attention the column is None and δ is plain i - j.
    """
    positions = torch.arange(length, device=device)
    distance = positions[:, None] - positions[None, :]  # i - j
    if not config.relative_attention:
        return None, distance
    span = config.relative_span
    if config.position_buckets > 0:
        distance = log_bucket(distance, config.position_buckets, config.max_relative_distance)
    column = (distance + span).clamp(0, 2 * span - 1)
    return column, column - span


def layer_terms(
    attention: torch.nn.Module, hidden_states: Tensor, rel_embeddings: Tensor | None, column: Tensor | None
) -> dict[str, Tensor]:
    """c2c, c2p, p2c (and p2p) of one attention layer as [B, H, L, L] float32, each scaled, before the mask.

    `hidden_states` [B, L, hidden] is the layer's input, `rel_embeddings` [2S, hidden] the normalised relative
    embeddings P, `column` [L, L] the row of P each pair (i, j) reads.
    """

    def heads(x: Tensor) -> Tensor:  # [..., L, H * D] -> [..., H, L, D]
        return x.unflatten(-1, (attention.num_heads, attention.head_dim)).transpose(-3, -2)

    def by_pair(by_column: Tensor, index: Tensor) -> Tensor:  # [B, H, L, 2S] -> [B, H, L, L]: take index[i, j]
        return by_column.gather(-1, index.expand(*by_column.shape[:-2], *index.shape))

    scaling = attention.scaling
    query = heads(attention.query_proj(hidden_states)).float()  # [B, H, L, D]
    key = heads(attention.key_proj(hidden_states)).float()
    terms = {"c2c": (query @ key.mT) * scaling}  # q_i . k_j
    if rel_embeddings is None or not (attention.use_c2p or attention.use_p2c or attention.use_p2p):
        return terms

    if attention.use_c2p or attention.use_p2p:
        key_proj = attention.key_proj if attention.share_att_key else attention.pos_key_proj
        pos_key = heads(key_proj(rel_embeddings)).float()  # Kr: [H, 2S, D]
    if attention.use_p2c or attention.use_p2p:
        query_proj = attention.query_proj if attention.share_att_key else attention.pos_query_proj
        pos_query = heads(query_proj(rel_embeddings)).float()  # Qr: [H, 2S, D]
    if attention.use_c2p:
        terms["c2p"] = by_pair(query @ pos_key.mT, column) * scaling  # q_i . Kr[δ(i, j)]
    if attention.use_p2c:
        terms["p2c"] = by_pair(key @ pos_query.mT, column.T).mT * scaling  # k_j . Qr[δ(i, j)]
    if attention.use_p2p:
        p2p = (pos_query @ pos_key.mT)[:, column, column.T] * scaling  # Qr[δ(i, j)] . Kr[δ(j, i)]: [H, L, L]
        terms["p2p"] = p2p.expand(query.shape[0], *p2p.shape)
    return terms


def term_statistics(
    terms: dict[str, Tensor], valid: Tensor
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Tensor]]]:
    """Per-layer (all heads pooled) and per-head statistics of each term over the valid pairs (see the module doc)."""
    total = sum(terms.values())
    count = valid.sum(-1, keepdim=True).clamp(min=1)  # valid keys per query row, [B, L, 1]

    def values(x: Tensor) -> Tensor:  # [B, H, L, L] -> [H, N], float64
        return x.double().transpose(0, 1)[:, valid]

    def row_centred(x: Tensor) -> Tensor:  # each query row minus its mean over valid keys
        row_mean = (x * valid[:, None]).sum(-1, keepdim=True) / count[:, None]
        return x - row_mean

    def share(x: Tensor, a: Tensor, dim) -> Tensor:  # Cov(x, a) / Var(a)
        x = x - x.mean(dim, keepdim=True)
        a = a - a.mean(dim, keepdim=True)
        return (x * a).mean(dim) / (a * a).mean(dim)

    a, a_rows = values(total), values(row_centred(total))
    layer, by_head = {}, {}
    for name, term in terms.items():
        x, x_rows = values(term), values(row_centred(term))
        by_head[name] = {
            "mean_abs": x.abs().mean(-1).float(),
            "std": x.std(-1, correction=0).float(),
            "share": share(x, a, -1).float(),
            "row_share": share(x_rows, a_rows, -1).float(),
        }
        layer[name] = {
            "mean_abs": x.abs().mean().item(),
            "std": x.std(correction=0).item(),
            "share": share(x.flatten(), a.flatten(), 0).item(),
            "row_share": share(x_rows.flatten(), a_rows.flatten(), 0).item(),
        }
    return layer, by_head


def distance_profile(terms: dict[str, Tensor], valid: Tensor, delta: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The mean of each term over the valid pairs at each relative distance: ([K] distances, term -> [H, K])."""
    distances, group = torch.unique(delta.expand_as(valid)[valid], return_inverse=True)
    pairs = torch.bincount(group, minlength=len(distances)).double()
    profile = {}
    for name, term in terms.items():
        values = term.double().transpose(0, 1)[:, valid]  # [H, N]
        sums = values.new_zeros(values.shape[0], len(distances)).index_add_(1, group, values)
        profile[name] = (sums / pairs).float()
    return distances, profile


class TermSums:
    """Statistics and distance profiles over many batches, summed pair by pair and divided at the end.

    `add(layer, terms, valid, delta, profile_pairs)` adds one layer of one batch (layer 0 first): per head, in
    float64, the count of valid pairs, Σx, Σx², Σ|x| and Σx·A of each term x and of the total A, the same for
    row-centred values (rows are centred within their own batch, so padding never enters), and each term's sum at
    each relative distance over `profile_pairs` (default: the valid pairs). `summary()` divides: the statistics of
    `term_statistics` and the profile of `distance_profile` over the union of all the batches' pairs, whatever the
    batch size or padding.
    """

    STATES = ("sum", "square", "absolute", "product", "row_sum", "row_square", "row_product")

    def __init__(self):
        self.layers: list[dict] = []
        self.pairs = 0  # valid pairs per head
        self.profile_pairs = 0

    def add(
        self, layer: int, terms: dict[str, Tensor], valid: Tensor, delta: Tensor, profile_pairs: Tensor | None = None
    ) -> None:
        """Add one layer of one batch: terms [B, H, L, L], valid [B, L, L], δ [L, L], profile pairs [B, L, L]."""
        profile_pairs = valid if profile_pairs is None else profile_pairs & valid
        if layer == len(self.layers):
            self.layers.append({"terms": {}, "profile": {}, "distance_pairs": {}})
        sums = self.layers[layer]
        if layer == 0:
            self.pairs += int(valid.sum())
            self.profile_pairs += int(profile_pairs.sum())
        count = valid.sum(-1, keepdim=True).clamp(min=1)[:, None]  # valid keys per query row, [B, 1, L, 1]

        def values(x: Tensor) -> tuple[Tensor, Tensor]:  # [B, H, L, L] -> [H, N] and row-centred [H, N], float64
            x = x.double()
            row_mean = (x * valid[:, None]).sum(-1, keepdim=True) / count
            return x.transpose(0, 1)[:, valid], (x - row_mean).transpose(0, 1)[:, valid]

        a, a_rows = values(sum(terms.values()))
        for name, term in [*terms.items(), ("total", None)]:
            x, x_rows = (a, a_rows) if term is None else values(term)
            batch = {
                "sum": x.sum(-1),
                "square": (x * x).sum(-1),
                "absolute": x.abs().sum(-1),
                "product": (x * a).sum(-1),
                "row_sum": x_rows.sum(-1),
                "row_square": (x_rows * x_rows).sum(-1),
                "row_product": (x_rows * a_rows).sum(-1),
            }
            own = sums["terms"].setdefault(name, {state: 0.0 for state in self.STATES})
            for state, value in batch.items():
                own[state] = own[state] + value

        distances, group = torch.unique(delta.expand_as(profile_pairs)[profile_pairs], return_inverse=True)
        for distance, pairs in zip(distances.tolist(), torch.bincount(group, minlength=len(distances)).tolist()):
            sums["distance_pairs"][distance] = sums["distance_pairs"].get(distance, 0) + pairs
        for name, term in terms.items():
            by_pair = term.double().transpose(0, 1)[:, profile_pairs]  # [H, N]
            by_distance = by_pair.new_zeros(by_pair.shape[0], len(distances)).index_add_(1, group, by_pair)
            profile = sums["profile"].setdefault(name, {})
            for column, distance in enumerate(distances.tolist()):
                profile[distance] = profile.get(distance, 0.0) + by_distance[:, column]

    def summary(self) -> list[LayerSummary]:
        """One `LayerSummary` per layer: the statistics and profiles of every pair added so far."""
        if not self.pairs:
            raise ValueError("no valid pairs were added: give texts with at least one token")
        layers = []
        for sums in self.layers:
            total = sums["terms"]["total"]
            statistics, head_statistics = {}, {}
            for name, own in sums["terms"].items():
                if name == "total":
                    continue
                by_head = _statistics(own, total, self.pairs)
                pooled = _statistics(
                    {k: v.sum() for k, v in own.items()},
                    {k: v.sum() for k, v in total.items()},
                    self.pairs * len(own["sum"]),
                )
                head_statistics[name] = {stat: value.float() for stat, value in by_head.items()}
                statistics[name] = {stat: value.item() for stat, value in pooled.items()}
            pooled_total = _statistics(
                {k: v.sum() for k, v in total.items()},
                {k: v.sum() for k, v in total.items()},
                self.pairs * len(total["sum"]),
            )
            distances = sorted(sums["distance_pairs"])
            pairs = torch.tensor([sums["distance_pairs"][d] for d in distances], dtype=torch.float64)
            heads = len(total["sum"])
            profile = {  # [H, K]; K = 0 where no pair is left (texts of special tokens only)
                name: (torch.stack([by_distance[d] for d in distances], -1) / pairs).float()
                if distances
                else torch.zeros(heads, 0)
                for name, by_distance in sums["profile"].items()
            }
            layers.append(
                LayerSummary(
                    statistics,
                    {"mean_abs": pooled_total["mean_abs"].item(), "std": pooled_total["std"].item()},
                    head_statistics,
                    torch.tensor(distances, dtype=torch.long),
                    profile,
                )
            )
        return layers


def _statistics(own: dict[str, Tensor], total: dict[str, Tensor], count: int) -> dict[str, Tensor]:
    """mean |x|, std(x), Cov(x, A) / Var(A) and the same within rows, from the sums of `TermSums`."""

    def covariance(product: Tensor, x_sum: Tensor, a_sum: Tensor) -> Tensor:
        return product / count - (x_sum / count) * (a_sum / count)

    return {
        "mean_abs": own["absolute"] / count,
        "std": covariance(own["square"], own["sum"], own["sum"]).clamp(min=0).sqrt(),
        "share": covariance(own["product"], own["sum"], total["sum"])
        / covariance(total["square"], total["sum"], total["sum"]),
        "row_share": covariance(own["row_product"], own["row_sum"], total["row_sum"])
        / covariance(total["row_square"], total["row_sum"], total["row_sum"]),
    }


@torch.no_grad()
def explain_texts(
    model: torch.nn.Module,
    tokenizer,
    texts: list[str],
    batch_size: int = 16,
    max_length: int = 128,
    exclude_special: bool = True,
) -> AttentionTerms:
    """The statistics and distance profiles of `model`'s attention terms over all of `texts`, batch by batch.

    Each text is tokenized alone (truncated to `max_length` tokens) and padded within its batch; the statistics
    read every valid (query, key) pair of every text, so they do not depend on `batch_size`. With
    `exclude_special`, the distance profiles leave out pairs whose query or key is a special token ([CLS], [SEP]):
    they sit at fixed positions, so their scores would otherwise show up as effects of distance.
    """
    if not texts:
        raise ValueError("no texts to explain: give at least one non-empty text")
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    sums = TermSums()
    for start in range(0, len(texts), batch_size):
        encoded = tokenizer(
            texts[start : start + batch_size],
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=max_length,
            return_special_tokens_mask=True,
        )
        inputs = {name: encoded[name] for name in ("input_ids", "attention_mask", "token_type_ids") if name in encoded}
        ordinary = encoded["special_tokens_mask"] == 0
        for index, (terms, _, valid, delta) in enumerate(layers_terms(model, **inputs)):
            profile_pairs = ordinary[:, :, None] & ordinary[:, None, :] if exclude_special else None
            sums.add(index, terms, valid, delta, profile_pairs)
    return _result(model, sums.summary(), None, texts=len(texts), pairs=sums.pairs, profile_pairs=sums.profile_pairs)


def format_table(explanation: AttentionTerms) -> str:
    """Per layer and term: mean |term|, standard deviation, share of the score variance, share within rows."""
    lines = [
        f"{'layer':>5}  {'term':<5}  {'mean|s|':>8}  {'std':>8}  {'share':>7}  {'in rows':>7}",
    ]
    for index, layer in enumerate(explanation.layers):
        total = {**layer.total, "share": 1.0, "row_share": 1.0}
        for position, (name, stats) in enumerate([*layer.statistics.items(), ("total", total)]):
            label = f"{index:>5}" if position == 0 else " " * 5
            lines.append(
                f"{label}  {name:<5}  {stats['mean_abs']:>8.4f}  {stats['std']:>8.4f}  "
                f"{_percent(stats['share'])}  {_percent(stats['row_share'])}"
            )
    return "\n".join(lines)


def format_head_table(explanation: AttentionTerms, layer: int) -> str:
    """One layer's share (and share within rows) of each term, head by head."""
    statistics = explanation.layers[layer].head_statistics
    names = list(statistics)
    lines = [f"{'head':>5}  " + "  ".join(f"{name:>15}" for name in names)]
    for head in range(len(statistics[names[0]]["share"])):
        cells = [
            f"{_percent(statistics[name]['share'][head])} /{_percent(statistics[name]['row_share'][head])}"
            for name in names
        ]
        lines.append(f"{head:>5}  " + "  ".join(cells))
    return "\n".join(lines)


def _percent(value: float) -> str:
    value = float(value)
    return f"{'-':>7}" if math.isnan(value) else f"{100 * value:>6.1f}%"


# The `disentangled explain` command.

FIGURES = ("terms_layer{layer}_head{head}.png", "term_shares.png", "distance_profile.png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model folder or Hub id, with its tokenizer")
    parser.add_argument("text", nargs="?", help="the text to explain (or --texts-file)")
    parser.add_argument(
        "--texts-file",
        metavar="FILE",
        help="explain many texts: a text file (one text per line, or paragraphs separated by blank lines) or a "
        ".csv/.json/.jsonl file with a --text-column; statistics and distance profiles over every text",
    )
    parser.add_argument("--text-column", default="text", help="the text column of .csv / .json(l) files")
    parser.add_argument("--max-texts", type=int, metavar="N", help="--texts-file: the first N texts only")
    parser.add_argument("--batch-size", type=int, default=16, help="--texts-file: texts per forward (default 16)")
    parser.add_argument(
        "--exclude-special",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--texts-file: leave pairs with [CLS]/[SEP] out of the distance profiles (default: on)",
    )
    parser.add_argument("--layer", type=int, default=0, help="layer of the heatmaps (default 0; -1 is the last)")
    parser.add_argument("--head", type=int, default=0, help="head of the heatmaps (default 0)")
    parser.add_argument("--out", type=Path, default=Path("explain"), help="folder for the figures (default ./explain)")
    parser.add_argument(
        "--json",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="also write the statistics as JSON: to PATH, to OUT/statistics.json without one, to stdout with '-'",
    )
    parser.add_argument("--no-plots", action="store_true", help="print the tables only, write no figures")
    parser.add_argument("--max-length", type=int, default=128, help="truncate each text to this many tokens")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow the model's own code from the Hub to run"
    )


def load(name: str, trust_remote_code: bool = False):
    """The base model (eval mode) and tokenizer of a folder or Hub id; a transformers DeBERTa-v2 folder loads as ours."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from ..modeling import DisentangledModel

    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # a head's weights are "unexpected" in the base model: expected
    transformers_logging.disable_progress_bar()
    try:
        if config.model_type == "deberta-v2":
            model = DisentangledModel.from_pretrained(name, attn_implementation="eager")
        else:
            model = AutoModel.from_pretrained(name, trust_remote_code=trust_remote_code, attn_implementation="eager")
    finally:
        transformers_logging.set_verbosity(verbosity)
        transformers_logging.enable_progress_bar()
    attention = model.base_model.encoder.layer[0].attention.self if hasattr(model.base_model, "encoder") else None
    if not hasattr(attention, "use_c2p"):
        raise ValueError(f"{name} is a {type(model).__name__}, not a disentangled-attention model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(f"no tokenizer could be loaded from {name}: {error}") from error
    return model.eval(), tokenizer


def run(args: argparse.Namespace) -> int:
    if (args.text is None) == (args.texts_file is None):
        raise ValueError("give either a text or --texts-file FILE (one text per line), not both or neither")
    texts = read_texts(args.texts_file, args.text_column, args.max_texts) if args.texts_file is not None else None
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    model, tokenizer = load(args.model, args.trust_remote_code)
    config = model.config
    layer = args.layer + config.num_hidden_layers if args.layer < 0 else args.layer
    if not 0 <= layer < config.num_hidden_layers:
        raise ValueError(f"--layer {args.layer}: the model has layers 0 to {config.num_hidden_layers - 1}")
    if not 0 <= args.head < config.num_attention_heads:
        raise ValueError(f"--head {args.head}: the model has heads 0 to {config.num_attention_heads - 1}")

    if texts is not None:
        return run_texts_file(args, model, tokenizer, layer, texts)
    encoded = tokenizer(args.text, return_tensors="pt", truncation=True, max_length=args.max_length)
    inputs = {name: encoded[name] for name in ("input_ids", "attention_mask", "token_type_ids") if name in encoded}
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0].tolist())
    explanation = explain_attention(model, **inputs)

    statistics = {"model": str(args.model), "text": args.text, "tokens": tokens, **explanation.to_dict()}
    to_stdout = args.json == "-"
    report = sys.stderr if to_stdout else sys.stdout
    print(describe(model, explanation, tokens), file=report)
    return report_and_write(args, explanation, statistics, layer, report, tokens)


def report_and_write(args, explanation: AttentionTerms, statistics: dict, layer: int, report, tokens) -> int:
    """The tables, then the figures (the heatmap of one text's terms only when `tokens` are given) and --json."""
    print(format_table(explanation), file=report)
    print(LEGEND, file=report)
    print(f"\nlayer {layer}, share / share within rows, by head:", file=report)
    print(format_head_table(explanation, layer), file=report)

    written = []
    if not args.no_plots:
        try:
            from . import plots
        except ImportError:
            print("no figures: matplotlib is missing (pip install 'disentangled[plots]')", file=sys.stderr)
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            if tokens is not None:
                terms_name = FIGURES[0].format(layer=layer, head=args.head)
                plots.plot_terms(explanation.layers[layer], args.head, tokens, args.out / terms_name, layer_index=layer)
                written.append(args.out / terms_name)
            plots.plot_shares(explanation, args.out / FIGURES[1])
            plots.plot_distance_profile(explanation, args.out / FIGURES[2], layer=layer)
            written += [args.out / FIGURES[1], args.out / FIGURES[2]]
    written += write_json(args, statistics)
    if written:
        print("\nwrote " + ", ".join(str(path) for path in written), file=report)
    return 0


def write_json(args: argparse.Namespace, statistics: dict) -> list[Path]:
    """--json: the statistics to stdout ('-'), to PATH, or to OUT/statistics.json; the paths written."""
    if args.json is None:
        return []
    text = json.dumps(statistics, indent=1)
    if args.json == "-":
        print(text)
        return []
    path = Path(args.json) if args.json else args.out / "statistics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return [path]


def read_texts(name: str, text_column: str = "text", max_texts: int | None = None) -> list[str]:
    """The texts of a file, in order: one per line of a text file (or per paragraph where blank lines separate
    them), one per row of a .csv/.json/.jsonl file's `text_column`; read as `disentangled pretrain` reads its data."""
    from ..pretraining.data import check_data_files, load_texts

    if max_texts is not None and max_texts < 1:
        raise ValueError(f"--max-texts must be at least 1, got {max_texts}")
    try:
        dataset = load_texts(check_data_files([name], "--texts-file"), text_column, "--texts-file")
    except ValueError as error:
        raise ValueError(f"{error} (give a text file with one text per line, or a .csv/.jsonl file)") from error
    if max_texts is not None:
        dataset = dataset.select(range(min(max_texts, len(dataset))))
    return [text.strip() for text in dataset["text"]]


def run_texts_file(args: argparse.Namespace, model, tokenizer, layer: int, texts: list[str]) -> int:
    """`--texts-file`: the tables and the share and distance figures over every text; no text or token is printed."""
    explanation = explain_texts(model, tokenizer, texts, args.batch_size, args.max_length, args.exclude_special)
    statistics = {"model": str(args.model), "texts_file": str(args.texts_file), **explanation.to_dict()}
    report = sys.stderr if args.json == "-" else sys.stdout
    special = "without" if args.exclude_special else "with"
    print(describe(model, explanation, None), file=report)
    print(
        f"{explanation.texts} texts (at most {args.max_length} tokens each): {explanation.pairs} (query, key) pairs "
        f"per head; distance profiles over {explanation.profile_pairs} pairs, {special} [CLS]/[SEP]\n",
        file=report,
    )
    return report_and_write(args, explanation, statistics, layer, report, tokens=None)


LEGEND = (
    "mean|s|: mean absolute score; std: its standard deviation; share: Cov(term, total) / Var(total) over valid\n"
    "pairs (the shares add up to 100%); in rows: the same within each query row, the part softmax responds to."
)


def describe(model: torch.nn.Module, explanation: AttentionTerms, tokens: list[str] | None) -> str:
    config = model.config
    if explanation.relative_attention and len(explanation.term_names) > 1:
        distance = (
            f"log-bucketed relative distance ({config.position_buckets} buckets)"
            if config.position_buckets > 0
            else f"relative distance clipped at {config.relative_span}"
        )
        terms = f"terms {' + '.join(explanation.term_names)}, {distance}"
    elif not explanation.relative_attention:
        terms = "no relative attention: the score is c2c alone, without position terms"
    else:
        terms = "pos_att_type lists no position term: the score is c2c alone, without position terms"
    header = (
        f"{type(model).__name__}: {config.num_hidden_layers} layers x {config.num_attention_heads} heads; {terms}; "
        f"scaling {explanation.scaling:.4g}"
    )
    return header if tokens is None else f"{header}\n{len(tokens)} tokens: {' '.join(tokens)}\n"
