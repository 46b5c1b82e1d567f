"""DeBERTa-v2/v3 tokenizers from a bare SentencePiece model, built the way that works on transformers 4.57 and 5.

On transformers 5, `DebertaV2Tokenizer(vocab_file="spm.model")` ignores the file and builds a vocabulary of
the special tokens alone, in which every word is `[UNK]`. Loading a folder that holds `spm.model` and a
`tokenizer_config.json` naming the class converts the SentencePiece model properly on both versions; this
module does that, then checks that ordinary text gets real pieces and that the special ids are DeBERTa-v3's.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# DeBERTa-v3's SentencePiece model reserves these ids; [MASK] is added after the last piece.
DEBERTA_V3_SPECIAL_IDS = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3}
SPM_TOKENIZER_CONFIG = {"tokenizer_class": "DebertaV2Tokenizer", "do_lower_case": False, "vocab_type": "spm"}


def tokenizer_from_spm(spm_file: str | Path, check_text: str | None = None) -> PreTrainedTokenizerBase:
    """A DeBERTa-v2 tokenizer for `spm_file`; `check_text` (if given) must tokenize without `[UNK]`."""
    spm_file = Path(spm_file)
    if not spm_file.is_file():
        raise FileNotFoundError(f"SentencePiece model not found: {spm_file}")
    with tempfile.TemporaryDirectory() as folder:
        shutil.copyfile(spm_file, Path(folder) / "spm.model")
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps(SPM_TOKENIZER_CONFIG))
        tokenizer = AutoTokenizer.from_pretrained(folder)
    check_tokenizer(tokenizer, check_text)
    return tokenizer


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, check_text: str | None = None) -> None:
    """Raise ValueError when the vocabulary is the special tokens alone, or `check_text` meets `[UNK]`."""
    if len(tokenizer) <= 8:
        raise ValueError(
            f"the tokenizer has only {len(tokenizer)} tokens (its special tokens): the SentencePiece model was not "
            "read; load the folder holding spm.model with AutoTokenizer.from_pretrained instead"
        )
    if check_text:
        ids = tokenizer(check_text, add_special_tokens=False)["input_ids"]
        if tokenizer.unk_token_id in ids:
            raise ValueError(f"ordinary text maps to [UNK] ({ids.count(tokenizer.unk_token_id)} of {len(ids)} pieces)")
