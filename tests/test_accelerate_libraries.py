"""`disentangled.accelerate` and `enable()` under the libraries that build transformers' DeBERTa themselves.

Small DeBERTa-v3 and v1 checkpoints (accelerate_checkpoints.py: transformers' own classes, seeded inflated weights, a
tokenizer trained at test time) go through GLiNER, GLiNER2, a sentence-transformers CrossEncoder, the
zero-shot-classification and token-classification pipelines and a `Trainer` step. Each library's result with the
model accelerated is compared with its result unaccelerated, on the same inputs (padded batches included): the same
spans, labels and order, scores within float32 tolerance. The same again for a model built the library's usual way
under `disentangled.enable()` (asserted accelerated), and after `disable()` (asserted plain). Last, a folder saved
from an accelerated model loads in plain transformers where the package cannot be imported.

GLiNER pins transformers < 5.17: it runs in the transformers 4.57 environment .ci/run makes (.venv457, with gliner;
tests/isolated.py), as a child process (gliner_accelerate_457.py), which also runs accelerate on transformers 4.57.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import numbers
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from accelerate_checkpoints import NER_LABELS, NLI_LABELS, save_checkpoint
from isolated import PYTHON_4_57, run_isolated, system_python
from parity import inflate_weights
from safetensors.torch import load_file

import disentangled
from disentangled.integrations.acceleration import is_accelerated

HERE = Path(__file__).resolve().parent
IN_CI = bool(os.environ.get("CI"))  # .ci/run installs every library and environment used here: missing one fails
SCORE_RTOL = 1e-5  # float32: a score differs from the unaccelerated one by at most 1e-5 of itself

TEXT = "the quick brown fox ran under the tree in berlin and paris is the capital of france"
BATCH = [TEXT, "the dog sat on the mat", "where is the capital of italy? rome is the capital of italy"]
ENTITY_LABELS = ["city", "animal", "country"]
PAIRS = [
    ("where is the capital of france", "paris is the capital of france and the city is on a river"),
    ("where is the capital of france", "the dog sat on the mat"),
    ("which river", "the city is on a river"),
]


def unavailable(reason: str) -> None:
    """Skip here; in CI, where .ci/run provides everything, fail."""
    (pytest.fail if IN_CI else pytest.skip)(reason)


def library(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        unavailable(f"{name} is not installed (the dev extra installs it)")


@contextlib.contextmanager
def enabled():
    disentangled.enable()
    try:
        yield
    finally:
        disentangled.disable()


def assert_same(plain, other, where: str = "result") -> None:
    """The same structure, keys, strings, integers and order; floats within SCORE_RTOL of the plain ones."""
    if isinstance(plain, dict):
        assert isinstance(other, dict) and plain.keys() == other.keys(), f"{where}: {plain!r} != {other!r}"
        for key in plain:
            assert_same(plain[key], other[key], f"{where}[{key!r}]")
    elif isinstance(plain, (list, tuple)):
        assert len(plain) == len(other), f"{where}: {len(plain)} items, {len(other)} accelerated"
        for index, (a, b) in enumerate(zip(plain, other)):
            assert_same(a, b, f"{where}[{index}]")
    elif isinstance(plain, numbers.Real) and not isinstance(plain, numbers.Integral):  # numpy's floats too
        assert float(other) == pytest.approx(float(plain), rel=SCORE_RTOL, abs=1e-7), where
    else:
        assert plain == other, f"{where}: {plain!r} != {other!r}"


def check_four_ways(build, run, module=lambda built: built):
    """`run(built)` for what `build()` makes (a model, a CrossEncoder, a pipeline; `module(built)`: its torch module):
    plain, then accelerated in place, then built under enable(), then built after disable(); each against the plain
    result. Returns the plain result."""
    built = build()
    assert not is_accelerated(module(built))
    plain = run(built)
    disentangled.accelerate(module(built))
    assert is_accelerated(module(built))
    assert_same(plain, run(built), "accelerate(model)")
    with enabled():
        built = build()
        assert is_accelerated(module(built)), "a model built under enable() is not accelerated"
        assert_same(plain, run(built), "built under enable()")
    built = build()
    assert not is_accelerated(module(built)), "a model built after disable() is accelerated"
    assert_same(plain, run(built), "built after disable()")
    return plain


def inflate_heads(model: torch.nn.Module, backbone: torch.nn.Module, seed: int = 1) -> None:
    """Inflate a library's own layers (not the backbone's checkpoint weights), so that its scores spread."""
    inside = {id(p) for p in backbone.parameters()}
    heads = torch.nn.Module()
    for name, param in model.named_parameters():
        if id(param) not in inside:
            heads.register_parameter(name.replace(".", "__"), param)
    inflate_weights(heads, seed)


def labels(id2label: dict[int, str]) -> dict:
    return {"id2label": id2label, "label2id": {label: index for index, label in id2label.items()}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    def make(name: str, class_name: str, seed: int, **config) -> Path:
        return save_checkpoint(tmp_path_factory.mktemp(name), class_name, seed=seed, **config)

    return {
        "backbone": make("backbone", "DebertaV2Model", 0),
        "reranker": make("reranker", "DebertaV2ForSequenceClassification", 1, num_labels=1),
        "nli": make("nli", "DebertaV2ForSequenceClassification", 2, **labels(NLI_LABELS)),
        "ner": make("ner", "DebertaV2ForTokenClassification", 3, **labels(NER_LABELS)),
        "v1": make("v1", "DebertaForSequenceClassification", 4, **labels(NLI_LABELS)),
    }


# ---------------------------------------------------------------------------------------------------------------
# GLiNER (transformers 4.57) and GLiNER2


def test_gliner_entities_accelerated_or_not(folders, tmp_path):
    if not PYTHON_4_57.exists():
        unavailable(f"no transformers 4.57 environment at {PYTHON_4_57} (.ci/run creates it)")
    result = subprocess.run(
        [str(PYTHON_4_57), str(HERE / "gliner_accelerate_457.py"), str(folders["backbone"]), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    if "No module named 'gliner'" in result.stderr:
        unavailable(f"gliner is not installed in {PYTHON_4_57} (.ci/run installs gliner==0.2.29 there)")
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    assert report["transformers"].startswith("4.57."), report["transformers"]
    results = report["results"]
    assert {name: r["accelerated"] for name, r in results.items()} == {
        "plain": False,
        "accelerate": True,
        "enabled": True,
        "disabled": False,
    }
    plain = results["plain"]
    assert len({e["score"] for e in plain["text"]}) > 3 and all(plain["batch"]), plain  # spans with spread scores
    for name in ("accelerate", "enabled", "disabled"):
        assert_same(plain["text"], results[name]["text"], f"{name}: predict_entities")
        assert_same(plain["batch"], results[name]["batch"], f"{name}: padded batch")


def test_gliner2_entities_accelerated_or_not(folders, tmp_path):
    library("gliner2")
    from gliner2 import ExtractorConfig, GLiNER2

    torch.manual_seed(0)
    built = GLiNER2(ExtractorConfig(model_name=str(folders["backbone"]), max_width=4))
    assert type(built.encoder) is transformers.DebertaV2Model, type(built.encoder)
    inflate_heads(built, built.encoder)
    built.save_pretrained(tmp_path / "gliner2")
    options = dict(threshold=0.0, include_confidence=True, include_spans=True)

    def run(model) -> dict:
        return {
            "text": model.extract_entities(TEXT, ENTITY_LABELS, **options),
            "batch": model.batch_extract_entities(BATCH, ENTITY_LABELS, batch_size=len(BATCH), **options),
        }

    plain = check_four_ways(lambda: GLiNER2.from_pretrained(str(tmp_path / "gliner2")), run)
    spans = plain["text"]["entities"]["city"]
    assert len({span["confidence"] for span in spans}) > 3, spans


# ---------------------------------------------------------------------------------------------------------------
# sentence-transformers and transformers' pipelines


def test_cross_encoder_scores_and_ranking(folders):
    library("sentence_transformers")
    from sentence_transformers import CrossEncoder

    def build():
        encoder = CrossEncoder(str(folders["reranker"]), device="cpu")
        assert type(encoder.model) is transformers.DebertaV2ForSequenceClassification
        return encoder

    def run(encoder) -> dict:
        query, passages = PAIRS[0][0], [passage for _, passage in PAIRS]
        return {"scores": encoder.predict(PAIRS).tolist(), "ranked": encoder.rank(query, passages)}

    plain = check_four_ways(build, run, module=lambda encoder: encoder.model)
    assert len(set(plain["scores"])) == len(PAIRS), plain


@pytest.mark.parametrize("multi_label", [False, True])
def test_zero_shot_classification_pipeline(folders, multi_label):
    def build():
        return transformers.pipeline("zero-shot-classification", model=str(folders["nli"]), device="cpu")

    def run(pipe) -> list:
        # all hypotheses of a text in one padded batch
        return pipe(BATCH, candidate_labels=ENTITY_LABELS, multi_label=multi_label, batch_size=len(ENTITY_LABELS))

    plain = check_four_ways(build, run, module=lambda pipe: pipe.model)
    assert len({round(s, 6) for s in plain[0]["scores"]}) == len(ENTITY_LABELS), plain


@pytest.mark.parametrize("aggregation_strategy", ["none", "simple"])
def test_token_classification_pipeline(folders, aggregation_strategy):
    def build():
        return transformers.pipeline("token-classification", model=str(folders["ner"]), device="cpu")

    def run(pipe) -> list:
        return pipe(BATCH, aggregation_strategy=aggregation_strategy, ignore_labels=[], batch_size=len(BATCH))

    plain = check_four_ways(build, run, module=lambda pipe: pipe.model)
    assert {e["entity" if aggregation_strategy == "none" else "entity_group"] for e in plain[0]} != {"O"}, plain


# ---------------------------------------------------------------------------------------------------------------
# Trainer


class GradientCapture(transformers.TrainerCallback):
    """Every parameter's gradient just before the optimizer step (after clipping, which is off here)."""

    def __init__(self):
        self.gradients: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def trainer_step(folder: Path, accelerate: bool, output_dir: Path, checkpointing: bool) -> tuple[dict, dict, float]:
    """One SGD step of `Trainer` on a padded batch of 4: gradients, updated parameters, loss."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    if accelerate:
        disentangled.accelerate(model)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = BATCH + ["a great movie about the river bank in rome"]
    data = [{**tok(text), "labels": index % 3} for index, text in enumerate(texts)]
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=1,
        per_device_train_batch_size=len(data),
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        activation_checkpointing=checkpointing,  # transformers 5's name for gradient checkpointing
    )
    capture = GradientCapture()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[capture]
    )
    loss = trainer.train().training_loss
    assert is_accelerated(model) == accelerate and model.is_activation_checkpointing == checkpointing
    return capture.gradients, {name: p.detach().clone() for name, p in model.named_parameters()}, loss


@pytest.mark.parametrize(("name", "checkpointing"), [("nli", False), ("v1", False), ("nli", True)])
def test_trainer_step_gradients(folders, tmp_path, name, checkpointing):
    """v3 and v1 (v3 with activation checkpointing too): the same loss, every parameter's gradient within 1e-4 of its
    scale, the same updated weights."""
    plain_grads, plain_after, plain_loss = trainer_step(folders[name], False, tmp_path / "plain", checkpointing)
    grads, after, loss = trainer_step(folders[name], True, tmp_path / "accelerated", checkpointing)
    assert loss == pytest.approx(plain_loss, rel=SCORE_RTOL)
    assert grads.keys() == plain_grads.keys() and len(grads) == len(after)
    overall = max(g.abs().max().item() for g in plain_grads.values())
    problems = []
    for param, reference in plain_grads.items():
        scale = max(reference.abs().max().item(), 1e-3 * overall)  # a gradient that is 0 in exact arithmetic: noise
        error = (grads[param] - reference).abs().max().item()
        if error > 1e-4 * scale:
            problems.append(f"{param}: max error {error:.3g} vs scale {scale:.3g}")
    assert not problems, "\n".join(problems)
    relative = "encoder.rel_embeddings.weight"  # the relative-position path is trained too
    assert any(param.endswith(relative) and plain_grads[param].abs().max() > 0 for param in plain_grads)
    for param, value in plain_after.items():
        torch.testing.assert_close(after[param], value, rtol=1e-5, atol=1e-6, msg=param)


# ---------------------------------------------------------------------------------------------------------------
# The saved folder


def test_saved_folder_loads_in_plain_transformers(folders, tmp_path):
    """save_pretrained of an accelerated model (v3 and v1) writes transformers' own format: config.json without
    auto_map, the same tensors under the same names; plain transformers, without the package, gives the original's
    outputs."""
    cases, expected = [], {}
    for name in ("nli", "v1"):
        folder, saved = folders[name], tmp_path / name
        original = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
        model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
        disentangled.accelerate(model).save_pretrained(saved)

        config = json.loads((saved / "config.json").read_text())
        assert config["model_type"] == ("deberta" if name == "v1" else "deberta-v2")
        assert "auto_map" not in config and config["architectures"] == [type(original).__name__]
        tensors, reference_tensors = load_file(saved / "model.safetensors"), load_file(folder / "model.safetensors")
        assert tensors.keys() == reference_tensors.keys()
        for key, tensor in reference_tensors.items():
            assert torch.equal(tensors[key], tensor), key

        batch = transformers.AutoTokenizer.from_pretrained(folder)(BATCH, padding=True, return_tensors="pt")
        with torch.no_grad():
            reference, accelerated = (m(**batch, output_hidden_states=True) for m in (original, model))
        expected[name] = (type(original).__name__, batch, reference, accelerated)
        cases.append({"folder": str(saved), **{key: value.tolist() for key, value in batch.items()}})

    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = run_isolated(system_python(), HERE / "accelerated_folder_child.py", [str(tmp_path / "cases.json")])
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    assert report["transformers"] == transformers.__version__
    for (name, (class_name, batch, reference, accelerated)), loaded in zip(expected.items(), report["outputs"]):
        assert loaded["class"] == class_name and loaded["module"].startswith("transformers.models.deberta"), loaded
        real = batch["attention_mask"].bool()  # padded positions differ by design (see acceleration.py)
        hidden, logits = torch.tensor(loaded["last_hidden_state"]), torch.tensor(loaded["logits"])
        torch.testing.assert_close(logits, reference.logits, rtol=0, atol=0, msg=name)  # the same weights
        torch.testing.assert_close(hidden[real], reference.hidden_states[-1][real], rtol=0, atol=0, msg=name)
        scale = hidden[real].abs().max().item()
        torch.testing.assert_close(accelerated.hidden_states[-1][real], hidden[real], rtol=0, atol=1e-5 * scale)
        torch.testing.assert_close(accelerated.logits, logits, rtol=1e-5, atol=1e-6, msg=name)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
