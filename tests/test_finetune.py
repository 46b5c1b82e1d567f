"""Fine-tuning with transformers' Trainer through examples/finetune.py: it learns, resumes exactly, checkpoints
gradients exactly, runs in bf16 on CPU, and saves a model that loads back with trust_remote_code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpointing import FLAG, NO_OLD_NAMES, enable_checkpointing
from finetune_helpers import fresh_process_check, pretrained_folder, run_finetune, sentiment_files, tagging_files
from tiny_models import export_remote_code, tiny_config, tokenizer
from transformers import AutoTokenizer, Trainer, TrainingArguments

from disentangled import DisentangledForSequenceClassification
from disentangled.integrations.tokenization import make_tokenizer_portable


def losses(log_history: list[dict]) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in log_history if "loss" in entry}


@pytest.mark.slow
def test_text_classification_learns_and_saves_a_remote_code_model(tmp_path):
    train, validation = sentiment_files(tmp_path)
    output = tmp_path / "out"
    results = run_finetune(
        "--model_name_or_path", pretrained_folder(tmp_path / "model"), "--trust_remote_code",
        "--train_file", train, "--validation_file", validation, "--output_dir", output,
        "--do_train", "--do_eval", "--evaluate_before_training",
        "--num_train_epochs", 3, "--learning_rate", 3e-3, "--per_device_train_batch_size", 16,
        "--logging_steps", 8, "--save_strategy", "no", "--seed", 0,
    )  # fmt: skip
    before, after = results["eval_before"]["eval_before_accuracy"], results["eval"]["eval_accuracy"]
    print(f"accuracy before {before:.3f}, after {after:.3f}")
    assert 0.3 <= before <= 0.7  # about chance: the classifier is new
    assert after > 0.9

    config = json.loads((output / "config.json").read_text())
    assert (
        config["id2label"] == {"0": "negative", "1": "positive"}
        and "AutoModelForSequenceClassification" in config["auto_map"]
    )
    loaded = subprocess.run(
        [sys.executable, "-c", fresh_process_check(), str(output)], capture_output=True, text=True, timeout=300
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.strip().splitlines()[-1] == "['positive', 'negative']"


def test_token_classification_trains(tmp_path):
    train, validation = tagging_files(tmp_path)
    results = run_finetune(
        "--model_name_or_path", pretrained_folder(tmp_path / "model"), "--task", "token-classification",
        "--train_file", train, "--validation_file", validation, "--output_dir", tmp_path / "out",
        "--do_train", "--do_eval", "--max_steps", 24, "--learning_rate", 3e-3, "--per_device_train_batch_size", 16,
        "--logging_steps", 4, "--save_strategy", "no", "--seed", 0,
    )  # fmt: skip
    logged = list(losses(results["log_history"]).values())
    assert logged[-1] < logged[0]
    assert results["eval"]["eval_accuracy"] > 0.8  # O is ~80% of the words; B-LOC must be found too
    assert results["eval"]["eval_macro_f1"] > 0.6


def test_resume_from_checkpoint_gives_the_same_losses(tmp_path):
    train, _ = sentiment_files(tmp_path, train=128)
    common = [
        "--model_name_or_path", pretrained_folder(tmp_path / "model", hidden_dropout_prob=0.1),
        "--train_file", train, "--do_train", "--max_steps", 6, "--save_steps", 3, "--logging_steps", 1,
        "--learning_rate", 1e-3, "--per_device_train_batch_size", 8, "--seed", 0,
    ]  # fmt: skip
    full = losses(run_finetune(*common, "--output_dir", tmp_path / "full")["log_history"])
    resumed = run_finetune(
        *common, "--output_dir", tmp_path / "resumed", "--resume_from_checkpoint", tmp_path / "full" / "checkpoint-3"
    )
    resumed_losses = losses(resumed["log_history"])  # steps 1-3 come from the checkpoint's trainer state
    assert sorted(full) == sorted(resumed_losses) == [1, 2, 3, 4, 5, 6]
    assert [resumed_losses[step] for step in (4, 5, 6)] == pytest.approx([full[step] for step in (4, 5, 6)], rel=1e-6)
    # the resumed run trained steps 4-6 only: its mean loss is theirs
    assert resumed["train"]["train_loss"] == pytest.approx(sum(full[step] for step in (4, 5, 6)) / 3, rel=1e-3)


@NO_OLD_NAMES
def test_gradient_checkpointing_bf16_and_accumulation_train_on_cpu(tmp_path):
    train, _ = sentiment_files(tmp_path, train=64)
    results = run_finetune(
        "--model_name_or_path", pretrained_folder(tmp_path / "model"), "--train_file", train,
        "--output_dir", tmp_path / "out", "--do_train", "--max_steps", 3, "--logging_steps", 1,
        "--per_device_train_batch_size", 8, "--save_strategy", "no", FLAG, "--bf16", "--gradient_accumulation_steps", 2,
    )  # fmt: skip
    logged = list(losses(results["log_history"]).values())
    assert len(logged) == 3 and all(torch.isfinite(torch.tensor(loss)) for loss in logged)
    assert abs(logged[0] - 0.693) < 0.05  # ln 2, averaged over the accumulated micro-batches (not summed)


@NO_OLD_NAMES
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    torch.manual_seed(0)
    model = DisentangledForSequenceClassification(tiny_config(tokenizer(), num_labels=3))  # dropout 0
    batch = {
        "input_ids": torch.randint(5, 100, (3, 12)),
        "attention_mask": torch.tensor([[1] * 12, [1] * 9 + [0] * 3, [1] * 5 + [0] * 7]),
        "labels": torch.tensor([0, 2, 1]),
    }

    def gradients():
        model.zero_grad()
        model.train()
        model(**batch).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    reference = gradients()
    enable_checkpointing(model, use_reentrant)
    assert model.deberta.encoder.layer[0].gradient_checkpointing
    checkpointed = gradients()
    assert checkpointed.keys() == reference.keys()
    assert "deberta.encoder.rel_embeddings.weight" in checkpointed  # reaches the relative embeddings too
    for name, grad in reference.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


TEXTS = ["we love this great story", "the movie was [MASK] terrible", "[CLS] [SEP] [PAD] [UNK]"]


def load_in_4_57(folder, tmp_path) -> dict:
    """The folder loaded where transformers 4.57 is installed and the package is not: tokenizer, model, outputs."""
    from isolated import PYTHON_4_57, run_isolated

    if not PYTHON_4_57.exists():
        pytest.skip(f"no transformers 4.57 environment at {PYTHON_4_57} (.ci/run creates it)")
    (tmp_path / "texts.json").write_text(json.dumps(TEXTS))
    child = Path(__file__).with_name("load_saved_folder.py")
    result = run_isolated(PYTHON_4_57, child, [str(folder), str(tmp_path / "texts.json")], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    assert report["transformers"].startswith("4.57."), report["transformers"]
    return report


def test_a_folder_saved_by_finetune_loads_on_transformers_4_57(tmp_path):
    """Model and tokenizer: the same ids and logits on 4.57 (remote code, no package) as here."""
    train, _ = sentiment_files(tmp_path, train=16)
    output = tmp_path / "out"
    run_finetune(
        "--model_name_or_path", pretrained_folder(tmp_path / "model"), "--train_file", train,
        "--output_dir", output, "--do_train", "--max_steps", 1, "--save_strategy", "no",
    )  # fmt: skip
    saved = json.loads((output / "tokenizer_config.json").read_text())
    assert not isinstance(saved.get("extra_special_tokens"), list) and (output / "spm.model").is_file()
    report = load_in_4_57(output, tmp_path)
    here = AutoTokenizer.from_pretrained(output, trust_remote_code=True)
    model = DisentangledForSequenceClassification.from_pretrained(output).eval()
    assert report["ids"] == [here(text)["input_ids"] for text in TEXTS]
    with torch.no_grad():
        logits = model(**here(TEXTS, padding=True, return_tensors="pt")).logits
    torch.testing.assert_close(torch.tensor(report["logits"]), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("portable", [False, True], ids=["as-saved", "made-portable"])
def test_trainer_saved_tokenizer_on_transformers_4_57(tmp_path, portable):
    """`Trainer.save_model` with our tokenizer, as transformers 5 writes it, fails on 4.57 (the check can fail);
    after make_tokenizer_portable it loads there with the same ids."""
    folder = pretrained_folder(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = DisentangledForSequenceClassification(tiny_config(tokenizer, num_labels=2))
    args = TrainingArguments(tmp_path / "trainer", report_to="none", use_cpu=True)
    trainer = Trainer(model=model, args=args, processing_class=tokenizer)
    trainer.save_model(tmp_path / "saved")
    export_remote_code(tmp_path / "saved")
    if not portable:
        saved = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
        if not isinstance(saved.get("extra_special_tokens"), list):
            pytest.skip("this transformers writes no extra_special_tokens list: nothing to show")
        with pytest.raises(AssertionError, match="has no attribute 'keys'"):
            load_in_4_57(tmp_path / "saved", tmp_path)
        return
    make_tokenizer_portable(tmp_path / "saved", tokenizer)
    report = load_in_4_57(tmp_path / "saved", tmp_path)
    assert report["ids"] == [tokenizer(text)["input_ids"] for text in TEXTS]


def test_layerwise_learning_rate_decay_groups_and_trains(tmp_path):
    """--layerwise_lr_decay: the head at the full rate, layer l of L at decay^(L + 1 - l), the embeddings at
    decay^(L + 1); every trainable parameter in exactly one group; the run trains with those rates."""
    from finetune_helpers import finetune_module

    module = finetune_module()
    model = DisentangledForSequenceClassification(tiny_config(tokenizer(), num_labels=2))
    layers = model.config.num_hidden_layers
    groups = module.layerwise_parameter_groups(model, 1e-3, 0.5, 0.01)
    rate_of = {id(p): group["lr"] for group in groups for p in group["params"]}
    assert sum(len(group["params"]) for group in groups) == len(rate_of) == len(list(model.parameters()))
    named = dict(model.named_parameters())
    assert rate_of[id(named["classifier.weight"])] == 1e-3
    assert rate_of[id(named[f"deberta.encoder.layer.{layers - 1}.output.dense.weight"])] == pytest.approx(5e-4)
    assert rate_of[id(named["deberta.encoder.layer.0.output.dense.weight"])] == pytest.approx(1e-3 * 0.5**layers)
    embeddings = named["deberta.embeddings.word_embeddings.weight"]
    assert rate_of[id(embeddings)] == pytest.approx(1e-3 * 0.5 ** (layers + 1))
    assert all(group["weight_decay"] == 0.0 for group in groups if any(p.ndim == 1 for p in group["params"]))
    with pytest.raises(ValueError, match="layerwise_lr_decay"):
        module.layerwise_parameter_groups(model, 1e-3, 1.5, 0.0)

    train, validation = sentiment_files(tmp_path, train=64, validation=16)
    results = run_finetune(
        "--model_name_or_path", pretrained_folder(tmp_path / "model"), "--train_file", train,
        "--validation_file", validation, "--output_dir", tmp_path / "out", "--do_train", "--do_eval",
        "--max_steps", "4", "--learning_rate", "1e-3", "--layerwise_lr_decay", "0.8", "--logging_steps", "1",
    )  # fmt: skip
    assert torch.isfinite(torch.tensor(results["eval"]["eval_loss"]))
