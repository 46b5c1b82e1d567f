"""Explaining attention: each term of disentangled attention (c2c, c2p, p2c, p2p), its size, its share of the score
and its profile over distance, computed from a model's own weights; figures of them; `disentangled explain`.

- `terms.py`: the result types (`AttentionTerms`, `LayerTerms`, `LayerSummary`), which the computation fills and the
  figures read;
- `explanation.py`: `explain_attention`, `explain_texts` (over many texts, through `TermSums`), `read_texts`, and the
  `disentangled explain` command (docs/explain.md);
- `plots.py`: the figures (matplotlib, the optional `[plots]` extra).

Exports `explain_attention`, `explain_texts`, `read_texts`, `TermSums` and the result types.
"""

from .explanation import TermSums, explain_attention, explain_texts, read_texts
from .terms import AttentionTerms, LayerSummary, LayerTerms

__all__ = [
    "explain_attention",
    "explain_texts",
    "read_texts",
    "TermSums",
    "AttentionTerms",
    "LayerTerms",
    "LayerSummary",
]
