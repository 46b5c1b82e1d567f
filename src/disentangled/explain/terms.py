"""What `explain_attention` returns, in a module of its own so that `explain` (which computes it) and `plots`
(which draws it) both import it and neither imports the other."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

STATISTICS = ("mean_abs", "std", "share", "row_share")


@dataclass
class LayerSummary:
    """One layer's statistics and distance profile: what is left of its terms once they are averaged."""

    statistics: dict[str, dict[str, float]]  # term -> statistic -> value, over all heads' valid pairs
    total: dict[str, float]  # mean_abs and std of the summed score A
    head_statistics: dict[str, dict[str, Tensor]]  # term -> statistic -> [H]
    distances: Tensor  # [K] int64, the relative distances δ(i, j) present among valid pairs, ascending
    profile: dict[str, Tensor]  # term -> [H, K], the mean of the term at each distance

    @property
    def heads(self) -> int:
        return len(next(iter(self.head_statistics.values()))["share"])


@dataclass
class LayerTerms(LayerSummary):
    """One layer's terms, probabilities and statistics (of one batch of texts)."""

    terms: dict[str, Tensor]  # name -> [B, H, L, L] float32, scaled, before the mask
    probabilities: Tensor  # [B, H, L, L] the model's attention probabilities

    @property
    def scores(self) -> Tensor:
        """A = c2c + c2p + p2c [+ p2p]: the pre-softmax scores, [B, H, L, L]."""
        return sum(self.terms.values())


@dataclass
class AttentionTerms:
    """What `explain_attention` returns: one `LayerTerms` per layer, and the pairs the statistics read.

    `explain_texts` returns one too, with a `LayerSummary` per layer (statistics and profiles over every text, no
    terms), `valid_pairs` None, and the number of texts and of (query, key) pairs per head they were read from.
    """

    layers: list[LayerSummary]
    valid_pairs: Tensor | None  # [B, L, L] bool
    term_names: tuple[str, ...]
    relative_attention: bool
    scaling: float
    texts: int | None = None
    pairs: int | None = None  # valid pairs per head, summed over texts (statistics)
    profile_pairs: int | None = None  # the pairs the distance profiles read (fewer without special tokens)

    def to_dict(self) -> dict:
        """The statistics and distance profiles as plain JSON-ready values (NaN becomes None)."""
        layers = []
        for index, layer in enumerate(self.layers):
            heads = [
                {
                    "head": head,
                    "terms": {
                        term: {stat: _number(values[head]) for stat, values in stats.items()}
                        for term, stats in layer.head_statistics.items()
                    },
                }
                for head in range(layer.heads)
            ]
            profile = {"distance": layer.distances.tolist()}
            profile.update({term: [_number(v) for v in by_head.mean(0)] for term, by_head in layer.profile.items()})
            profile["by_head"] = {
                term: [[_number(v) for v in row] for row in by_head] for term, by_head in layer.profile.items()
            }
            layers.append(
                {
                    "layer": index,
                    "terms": {
                        term: {stat: _number(value) for stat, value in stats.items()}
                        for term, stats in layer.statistics.items()
                    },
                    "total": {stat: _number(value) for stat, value in layer.total.items()},
                    "heads": heads,
                    "distance_profile": profile,
                }
            )
        counts = {name: getattr(self, name) for name in ("texts", "pairs", "profile_pairs") if getattr(self, name)}
        return {
            **counts,
            "terms": list(self.term_names),
            "relative_attention": self.relative_attention,
            "scaling": self.scaling,
            "statistics": list(STATISTICS),
            "layers": layers,
        }


def _number(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value
