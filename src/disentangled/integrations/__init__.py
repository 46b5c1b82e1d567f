"""Integrations: our attention and tokenizers where transformers and the libraries built on it make the models.

- `acceleration.py`: `accelerate(model)` swaps our attention into transformers' own DeBERTa models in place (GLiNER,
  sentence-transformers, pipelines), `restore(model)` undoes it, `enable()` / `disable()` for every model built (docs/libraries.md);
- `tokenization.py`: DeBERTa-v2/v3 tokenizers from a bare SentencePiece model that load the same on transformers
  4.57 and 5 (`tokenizer_from_spm`, `make_tokenizer_portable`), used by conversion, pretraining and the demo;
- `sharding.py`: training under FSDP2 and DeepSpeed ZeRO-3 (a wrap policy checked against the tables each module
  reads, whole-model saving from sharded runs; docs/multi-gpu.md).

Exports `accelerate`, `restore`, `enable`, `disable` and `is_accelerated`; the package root exports the first four.
"""

from .acceleration import accelerate, disable, enable, is_accelerated, restore

__all__ = ["accelerate", "restore", "enable", "disable", "is_accelerated"]
