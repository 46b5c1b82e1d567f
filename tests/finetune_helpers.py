"""Running examples/finetune.py from the tests: in this process (`run_finetune`) or as a command line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tiny_models import export_remote_code, save_tiny, tokenizer

from disentangled import DisentangledForMaskedLM
from disentangled.demo.data import sentiment_examples, tagging_examples, write_rows

SCRIPT = Path(__file__).parents[1] / "examples" / "finetune.py"
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "--log_level", "error"]


def finetune_module():
    spec = importlib.util.spec_from_file_location("finetune_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is imported
    spec.loader.exec_module(module)
    return module


def run_finetune(*args: str) -> dict:
    return finetune_module().main([*map(str, args), *QUIET])


def pretrained_folder(folder: Path, **config) -> Path:
    """A tiny DeBERTa-v3-style MLM checkpoint with its tokenizer and bundled remote code: the model to fine-tune."""
    return export_remote_code(save_tiny(folder, DisentangledForMaskedLM, tokenizer(), legacy=False, **config))


def sentiment_files(folder: Path, train: int = 512, validation: int = 128) -> tuple[Path, Path]:
    return (
        write_rows(sentiment_examples(train, seed=1), folder / "train.csv"),
        write_rows(sentiment_examples(validation, seed=2), folder / "validation.csv"),
    )


def tagging_files(folder: Path, train: int = 256, validation: int = 64) -> tuple[Path, Path]:
    return (
        write_rows(tagging_examples(train, seed=1), folder / "train.jsonl"),
        write_rows(tagging_examples(validation, seed=2), folder / "validation.jsonl"),
    )


def fresh_process_check() -> str:
    """Python that loads a saved classifier with trust_remote_code where `disentangled` cannot be imported."""
    return (
        "import sys; sys.modules['disentangled'] = None\n"
        "import torch, transformers\n"
        "folder = sys.argv[1]\n"
        "model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)\n"
        "assert type(model).__module__.startswith('transformers_modules'), type(model).__module__\n"
        "tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)\n"
        "pipe = transformers.pipeline('text-classification', model=model, tokenizer=tok, trust_remote_code=True)\n"
        "print([r['label'] for r in pipe(['we love this great story', 'the movie was terrible'])])\n"
    )
