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
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from torch import Tensor

from .attention_terms import AttentionTerms, LayerTerms
from .modeling.disentangled_attention import log_bucket


@torch.no_grad()
def explain_attention(model: torch.nn.Module, **inputs: Tensor) -> AttentionTerms:
    """The attention terms of every layer and head of `model` (any of our models or heads) on `inputs`.

    `inputs` are the model's own (`input_ids` or `inputs_embeds`, `attention_mask`, `token_type_ids`,
    `position_ids`); multiple-choice inputs [B, C, L] are flattened to [B * C, L].
    """
    base = model.base_model
    encoder = base.encoder
    config = base.config
    if inputs.get("input_ids") is not None and inputs["input_ids"].dim() == 3:
        inputs = {name: value.flatten(0, 1) if value is not None else None for name, value in inputs.items()}
    was_training = model.training
    model.eval()
    try:
        outputs = base(**inputs, output_hidden_states=True, output_attentions=True, return_dict=True)
        rel_embeddings = encoder.get_rel_embedding() if config.relative_attention else None
        hidden_states = outputs.hidden_states
        batch, length = hidden_states[0].shape[:2]
        valid = valid_pairs(inputs.get("attention_mask"), batch, length, hidden_states[0].device)
        column, delta = relative_columns(config, length, hidden_states[0].device)
        layers = []
        for index, layer in enumerate(encoder.layer):
            attention = layer.attention.self
            terms = layer_terms(attention, hidden_states[index], rel_embeddings, column)
            probabilities = outputs.attentions[index] if outputs.attentions is not None else None
            if probabilities is None:  # a backend that returns none: the eager definition, keys masked
                pairs_given = inputs.get("attention_mask") is not None and inputs["attention_mask"].dim() == 3
                allowed = valid if pairs_given else valid.any(-2, keepdim=True)  # [B, L or 1, L]
                masked = sum(terms.values()).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
                probabilities = masked.softmax(-1)
            statistics, head_statistics = term_statistics(terms, valid)
            scores = sum(terms.values()).double().transpose(0, 1)[:, valid]
            total = {"mean_abs": scores.abs().mean().item(), "std": scores.std(correction=0).item()}
            distances, profile = distance_profile(terms, valid, delta)
            layers.append(
                LayerTerms(terms, probabilities.float(), statistics, total, head_statistics, distances, profile)
            )
    finally:
        model.train(was_training)
    first = encoder.layer[0].attention.self
    return AttentionTerms(
        layers=layers,
        valid_pairs=valid,
        term_names=tuple(layers[0].terms),
        relative_attention=bool(config.relative_attention),
        scaling=float(first.scaling),
    )


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
    parser.add_argument("text", nargs="?", help="the text to explain (or --file)")
    parser.add_argument(
        "--file",
        type=Path,
        help="a text file, one text a line: statistics and distance profiles pooled over every valid pair of all of "
        "them (the heatmaps show the first)",
    )
    parser.add_argument("--max-texts", type=int, default=64, help="with --file: the first N non-empty lines (64)")
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
    parser.add_argument("--max-length", type=int, default=128, help="truncate the text to this many tokens")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow the model's own code from the Hub to run"
    )


def load(name: str, trust_remote_code: bool = False):
    """The base model (eval mode) and tokenizer of a folder or Hub id; a transformers DeBERTa-v2 folder loads as ours."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from .modeling import DisentangledModel

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


def read_texts(args: argparse.Namespace) -> list[str]:
    """The text, or the first --max-texts non-empty lines of --file."""
    if (args.text is None) == (args.file is None):
        raise ValueError("give a text or --file FILE (one text a line), not both")
    if args.file is None:
        return [args.text]
    if args.max_texts < 1:
        raise ValueError(f"--max-texts must be at least 1, got {args.max_texts}")
    try:
        lines = args.file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--file {args.file}: cannot be read as UTF-8 text ({error})") from error
    texts = [line.strip() for line in lines if line.strip()][: args.max_texts]
    if not texts:
        raise ValueError(f"--file {args.file} has no text: give one text a line")
    return texts


def run(args: argparse.Namespace) -> int:
    import disentangled  # noqa: F401  (registers the Auto classes)

    model, tokenizer = load(args.model, args.trust_remote_code)
    config = model.config
    layer = args.layer + config.num_hidden_layers if args.layer < 0 else args.layer
    if not 0 <= layer < config.num_hidden_layers:
        raise ValueError(f"--layer {args.layer}: the model has layers 0 to {config.num_hidden_layers - 1}")
    if not 0 <= args.head < config.num_attention_heads:
        raise ValueError(f"--head {args.head}: the model has heads 0 to {config.num_attention_heads - 1}")

    texts = read_texts(args)
    encoded = tokenizer(texts, return_tensors="pt", truncation=True, max_length=args.max_length, padding=True)
    inputs = {name: encoded[name] for name in ("input_ids", "attention_mask", "token_type_ids") if name in encoded}
    first = encoded["input_ids"][0][encoded["attention_mask"][0].bool()]
    tokens = tokenizer.convert_ids_to_tokens(first.tolist())
    explanation = explain_attention(model, **inputs)

    statistics = {"model": str(args.model), "text": texts[0], "tokens": tokens, **explanation.to_dict()}
    if args.file is not None:
        statistics.update(file=str(args.file), texts=len(texts), pairs=int(explanation.valid_pairs.sum()))
        print(
            f"{len(texts)} texts from {args.file}: statistics over {statistics['pairs']:,} token pairs; the heatmaps"
            " show the first text",
            file=sys.stderr if args.json == "-" else sys.stdout,
        )
    to_stdout = args.json == "-"
    report = sys.stderr if to_stdout else sys.stdout
    print(describe(model, explanation, tokens), file=report)
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
            terms_name = FIGURES[0].format(layer=layer, head=args.head)
            plots.plot_terms(explanation.layers[layer], args.head, tokens, args.out / terms_name, layer_index=layer)
            plots.plot_shares(explanation, args.out / FIGURES[1])
            plots.plot_distance_profile(explanation, args.out / FIGURES[2], layer=layer)
            written += [args.out / terms_name, args.out / FIGURES[1], args.out / FIGURES[2]]
    if args.json is not None:
        text = json.dumps(statistics, indent=1)
        if to_stdout:
            print(text)
        else:
            path = Path(args.json) if args.json else args.out / "statistics.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
            written.append(path)
    if written:
        print("\nwrote " + ", ".join(str(path) for path in written), file=report)
    return 0


LEGEND = (
    "mean|s|: mean absolute score; std: its standard deviation; share: Cov(term, total) / Var(total) over valid\n"
    "pairs (the shares add up to 100%); in rows: the same within each query row, the part softmax responds to."
)


def describe(model: torch.nn.Module, explanation: AttentionTerms, tokens: list[str]) -> str:
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
    return (
        f"{type(model).__name__}: {config.num_hidden_layers} layers x {config.num_attention_heads} heads; {terms}; "
        f"scaling {explanation.scaling:.4g}\n"
        f"{len(tokens)} tokens: {' '.join(tokens)}\n"
    )
