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


# Checked after saving: ordinary text, the mask token, and every special token the tokenizer knows.
PORTABILITY_TEXTS = ["Paris is the capital of France.", "The quick brown fox [MASK] over the lazy dog!"]


def make_tokenizer_portable(folder: str | Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the tokenizer files `save_pretrained` (or `Trainer.save_model`) wrote to `folder` load on transformers
    4.57 and 5 alike, with the ids `tokenizer` gives; ValueError if they do not.

    transformers 5 writes `extra_special_tokens` as a list, its new name for `additional_special_tokens`, and
    transformers 4.57 reads that key as a dict of named tokens and fails on the list: the list is written back
    under the name both versions read. transformers 5 also saves `tokenizer.json` alone; the SentencePiece model
    the tokenizer was loaded from is copied beside it as `spm.model` (with `vocab_type: spm`), as converted folders
    hold it, so 4.57's SentencePiece class loads the folder too. Folders saved by transformers 4.57 are left as
    they are.
    """
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer_config.json: save the tokenizer there first")
    config = json.loads(config_path.read_text())
    extra = config.get("extra_special_tokens")
    if isinstance(extra, list):
        del config["extra_special_tokens"]
        if extra:
            config["additional_special_tokens"] = extra
    spm_file = getattr(tokenizer, "vocab_file", None)
    if spm_file and Path(spm_file).name == "spm.model" and Path(spm_file).is_file():
        if not (folder / "spm.model").is_file():
            shutil.copyfile(spm_file, folder / "spm.model")
        config.setdefault("vocab_type", "spm")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    reloaded = type(tokenizer).from_pretrained(folder)  # the class itself: config.json may name remote code
    for text in [*PORTABILITY_TEXTS, " ".join(tokenizer.all_special_tokens)]:
        if reloaded(text)["input_ids"] != tokenizer(text)["input_ids"]:
            raise ValueError(f"the tokenizer saved in {folder} gives other ids than the one in memory for {text!r}")
