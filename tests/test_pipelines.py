"""transformers pipelines on our models, loaded through the installed package and, in a fresh process where the
package cannot be imported, as remote code; every result checked against a direct forward pass (pipeline_checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from pipeline_checks import HEADS, PIPELINE_CHECKS, check_answer_span
from spm_fixture import corpus_lines
from tiny_models import export_remote_code, save_tiny, tokenizer

import disentangled
from disentangled import qa
from disentangled.qa import answer_question


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    tok = tokenizer()
    made = {}
    for seed, (name, (class_name, config)) in enumerate(HEADS.items()):
        config = dict(config)
        if "id2label" in config:
            config["label2id"] = {label: index for index, label in config["id2label"].items()}
        made[name] = save_tiny(tmp_path_factory.mktemp(name), getattr(disentangled, class_name), tok, seed, **config)
    return made


@pytest.mark.parametrize("check", PIPELINE_CHECKS, ids=lambda check: check.__name__)
def test_pipeline_through_the_installed_package(folders, check):
    check(folders, trust_remote_code=False)


def test_answer_span_helper(folders):
    check_answer_span(folders, False, answer_question)


@pytest.mark.parametrize("version", ["latest", "4.57"])
def test_pipelines_as_remote_code_without_the_package(folders, version):
    """Every pipeline check in a process where `disentangled` cannot be imported, on this interpreter's transformers
    and on transformers 4.57 (the venv .ci/run makes)."""
    from isolated import PYTHON_4_57, run_isolated, system_python

    if version == "4.57" and not PYTHON_4_57.exists():
        pytest.skip(f"no transformers 4.57 environment at {PYTHON_4_57} (.ci/run creates it)")
    remote = {name: str(export_remote_code(folder)) for name, folder in folders.items()}
    python = PYTHON_4_57 if version == "4.57" else system_python()
    result = run_isolated(python, Path(__file__).with_name("pipeline_checks.py"), [json.dumps(remote), qa.__file__])
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count(": ok") == len(PIPELINE_CHECKS) + 1


class PointsAt(torch.nn.Module):
    """A QA model whose start and end logits peak at one token id, on top of a real model's logits."""

    def __init__(self, model, token_id: int):
        super().__init__()
        self.model, self.token_id, self.device = model, token_id, model.device

    def forward(self, input_ids, **kwargs):
        out = self.model(input_ids=input_ids, **kwargs)
        boost = 20.0 * (input_ids == self.token_id)
        out.start_logits = out.start_logits + boost
        out.end_logits = out.end_logits + boost
        return out


def test_answer_span_in_a_long_context_with_stride(folders):
    model = disentangled.DisentangledForQuestionAnswering.from_pretrained(folders["qa"]).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folders["qa"])
    filler = " ".join(["the lazy dog sat under the tree by the river bank"] * 12)
    context = f"{filler} and the capital city is berlin, {filler}"
    (berlin,) = tok("berlin", add_special_tokens=False)["input_ids"][-1:]
    windows = tok(
        "which city", context, truncation="only_second", max_length=48, stride=16, return_overflowing_tokens=True
    )
    assert len(windows["input_ids"]) > 4  # the answer is far from the first window

    answer = answer_question(PointsAt(model, berlin), tok, "which city", context, max_seq_len=48, doc_stride=16)
    assert answer["answer"] == context[answer["start"] : answer["end"]]
    assert answer["answer"].strip() == "berlin,"  # widened to the whole (whitespace-split) word
    assert answer["start"] >= context.index("berlin") - 1
    assert answer["score"] > 0.9

    # [CLS] is the "no answer" position: when it wins in every window, the empty answer comes first.
    none = answer_question(
        PointsAt(model, tok.cls_token_id),
        tok,
        "which city",
        context,
        max_seq_len=48,
        doc_stride=16,
        top_k=3,
        handle_impossible_answer=True,
    )
    assert none[0]["answer"] == "" and none[0]["score"] > 0.9


def test_answer_question_matches_the_transformers_4_57_pipeline(folders, tmp_path):
    from isolated import PYTHON_4_57, run_isolated

    if not PYTHON_4_57.exists():
        pytest.skip(f"no transformers 4.57 environment at {PYTHON_4_57} (.ci/run creates it)")
    folder = export_remote_code(folders["qa"])
    # No repeated phrases: repeats score alike, and float noise would decide between equal answers.
    long_context = " ".join(corpus_lines(12, seed=3))
    windows = tokenizer()(
        "which city", long_context, truncation="only_second", max_length=48, stride=16, return_overflowing_tokens=True
    )
    assert len(windows["input_ids"]) >= 3
    cases = [
        {"question": "where is the capital of france", "context": "the capital of france is paris.", "kwargs": {}},
        {
            "question": "which city",
            "context": long_context,
            "kwargs": {"max_seq_len": 48, "doc_stride": 16, "top_k": 5},
        },
        {
            "question": "which river",
            "context": long_context,
            "kwargs": {"max_seq_len": 64, "doc_stride": 24, "top_k": 3, "handle_impossible_answer": True},
        },
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = run_isolated(
        PYTHON_4_57, Path(__file__).with_name("qa_pipeline_457.py"), [str(folder), str(tmp_path / "cases.json")]
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    assert report["transformers"].startswith("4.57.")

    model = disentangled.DisentangledForQuestionAnswering.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    for case, expected in zip(cases, report["answers"]):
        ours = answer_question(model, tok, case["question"], case["context"], **case["kwargs"])
        ours = ours if isinstance(ours, list) else [ours]
        assert [(a["start"], a["end"], a["answer"]) for a in ours] == [
            (a["start"], a["end"], a["answer"]) for a in expected
        ]
        assert [a["score"] for a in ours] == pytest.approx([a["score"] for a in expected], rel=1e-4, abs=1e-7)
