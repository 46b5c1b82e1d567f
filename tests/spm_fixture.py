"""Small SentencePiece tokenizers trained at test time, laid out as DeBERTa-v3 ships them on the Hub.

`microsoft/deberta-v3-base` holds `spm.model` and a `tokenizer_config.json` but no `tokenizer.json`;
`write_deberta_v3_tokenizer_files` writes the same two files for a model trained on text written here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from disentangled.demo.data import train_sentencepiece

WORDS = (
    "the a an cat dog bird sat ran flew on under over mat rug tree quick brown lazy fox river bank money market "
    "stock bond paris france berlin germany rome italy capital city is was of and in to good bad great terrible "
    "movie film book story happy sad love hate what where who when which question answer"
).split()
SPM_VOCAB_SIZE = 150


def corpus_lines(count: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "." for _ in range(count)]


def train_spm(directory: Path, vocab_size: int = SPM_VOCAB_SIZE) -> Path:
    """Train a unigram model with DeBERTa-v3's reserved ids ([PAD] 0, [CLS] 1, [SEP] 2, [UNK] 3)."""
    return train_sentencepiece(directory, corpus_lines(), vocab_size=vocab_size)


def write_deberta_v3_tokenizer_files(folder: Path, spm_model: Path | None = None) -> Path:
    """spm.model + tokenizer_config.json in `folder`, as on the Hub; returns the spm.model path."""
    folder.mkdir(parents=True, exist_ok=True)
    if spm_model is None:
        spm_model = train_spm(folder / "_spm")
    target = folder / "spm.model"
    target.write_bytes(spm_model.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False, "vocab_type": "spm"}))
    return target
