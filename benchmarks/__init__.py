"""Benchmarks of speed and memory: `python -m benchmarks.run` (see README.md, Performance); the records of every run
and the report that turns them into pages. Quality studies are in `studies/`, which records and reports through here."""
