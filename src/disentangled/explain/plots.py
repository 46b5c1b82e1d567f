"""Figures of the attention terms (matplotlib, the optional `[plots]` extra), drawn from `explain_attention`'s result.

Figures are built with `matplotlib.figure.Figure` and saved directly: no pyplot, no global backend change.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure

from .terms import AttentionTerms, LayerTerms

TERM_COLORS = {"c2c": "#4c72b0", "c2p": "#dd8452", "p2c": "#55a868", "p2p": "#8172b3"}


def plot_terms(
    layer: LayerTerms, head: int, tokens: list[str], path: Path, layer_index: int | None = None, sequence: int = 0
) -> Path:
    """Heatmaps of each term, their sum and the attention probabilities of one head, tokens on both axes.

    The terms and the total share one colour scale, so that their sizes compare at a glance; rows are queries i,
    columns keys j. Only the first len(tokens) positions of `sequence` are drawn.
    """
    length = len(tokens)
    panels = {name: term[sequence, head, :length, :length] for name, term in layer.terms.items()}
    panels["total"] = layer.scores[sequence, head, :length, :length]
    limit = max(panel.abs().max().item() for panel in panels.values()) or 1.0
    probabilities = layer.probabilities[sequence, head, :length, :length]

    columns = len(panels) + 1
    size = min(1.6 + 0.16 * length, 9.0)  # inches per panel; long texts get smaller labels instead
    fontsize = max(2.5, min(7.0, 240 / length))
    figure = Figure(figsize=(size * columns, size + 0.9), layout="constrained")
    axes = figure.subplots(1, columns, squeeze=False)[0]
    for ax, (name, panel) in zip(axes, panels.items()):
        scores = ax.imshow(panel.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit)
        ax.set_title(f"{name}  (std {panel.std(correction=0).item():.2f})", fontsize=10)
    figure.colorbar(scores, ax=axes[:-1], shrink=0.8, label="score (scaled, before softmax)")
    image = axes[-1].imshow(probabilities.numpy(), cmap="Greys", vmin=0, vmax=probabilities.max().item() or 1.0)
    axes[-1].set_title("attention probabilities", fontsize=10)
    figure.colorbar(image, ax=axes[-1], shrink=0.8)
    for ax in axes:
        ax.set_xticks(range(length), tokens, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(length), tokens, fontsize=fontsize)
        ax.set_xlabel("key j", fontsize=8)
    axes[0].set_ylabel("query i", fontsize=8)
    where = f"layer {layer_index}, head {head}" if layer_index is not None else f"head {head}"
    figure.suptitle(f"Attention terms, {where}: score = {' + '.join(layer.terms)}")
    figure.savefig(path, dpi=110)
    return path


def plot_shares(explanation: AttentionTerms, path: Path) -> Path:
    """Per layer, each term's share of the score variance, over all pairs and within query rows."""
    names = explanation.term_names
    layers = range(len(explanation.layers))
    width = 0.8 / len(names)
    figure = Figure(figsize=(max(6.0, 1.2 + 0.5 * len(layers) * len(names)), 3.6), layout="constrained")
    axes = figure.subplots(1, 2, sharey=True)
    for ax, statistic, title in (
        (axes[0], "share", "share of the score variance"),
        (axes[1], "row_share", "share within query rows"),
    ):
        for position, name in enumerate(names):
            values = [layer.statistics[name][statistic] for layer in explanation.layers]
            offsets = [index + (position - (len(names) - 1) / 2) * width for index in layers]
            ax.bar(offsets, values, width, label=name, color=TERM_COLORS[name])
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(list(layers))
        ax.set_xlabel("layer")
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("Cov(term, total) / Var(total)")
    axes[1].legend(fontsize=8)
    figure.savefig(path, dpi=110)
    return path


def plot_distance_profile(explanation: AttentionTerms, path: Path, layer: int | None = None) -> Path:
    """Mean of each position term by relative distance δ(i, j) (c2c alone without them).

    Top row: each layer's mean over its heads. Bottom row (when `layer` is given): that layer's heads one by one,
    where specialisation shows (a head whose c2p peaks at δ = 1 reads the previous token).
    """
    names = [name for name in explanation.term_names if name != "c2c"] or ["c2c"]
    rows = 1 if layer is None else 2
    figure = Figure(figsize=(4.2 * len(names), 3.2 * rows), layout="constrained")
    axes = figure.subplots(rows, len(names), squeeze=False, sharex=True)
    layer_colors, head_colors = colormaps["viridis"], colormaps["tab10"]
    count = len(explanation.layers)
    for column, name in enumerate(names):
        ax = axes[0, column]
        for index, terms in enumerate(explanation.layers):
            color = layer_colors(index / max(count - 1, 1))
            ax.plot(
                terms.distances.numpy(),
                terms.profile[name].mean(0).numpy(),
                marker=".",
                color=color,
                label=f"layer {index}",
            )
        ax.set_title(f"mean {name} by distance, mean of heads", fontsize=10)
        if layer is not None:
            terms = explanation.layers[layer]
            ax = axes[1, column]
            for head, values in enumerate(terms.profile[name]):
                ax.plot(
                    terms.distances.numpy(),
                    values.numpy(),
                    marker=".",
                    color=head_colors(head % 10),
                    label=f"head {head}",
                )
            ax.set_title(f"mean {name} by distance, layer {layer}", fontsize=10)
        for ax in axes[:, column]:
            ax.axhline(0, color="black", linewidth=0.6)
            ax.axvline(0, color="grey", linewidth=0.4)
        axes[-1, column].set_xlabel("relative distance δ(i, j) = i - j" + (" (bucketed)" if name != "c2c" else ""))
    for row in axes:
        row[0].set_ylabel("mean score (scaled)")
        row[-1].legend(fontsize=7, ncol=1 + len(row[-1].get_lines()) // 10)
    if names == ["c2c"]:
        figure.suptitle("no position terms: the content score by distance, for reference", fontsize=10)
    figure.savefig(path, dpi=110)
    return path
