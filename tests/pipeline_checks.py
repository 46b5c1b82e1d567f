"""Pipeline checks shared by the in-package test and the remote-code run, where `disentangled` cannot be imported.

Each check takes the saved folders (one per head, see `HEADS`) and whether to load them as remote code, runs a
transformers pipeline and compares its result with a direct forward pass of the same model. Run as a script
(`python pipeline_checks.py FOLDERS_JSON QA_HELPER_FILE`), it blocks `import disentangled` first and runs them all
with `trust_remote_code=True`, as a user without the package would.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

NLI_LABELS = {0: "entailment", 1: "neutral", 2: "contradiction"}
NER_LABELS = {0: "O", 1: "B-LOC", 2: "I-LOC", 3: "B-PER", 4: "I-PER"}
# name -> (our class, config overrides)
HEADS = {
    "mlm": ("DisentangledForMaskedLM", {"legacy": False}),
    "single": ("DisentangledForSequenceClassification", {"id2label": {0: "bad", 1: "good"}}),
    "multi": (
        "DisentangledForSequenceClassification",
        {"id2label": {0: "city", 1: "animal", 2: "money"}, "problem_type": "multi_label_classification"},
    ),
    "nli": ("DisentangledForSequenceClassification", {"id2label": NLI_LABELS}),
    "ner": ("DisentangledForTokenClassification", {"id2label": NER_LABELS}),
    "base": ("DisentangledModel", {}),
    "qa": ("DisentangledForQuestionAnswering", {}),
}


def make_pipeline(task: str, folder: Path, trust_remote_code: bool):
    pipe = transformers.pipeline(task, model=str(folder), trust_remote_code=trust_remote_code)
    module = type(pipe.model).__module__
    assert module.startswith("transformers_modules" if trust_remote_code else "disentangled"), module
    return pipe


def forward(pipe, *texts):
    encoded = pipe.tokenizer(*texts, return_tensors="pt")
    with torch.no_grad():
        return encoded, pipe.model(**encoded)


def check_fill_mask(folders, trust_remote_code):
    pipe = make_pipeline("fill-mask", folders["mlm"], trust_remote_code)
    text = f"the cat sat on the {pipe.tokenizer.mask_token}."
    results = pipe(text, top_k=3)
    encoded, out = forward(pipe, text)
    probs = out.logits[0, encoded["input_ids"][0] == pipe.tokenizer.mask_token_id][0].softmax(-1)
    assert [r["token"] for r in results] == probs.topk(3).indices.tolist()  # top token = argmax at the mask
    assert results[0]["score"] == pytest.approx(probs.max().item(), rel=1e-4)
    assert all(pipe.tokenizer.mask_token not in r["sequence"] for r in results)


def check_text_classification(folders, trust_remote_code):
    pipe = make_pipeline("text-classification", folders["single"], trust_remote_code)
    text, pair = "a great movie", "the story was terrible"
    _, out = forward(pipe, text)
    probs = out.logits[0].softmax(-1).tolist()
    assert {r["label"]: r["score"] for r in pipe(text, top_k=None)} == pytest.approx(dict(zip(["bad", "good"], probs)))

    _, out = forward(pipe, text, pair)  # a text pair: [CLS] text [SEP] pair [SEP]
    best = pipe({"text": text, "text_pair": pair})
    assert best["label"] == ["bad", "good"][out.logits[0].argmax().item()]
    assert best["score"] == pytest.approx(out.logits[0].softmax(-1).max().item(), rel=1e-5)


def check_multi_label(folders, trust_remote_code):
    pipe = make_pipeline("text-classification", folders["multi"], trust_remote_code)
    text = "the dog ran to the bank in paris"
    _, out = forward(pipe, text)
    expected = dict(zip(["city", "animal", "money"], out.logits[0].sigmoid().tolist()))  # independent labels
    result = pipe(text, top_k=None)
    assert {r["label"]: r["score"] for r in result} == pytest.approx(expected, rel=1e-5)
    assert [r["score"] for r in result] == sorted(expected.values(), reverse=True)


def check_token_classification(folders, trust_remote_code):
    pipe = make_pipeline("token-classification", folders["ner"], trust_remote_code)
    text = "the quick brown fox ran under the tree in berlin"
    encoded, out = forward(pipe, text)
    probs = out.logits[0].softmax(-1)
    tokens = pipe(text, ignore_labels=[])  # every token, none aggregated
    assert len(tokens) == encoded["input_ids"].shape[1] - 2  # all but [CLS] and [SEP]
    for entity in tokens:
        assert entity["entity"] == NER_LABELS[probs[entity["index"]].argmax().item()]
        assert entity["score"] == pytest.approx(probs[entity["index"]].max().item(), rel=1e-4)
        assert text[entity["start"] : entity["end"]].strip() == entity["word"].lstrip("▁")

    groups = pipe(text, aggregation_strategy="simple", ignore_labels=[])
    assert groups and all({"entity_group", "score", "word", "start", "end"} <= g.keys() for g in groups)
    assert [g["start"] for g in groups] == sorted(g["start"] for g in groups)
    assert " ".join(g["word"].strip() for g in groups).split() == text.split()  # the groups cover the text
    for group in groups:
        assert group["entity_group"] in {"O", "LOC", "PER"}
        assert text[group["start"] : group["end"]].strip() == group["word"].strip()


def check_zero_shot(folders, trust_remote_code):
    pipe = make_pipeline("zero-shot-classification", folders["nli"], trust_remote_code)
    text, labels = "the stock market fell in berlin", ["money", "animal", "city"]
    result = pipe(text, candidate_labels=labels, hypothesis_template="this is about {}.")
    entailment = torch.stack([forward(pipe, text, f"this is about {label}.")[1].logits[0, 0] for label in labels])
    expected = dict(zip(labels, entailment.softmax(-1).tolist()))  # softmax over the labels' entailment logits
    assert dict(zip(result["labels"], result["scores"])) == pytest.approx(expected, rel=1e-4)
    assert result["scores"] == sorted(result["scores"], reverse=True)

    multi = pipe(text, candidate_labels=labels, multi_label=True)  # entailment vs contradiction, per label
    for label, score in zip(multi["labels"], multi["scores"]):
        logits = forward(pipe, text, f"This example is {label}.")[1].logits[0]
        assert score == pytest.approx(logits[[2, 0]].softmax(-1)[1].item(), rel=1e-4)


def check_feature_extraction(folders, trust_remote_code):
    pipe = make_pipeline("feature-extraction", folders["base"], trust_remote_code)
    text = "where is the capital of france"
    _, out = forward(pipe, text)
    torch.testing.assert_close(pipe(text, return_tensors=True), out.last_hidden_state, rtol=1e-5, atol=1e-5)


def best_span(model, tok, question: str, context: str, max_answer_len: int = 15) -> tuple[float, int, int]:
    """The pipeline's best span, written out directly for a context that fits in one window."""
    encoded = tok(question, context, return_offsets_mapping=True, return_tensors="pt")
    offsets = encoded.pop("offset_mapping")[0]
    with torch.no_grad():
        out = model(**encoded)
    in_context = torch.tensor([index == 1 for index in encoded.sequence_ids(0)])
    keep = in_context.clone()
    keep[0] = True  # [CLS] takes part in the softmax, then is excluded
    start = out.start_logits[0].masked_fill(~keep, -10000.0).softmax(-1)
    end = out.end_logits[0].masked_fill(~keep, -10000.0).softmax(-1)
    score, s, e = max(
        (start[s].item() * end[e].item(), s, e)
        for s in range(len(keep))
        for e in range(s, min(s + max_answer_len, len(keep)))
        if in_context[s] and in_context[e]
    )
    return score, offsets[s][0].item(), offsets[e][1].item()


def check_answer_span(folders, trust_remote_code, answer_question):
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(
        folders["qa"], trust_remote_code=trust_remote_code
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folders["qa"], trust_remote_code=trust_remote_code)
    question, context = "where is the capital of france", "the capital of france is paris and the city is on a river"
    score, start, end = best_span(model, tok, question, context)
    answer = answer_question(model, tok, question, context, align_to_words=False)
    assert (answer["start"], answer["end"], answer["answer"]) == (start, end, context[start:end])
    assert answer["score"] == pytest.approx(score, rel=1e-4)

    ranked = answer_question(model, tok, question, context, top_k=3)
    assert len(ranked) == 3 and [a["score"] for a in ranked] == sorted((a["score"] for a in ranked), reverse=True)
    assert all(context[a["start"] : a["end"]] == a["answer"] for a in ranked)


PIPELINE_CHECKS = [
    check_fill_mask,
    check_text_classification,
    check_multi_label,
    check_token_classification,
    check_zero_shot,
    check_feature_extraction,
]


def main(folders_json: str, qa_helper_file: str) -> None:
    sys.modules["disentangled"] = None  # as on a machine without the package: `import disentangled` fails
    folders = {name: Path(path) for name, path in json.loads(folders_json).items()}
    spec = importlib.util.spec_from_file_location("qa_helper", qa_helper_file)
    qa_helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qa_helper)
    for check in PIPELINE_CHECKS:
        check(folders, trust_remote_code=True)
        print(f"{check.__name__}: ok")
    check_answer_span(folders, True, qa_helper.answer_question)
    print("check_answer_span: ok")


if __name__ == "__main__":
    main(*sys.argv[1:])
