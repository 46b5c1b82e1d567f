"""Studies: quality questions answered by runs over seeds, on generated and real text (`python -m studies.NAME`).

- `pretrain.py`: does pretraining transfer? RTD with GDES, ES and no sharing, and MLM, against no pretraining, each
  fine-tuned on the same tasks (docs/pretraining.md);
- `pretrain_diagnosis.py`: why an RTD run's discriminator does or does not learn, variant by variant;
- `explain_terms.py`: what the attention terms of a pretrained model look like beside an untrained one (docs/explain.md);
- `demo.py`: `disentangled demo` over seeds, as a user runs it.

Speed and memory are measured in `benchmarks/`; the two share its record store (`benchmarks/records.py`, one JSON line
per run in `benchmarks/records/<name>.jsonl`) and its report (`python -m benchmarks.report`), which generates the
manual's tables and figures from both.
"""
