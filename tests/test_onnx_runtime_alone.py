"""docs/serving.md's first recipe, as a serving machine runs it: a virtual environment holding only onnxruntime,
tokenizers and numpy (no torch, no package of ours), no C compiler on PATH, the graphs and the operator's library that
`export-onnx --kernel` wrote, each folder's tokenizer.json and config.json. The page's export lines run through the
command, its Python block as printed; the classifier's logits and the reranker's scores are PyTorch's within 1e-5.

The environment is made once (`python -m venv`, then `pip install onnxruntime tokenizers numpy` from the package
index) and kept, git-ignored, in ENVIRONMENT; a broken one is made again."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from parity import inflate_weights
from tiny_models import tokenizer as tiny_tokenizer

import disentangled
from disentangled import cli
from disentangled.serving import ort_operator

REPO = Path(__file__).resolve().parents[1]
ENVIRONMENT = REPO / ".venvonnxruntime"
PACKAGES = ["onnxruntime", "tokenizers", "numpy"]
TOLERANCE = 1e-5
# 64 dimensions per head, as the operator takes
WIDE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=96,
    position_buckets=8,
    max_relative_positions=64,
)

pytestmark = pytest.mark.skipif(
    ort_operator.why_unavailable() is not None, reason=f"no operator library: {ort_operator.why_unavailable()}"
)


def page_block(language: str) -> str:
    page = (REPO / "docs" / "serving.md").read_text()
    mark = r"<!-- covered: tests/test_onnx_runtime_alone.py::test_the_recipe_runs_with_onnx_runtime_alone[^\n]*\n"
    block = re.search(mark + f"```{language}\n(.*?)```", page, re.S)
    assert block, f"the {language} block of docs/serving.md's ONNX Runtime alone section"
    return block[1]


def serving_python() -> Path:
    """ENVIRONMENT's python, made first where it does not import the three packages (in a folder of its own, renamed
    into place, so that two test runs never share a half-made one)."""
    python = ENVIRONMENT / "bin" / "python"
    check = [str(python), "-c", "import onnxruntime, tokenizers, numpy"]
    if python.is_file() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    partial = ENVIRONMENT.with_name(f"{ENVIRONMENT.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(partial)], check=True, capture_output=True)
    installed = subprocess.run(
        [str(partial / "bin" / "python"), "-m", "pip", "install", "-q", *PACKAGES], capture_output=True, text=True
    )
    if installed.returncode:
        shutil.rmtree(partial, ignore_errors=True)
        pytest.skip(f"pip install {' '.join(PACKAGES)} failed here: {installed.stderr[-300:]}")
    shutil.rmtree(ENVIRONMENT, ignore_errors=True)
    try:
        partial.rename(ENVIRONMENT)
    except OSError:  # another run put one in place first
        shutil.rmtree(partial, ignore_errors=True)
    return python


def test_the_recipe_runs_with_onnx_runtime_alone(tmp_path, monkeypatch):
    python = serving_python()
    tokenizer = tiny_tokenizer()
    models = {}
    for name, labels in (("classifier", ["negative", "positive"]), ("reranker", ["score"])):
        config = disentangled.DisentangledConfig(
            **WIDE,
            id2label=dict(enumerate(labels)),
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
        )
        models[name] = disentangled.DisentangledForSequenceClassification(config).eval()
        inflate_weights(models[name], seed=len(labels))  # outputs far from uniform, where a wrong term would show
        models[name].save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    monkeypatch.chdir(tmp_path)
    for line in page_block("bash").strip().splitlines():
        command = shlex.split(line)
        assert command[0] == "disentangled"
        assert cli.main(command[1:]) == 0
    serving = tmp_path / "serving"  # what the serving machine holds: the graphs, the library, two files a folder
    for name in models:
        (serving / name).mkdir(parents=True)
        for file in ("tokenizer.json", "config.json"):
            shutil.copy(tmp_path / name / file, serving / name / file)
        shutil.copy(tmp_path / f"{name}.onnx", serving)
    shutil.copy(tmp_path / ort_operator.library_name(), serving)
    (serving / "recipe.py").write_text(page_block("python"))
    harness = (
        "import importlib.util, json, runpy, shutil, numpy\n"
        "assert importlib.util.find_spec('torch') is None and importlib.util.find_spec('disentangled') is None\n"
        "assert not any(shutil.which(compiler) for compiler in ('cc', 'gcc', 'clang'))\n"
        "page = runpy.run_path('recipe.py')\n"
        "numpy.save('logits.npy', page['logits']); numpy.save('scores.npy', page['scores'])\n"
        "json.dump({name: page[name] for name in ('texts', 'query', 'passages')}, open('inputs.json', 'w'))\n"
    )
    environment = {"PATH": str(python.parent), "HOME": str(tmp_path)}
    ran = subprocess.run(
        [str(python), "-c", harness], cwd=serving, env=environment, capture_output=True, text=True, timeout=300
    )
    print(ran.stdout)
    assert ran.returncode == 0, ran.stderr
    assert "disentangled_attention" not in ran.stderr
    given = json.loads((serving / "inputs.json").read_text())
    texts = given["texts"]
    logits, scores, lines = pytorch_outputs(tokenizer, models, texts, given["query"], given["passages"])
    served_logits, served_scores = np.load(serving / "logits.npy"), np.load(serving / "scores.npy")
    print(f"classifier: {np.abs(served_logits - logits.numpy()).max():.1e}, reranker: "
          f"{np.abs(served_scores - scores.numpy()).max():.1e} (ONNX Runtime alone vs PyTorch, max |diff|)")  # fmt: skip
    np.testing.assert_allclose(served_logits, logits.numpy(), rtol=0, atol=TOLERANCE)
    assert models["classifier"].config.id2label == {0: "negative", 1: "positive"}
    for line in lines[: len(texts)]:  # the classifier's lines (label, probability, text)
        assert line in ran.stdout
    np.testing.assert_allclose(served_scores, scores.numpy(), rtol=0, atol=TOLERANCE)


def pytorch_outputs(tokenizer, models, texts, query, passages) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The PyTorch models' logits and scores on a recipe's texts, and the lines a serving recipe prints: the
    classifier's label, probability and text, then the reranker's score and passage, best first."""
    with torch.no_grad():
        encoded = tokenizer(texts, padding=True, truncation=True, max_length=512, return_tensors="pt")
        logits = models["classifier"](**encoded).logits
        pairs = tokenizer([query] * len(passages), passages, padding=True, truncation=True, return_tensors="pt")
        scores = models["reranker"](**pairs).logits[:, 0]
    labels = models["classifier"].config.id2label
    lines = [
        f"{labels[int(row.argmax())]} {row.max().item():.3f}  {text}" for text, row in zip(texts, logits.softmax(-1))
    ]
    lines += [f"{score:+.3f}  {passage}" for score, passage in sorted(zip(scores.tolist(), passages), reverse=True)]
    return logits, scores, lines
