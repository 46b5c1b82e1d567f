"""Pretraining data, as transformers' `run_mlm.py` prepares it: read with `datasets`, tokenize once (cached by
`datasets`), concatenate and cut into full sequences.

Text files hold one document per line, or documents separated by blank lines (a file with a blank line is read by
paragraph); `.csv`, `.json` and `.jsonl` files are read with `datasets` and their `--text-column`. Each sequence is
`[CLS] pieces [SEP]`, `max_seq_length` long; documents inside it are separated by `[SEP]`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

DATA_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json"}
SNIFF_BYTES = 1 << 20


def check_data_files(files: list[str], option: str) -> list[Path]:
    """The files as paths; ValueError for a missing, unreadable or empty file."""
    paths = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"{option} {name}: no such file")
        try:
            with path.open("rb") as handle:
                first = handle.read(SNIFF_BYTES)
        except OSError as error:
            raise ValueError(f"{option} {name}: cannot be read ({error.strerror or error})") from error
        if not first.strip():
            raise ValueError(f"{option} {name} is empty: give a file with text in it")
        try:
            first.decode("utf-8")
        except UnicodeDecodeError as error:
            if error.start < len(first) - 4:  # not just a character cut at the sniffed boundary
                raise ValueError(f"{option} {name} is not UTF-8 text") from error
        paths.append(path)
    if len({DATA_BUILDERS.get(path.suffix.lower(), "text") for path in paths}) > 1:
        raise ValueError(f"{option}: give files of one kind (all text, all .csv or all .json/.jsonl)")
    return paths


def load_texts(paths: list[Path], text_column: str, option: str):
    """A `datasets.Dataset` with one `text` column: one row per document."""
    import datasets

    builder = DATA_BUILDERS.get(paths[0].suffix.lower(), "text")
    files = [str(path) for path in paths]
    try:
        if builder == "text":
            by_paragraph = any(b"\n\n" in path.open("rb").read(SNIFF_BYTES).replace(b"\r\n", b"\n") for path in paths)
            dataset = datasets.load_dataset(
                "text", data_files=files, split="train", sample_by="paragraph" if by_paragraph else "line"
            )
        else:
            dataset = datasets.load_dataset(builder, data_files=files, split="train")
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError) as error:
        raise ValueError(f"{option}: could not read {', '.join(files)} ({error})") from error
    if builder != "text":
        if text_column not in dataset.column_names:
            raise ValueError(
                f"{option}: no column {text_column!r} (columns: {', '.join(dataset.column_names)}); set --text-column"
            )
        dataset = dataset.select_columns([text_column])
        if text_column != "text":
            dataset = dataset.rename_column(text_column, "text")
    dataset = dataset.filter(lambda row: isinstance(row["text"], str) and row["text"].strip() != "", desc="documents")
    if len(dataset) == 0:
        raise ValueError(f"{option} {', '.join(files)}: no text in the file(s)")
    return dataset


class GroupTexts:
    """Tokenize a batch of documents and cut the concatenation into `[CLS] ... [SEP]` sequences of `length` ids;
    the tail of each batch that does not fill a sequence is dropped (as in run_mlm.py)."""

    def __init__(self, tokenizer, length: int):
        self.tokenizer = tokenizer
        self.length = length

    def __call__(self, batch: dict) -> dict:
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        pieces = self.tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        stream = [piece for document in pieces for piece in (*document, sep_id)]
        body = self.length - 2
        sequences = [
            [cls_id, *stream[start : start + body], sep_id] for start in range(0, len(stream) - body + 1, body)
        ]
        return {"input_ids": sequences}


class DocumentSequences:
    """`--line-by-line`: each document its own `[CLS] ... [SEP]` sequence, cut at `length` ids (padded in batches),
    as run_mlm.py's `line_by_line`: short texts (sentences) stay whole and apart."""

    def __init__(self, tokenizer, length: int):
        self.tokenizer = tokenizer
        self.length = length

    def __call__(self, batch: dict) -> dict:
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        pieces = self.tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[cls_id, *document[: self.length - 2], sep_id] for document in pieces if document]}


def tokenize_and_group(
    dataset, tokenizer, max_seq_length: int, num_proc: int | None = None, line_by_line: bool = False
):
    """Tokenized, grouped sequences (cached by `datasets` for file-backed data); one per document with
    `line_by_line`."""
    if tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise ValueError("the tokenizer has no [CLS] / [SEP] tokens; use a DeBERTa tokenizer")
    return dataset.map(
        (DocumentSequences if line_by_line else GroupTexts)(tokenizer, max_seq_length),
        batched=True,
        batch_size=1000,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=f"tokenizing{'' if line_by_line else ' and grouping'} into sequences of {max_seq_length}",
    )


def training_text_lines(dataset, limit: int = 1_000_000) -> list[str]:
    """Up to `limit` lines of the training documents, for training a SentencePiece model."""
    lines = []
    for text in dataset["text"][: max(1, limit)]:
        lines.extend(line for line in text.splitlines() if line.strip())
        if len(lines) >= limit:
            break
    return lines[:limit]


# ----------------------------------------------------------------------------------------------------------------------
# Tokenizers: loaded, or trained, and saved as spm.model + a self-describing tokenizer_config.json


class TokenizerFiles:
    """A tokenizer and, where known, its SentencePiece model; `save` writes what transformers 4.57 and 5 both load."""

    def __init__(self, tokenizer, spm_model: Path | None):
        self.tokenizer = tokenizer
        self.spm_model = spm_model

    def save(self, folder: Path) -> None:
        from ..integrations.tokenization import SPM_TOKENIZER_CONFIG

        if self.spm_model is None:
            self.tokenizer.save_pretrained(folder)
            return
        shutil.copyfile(self.spm_model, Path(folder) / "spm.model")
        config = {**SPM_TOKENIZER_CONFIG, "do_lower_case": bool(getattr(self.tokenizer, "do_lower_case", False))}
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(path: str) -> TokenizerFiles:
    """A tokenizer from a folder (or Hub id) or an `spm.model` file."""
    from transformers import AutoTokenizer

    from ..integrations.tokenization import SPM_TOKENIZER_CONFIG, tokenizer_from_spm

    location = Path(path)
    if location.is_file():
        if location.suffix != ".model":
            raise ValueError(f"--tokenizer {path}: give a tokenizer folder or a SentencePiece .model file")
        return TokenizerFiles(tokenizer_from_spm(location), location)
    if location.is_dir() and (location / "spm.model").is_file():
        config_file = location / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        config.pop("auto_map", None)  # never run code from the folder
        with tempfile.TemporaryDirectory() as scratch:  # name the class where the folder's config does not
            shutil.copyfile(location / "spm.model", Path(scratch) / "spm.model")
            (Path(scratch) / "tokenizer_config.json").write_text(json.dumps({**SPM_TOKENIZER_CONFIG, **config}))
            tokenizer = AutoTokenizer.from_pretrained(scratch)
        return TokenizerFiles(tokenizer, location / "spm.model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"--tokenizer {path}: not a tokenizer folder, spm.model or Hub id ({error})") from error
    spm_file = getattr(tokenizer, "vocab_file", None)
    return TokenizerFiles(tokenizer, Path(spm_file) if spm_file and Path(spm_file).is_file() else None)


def train_tokenizer(lines: list[str], vocab_size: int, folder: Path) -> TokenizerFiles:
    """A unigram SentencePiece model on `lines` with DeBERTa-v3's special ids ([PAD] 0, [CLS] 1, [SEP] 2, [UNK] 3;
    [MASK] after the last piece)."""
    from ..demo.data import train_sentencepiece
    from ..integrations.tokenization import tokenizer_from_spm

    if vocab_size < 16:
        raise ValueError(f"--vocab-size must be at least 16, got {vocab_size}")
    try:
        spm_model = train_sentencepiece(folder, lines, vocab_size=vocab_size)
    except RuntimeError as error:  # SentencePiece: "Vocabulary size too high" on too little text
        raise ValueError(f"--vocab-size {vocab_size}: SentencePiece could not train on this text ({error})") from error
    return TokenizerFiles(tokenizer_from_spm(spm_model), spm_model)
