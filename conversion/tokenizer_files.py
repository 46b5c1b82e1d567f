"""The source's tokenizer in a converted folder, made self-describing and checked to give the same ids.

The folder's config.json names model_type `disentangled`, which transformers does not know, so the tokenizer
files must name their class themselves: `tokenizer_config.json` gets `tokenizer_class` (DeBERTa-v3 repos on the
Hub ship `spm.model` and a tokenizer_config.json without one).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from disentangled.integrations.tokenization import SPM_TOKENIZER_CONFIG

from .sources import Source

TOKENIZER_CLASSES = {"deberta": "DebertaTokenizer", "deberta-v2": "DebertaV2Tokenizer"}
CHECK_TEXTS = ["Paris is the capital of France.", "The quick brown fox [MASK] over the lazy dog!"]


def copy_tokenizer(source: Source, model_type: str, folder: Path, log=print) -> list[str]:
    """Copy the tokenizer files, name the class in tokenizer_config.json, check ids; returns the files written."""
    names = source.tokenizer_files
    if not names:
        log("no tokenizer files in the source: the folder has none")
        return []
    for name in names:
        shutil.copyfile(source.folder / name, folder / name)
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    tokenizer_config.pop("auto_map", None)  # never point at code from the source
    tokenizer_config.setdefault("tokenizer_class", TOKENIZER_CLASSES[model_type])
    if "spm.model" in names and model_type == "deberta-v2":
        tokenizer_config.setdefault("vocab_type", "spm")
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    check_same_ids(source, model_type, folder)
    return sorted({*names, "tokenizer_config.json"})


def source_tokenizer(source: Source, model_type: str):
    """The source's tokenizer, loaded from a copy of its tokenizer files beside a code-free config.json."""
    with tempfile.TemporaryDirectory() as scratch:
        for name in source.tokenizer_files:
            shutil.copyfile(source.folder / name, Path(scratch) / name)
        (Path(scratch) / "config.json").write_text(json.dumps({"model_type": model_type}))
        config_path = Path(scratch) / "tokenizer_config.json"
        tokenizer_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        tokenizer_config.pop("auto_map", None)
        if "spm.model" in source.tokenizer_files and model_type == "deberta-v2":
            tokenizer_config = {**SPM_TOKENIZER_CONFIG, **tokenizer_config}
        config_path.write_text(json.dumps(tokenizer_config))
        return AutoTokenizer.from_pretrained(scratch)


def check_same_ids(source: Source, model_type: str, folder: Path) -> None:
    from disentangled.integrations.tokenization import check_tokenizer

    expected = source_tokenizer(source, model_type)
    actual = AutoTokenizer.from_pretrained(folder)
    check_tokenizer(actual)
    for text in CHECK_TEXTS:
        if expected(text)["input_ids"] != actual(text)["input_ids"]:
            raise ValueError(f"the converted tokenizer gives other ids than the source's for {text!r}")
