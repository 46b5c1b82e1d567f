"""Inputs for `disentangled pretrain` in the tests: a text file, a tokenizer folder, a tiny config, and the command."""

from __future__ import annotations

import json
from pathlib import Path

from spm_fixture import corpus_lines
from tiny_models import TINY_CONFIG, spm_model

from disentangled import DisentangledConfig
from disentangled.integrations.tokenization import SPM_TOKENIZER_CONFIG

QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "--log_level", "error"]
TINY_V3 = dict(
    TINY_CONFIG, position_buckets=32, legacy=False, pos_att_type="p2c|c2p", share_att_key=True, type_vocab_size=0
)


def text_file(folder: Path, lines: int = 400, seed: int = 0, name: str = "train.txt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("\n".join(corpus_lines(lines, seed=seed)) + "\n")
    return path


def tokenizer_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spm.model").write_bytes(spm_model().read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(SPM_TOKENIZER_CONFIG))
    return folder


def config_file(folder: Path, **overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    DisentangledConfig(**{**TINY_V3, **overrides}).save_pretrained(folder)
    return folder / "config.json"


def pretrain_args(root: Path, output: Path, *extra, steps: int = 4) -> list[str]:
    """Arguments for a tiny run: 32-token sequences, batches of 8, a 1-layer generator."""
    return [
        "pretrain",
        "--train-file", str(text_file(root / "data")),
        "--tokenizer", str(tokenizer_folder(root / "tokenizer")),
        "--config", str(config_file(root / "config")),
        "--max-seq-length", "32",
        "--output-dir", str(output),
        "--max-steps", str(steps),
        "--per-device-train-batch-size", "8",
        "--learning-rate", "3e-3",
        "--seed", "0",
        *QUIET,
        *map(str, extra),
    ]  # fmt: skip


def log_losses(output: Path, key: str = "loss") -> dict[int, float]:
    state = json.loads((output / "trainer_state.json").read_text())
    return {entry["step"]: entry[key] for entry in state["log_history"] if key in entry}
