"""What `explain_attention` returns, in a module of its own so that `explain` (which computes it) and `plots`
(which draws it) both import it and neither imports the other."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

STATISTICS = ("mean_abs", "std", "share", "row_share")


@dataclass
class LayerTerms:
    """One layer's terms, probabilities and statistics."""

    terms: dict[str, Tensor]  # name -> [B, H, L, L] float32, scaled, before the mask
    probabilities: Tensor  # [B, H, L, L] the model's attention probabilities
    statistics: dict[str, dict[str, float]]  # term -> statistic -> value, over all heads' valid pairs
    total: dict[str, float]  # mean_abs and std of the summed score A
    head_statistics: dict[str, dict[str, Tensor]]  # term -> statistic -> [H]
    distances: Tensor  # [K] int64, the relative distances δ(i, j) present among valid pairs, ascending
    profile: dict[str, Tensor]  # term -> [H, K], the mean of the term at each distance

    @property
    def scores(self) -> Tensor:
        """A = c2c + c2p + p2c [+ p2p]: the pre-softmax scores, [B, H, L, L]."""
        return sum(self.terms.values())


@dataclass
class AttentionTerms:
    """What `explain_attention` returns: one `LayerTerms` per layer, and the pairs the statistics read."""

    layers: list[LayerTerms]
    valid_pairs: Tensor  # [B, L, L] bool
    term_names: tuple[str, ...]
    relative_attention: bool
    scaling: float

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
                for head in range(layer.probabilities.shape[1])
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
        return {
            "terms": list(self.term_names),
            "relative_attention": self.relative_attention,
            "scaling": self.scaling,
            "statistics": list(STATISTICS),
            "layers": layers,
        }


def _number(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value
