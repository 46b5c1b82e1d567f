"""Conversion of DeBERTa checkpoints (transformers' v1/v2 formats, Microsoft's originals) to this architecture."""
