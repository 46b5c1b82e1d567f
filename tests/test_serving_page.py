"""docs/serving.md's recipes as a reader follows them: the page's export lines make the graphs of a classifier and a
reranker (64 dimensions per head, as the `--kernel` operator takes), then the recipe of the package's session helper
and the PyTorch recipe run as printed, in the folder they name. Both print what the PyTorch models give, and the
session helper's logits and scores are PyTorch's within 1e-5. The first recipe, ONNX Runtime alone, runs in a
virtual environment of its own packages: tests/test_onnx_runtime_alone.py."""

from __future__ import annotations

import re
import shlex

import numpy as np
import pytest
import torch
from parity import inflate_weights
from test_onnx_runtime_alone import REPO, TOLERANCE, WIDE, page_block, pytorch_outputs
from tiny_models import tokenizer as tiny_tokenizer

import disentangled
from disentangled import cli
from disentangled.serving import ort_operator

pytestmark = pytest.mark.skipif(
    ort_operator.why_unavailable() is not None, reason=f"no operator library: {ort_operator.why_unavailable()}"
)


def covered_block(test: str) -> str:
    """The python block of docs/serving.md whose mark names `test` of this file."""
    page = (REPO / "docs" / "serving.md").read_text()
    block = re.search(rf"<!-- covered: tests/test_serving_page.py::{test}\b[^\n]*\n```python\n(.*?)```", page, re.S)
    assert block, f"the block of docs/serving.md covered by {test}"
    return block[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A folder as the page's reader has it: ./classifier and ./reranker (fine-tuned folders with their tokenizer),
    and the graphs and library that the page's export lines write; with the PyTorch models."""
    folder = tmp_path_factory.mktemp("serving")
    tokenizer = tiny_tokenizer()
    models = {}
    for name, labels in (("classifier", ["negative", "positive"]), ("reranker", ["score"])):
        config = disentangled.DisentangledConfig(
            **WIDE, id2label=dict(enumerate(labels)), vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id
        )
        models[name] = disentangled.DisentangledForSequenceClassification(config).eval()
        inflate_weights(models[name], seed=len(labels))  # outputs far from uniform, where a wrong term would show
        models[name].save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        for line in page_block("bash").strip().splitlines():
            assert cli.main(shlex.split(line)[1:]) == 0
    return folder, tokenizer, models


def expected(served, namespace: dict) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The PyTorch models' logits and scores on the recipe's own texts, and the lines every recipe prints."""
    _, tokenizer, models = served
    return pytorch_outputs(tokenizer, models, namespace["texts"], namespace["query"], namespace["passages"])


def run_recipe(test: str, served, monkeypatch, capsys) -> tuple[dict, list[str]]:
    """Run the page's block in the reader's folder, in this process; its namespace and printed lines."""
    monkeypatch.chdir(served[0])
    threads = torch.get_num_threads()
    capsys.readouterr()
    namespace = {}
    try:
        exec(compile(covered_block(test), "docs/serving.md", "exec"), namespace)  # noqa: S102  (the page's own code)
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    print(printed)
    return namespace, printed.splitlines()


def test_the_session_helper_recipe(served, monkeypatch, capsys):
    namespace, printed = run_recipe("test_the_session_helper_recipe", served, monkeypatch, capsys)
    assert ort_operator.needs_operator(served[0] / "classifier.onnx")  # the --kernel graph, with our operator
    logits, scores, lines = expected(served, namespace)
    np.testing.assert_allclose(namespace["logits"], logits.numpy(), rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(namespace["scores"], scores.numpy(), rtol=0, atol=TOLERANCE)
    assert printed == lines


def test_the_pytorch_recipe(served, monkeypatch, capsys):
    namespace, printed = run_recipe("test_the_pytorch_recipe", served, monkeypatch, capsys)
    logits, scores, lines = expected(served, namespace)
    torch.testing.assert_close(namespace["logits"], logits, rtol=0, atol=TOLERANCE)
    assert printed == lines
