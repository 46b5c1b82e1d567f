"""Benchmarks: `python -m benchmarks.run` (see README.md, Performance)."""
