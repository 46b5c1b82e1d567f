"""`disentangled demo` end to end on a cut-down budget: stand-in checkpoint, verified conversion, pipelines and
Trainer in a fresh process through trust_remote_code, the fine-tuned model saved and loaded back."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    command = [sys.executable, "-m", "disentangled.cli", "demo", "--output-dir", str(tmp_path)]
    command += ["--train-size", "64", "--eval-size", "32", "--epochs", "0.5"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "parity (transformers" in out and "from transformers_modules." in out
    assert "`import disentangled` is blocked here" in out
    assert re.search(r"fill-mask .*: '.+' \d\.\d{3}", out) and "hidden states of shape (1, " in out
    before = float(re.search(r"accuracy before fine-tuning: (\d\.\d+)", out)[1])
    assert 0.0 <= before <= 1.0 and re.search(r"accuracy after fine-tuning: +\d\.\d+", out)
    assert re.search(r"demo done in \d+ s", out)
    saved = json.loads((tmp_path / "finetuned" / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForSequenceClassification"].endswith("DisentangledForSequenceClassification")
    assert (tmp_path / "finetuned" / "modeling_disentangled.py").is_file()
