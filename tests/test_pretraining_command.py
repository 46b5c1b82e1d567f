"""`disentangled pretrain` end to end on tiny models: the losses fall, a resumed run repeats the uninterrupted one,
continued pretraining starts from a converted checkpoint, the saved folders load where the package is absent and
fine-tune with examples/finetune.py, and bad input fails before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from finetune_helpers import run_finetune, sentiment_files
from isolated import PYTHON_4_57, run_isolated, system_python
from pretraining_helpers import QUIET, config_file, log_losses, pretrain_args, text_file
from safetensors.torch import load_file

from disentangled.cli import main

STEPS = 24
CHECK_TEXT = "the quick brown fox sat on the mat"


@pytest.fixture(scope="module")
def rtd_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rtd")
    output = root / "out"
    assert main(pretrain_args(root, output, "--logging-steps", "4", "--generator-layers", "1", steps=STEPS)) == 0
    return output


def test_rtd_losses_fall_and_metrics_are_logged(rtd_run):
    state = json.loads((rtd_run / "trainer_state.json").read_text())
    logs = [entry for entry in state["log_history"] if "loss" in entry]
    assert state["global_step"] == STEPS and len(logs) == STEPS // 4
    for key in ("generator_loss", "discriminator_loss", "discriminator_auc", "discriminator_precision",
                "discriminator_recall", "generator_accuracy"):  # fmt: skip
        assert all(key in entry for entry in logs), key
    first, last = logs[0], logs[-1]
    print({key: (first[key], last[key]) for key in ("loss", "generator_loss", "discriminator_loss")})
    assert last["loss"] < first["loss"] - 0.5
    assert last["generator_loss"] < first["generator_loss"]
    assert last["discriminator_loss"] < first["discriminator_loss"]
    for entry in logs:  # the total is L_MLM + 10 L_RTD of the same steps
        assert entry["loss"] == pytest.approx(entry["generator_loss"] + 10 * entry["discriminator_loss"], rel=2e-3)


def test_mlm_loss_falls_with_whole_word_masking(tmp_path):
    output = tmp_path / "out"
    validation = text_file(tmp_path / "data", lines=60, seed=1, name="validation.txt")
    args = pretrain_args(
        tmp_path, output, "--objective", "mlm", "--whole-word-mask", "--enhanced-mask-decoder", "--logging-steps", "4",
        "--validation-file", validation, "--do-eval", "--activation-checkpointing", steps=STEPS,
    )  # fmt: skip
    assert main(args) == 0
    losses = log_losses(output)
    assert list(losses.values())[-1] < list(losses.values())[0] - 0.2
    assert "masked_accuracy" in json.loads((output / "trainer_state.json").read_text())["log_history"][0]
    evaluation = json.loads((output / "eval_results.json").read_text())
    assert evaluation["eval_mlm_loss"] == pytest.approx(evaluation["eval_loss"], rel=1e-3)
    assert 0 <= evaluation["eval_masked_accuracy"] <= 1
    assert (output / "model.safetensors").is_file() and (output / "spm.model").is_file()
    config = json.loads((output / "config.json").read_text())
    assert config["enhanced_mask_decoder"] is True and "AutoModelForMaskedLM" in config["auto_map"]


def test_saved_folders_are_complete(rtd_run):
    for role, auto_class in (("discriminator", "AutoModelForPreTraining"), ("generator", "AutoModelForMaskedLM")):
        folder = rtd_run / role
        names = {path.name for path in folder.iterdir()}
        assert {"config.json", "model.safetensors", "spm.model", "tokenizer_config.json", "README.md",
                "modeling_disentangled.py", "configuration_disentangled.py"} <= names, names  # fmt: skip
        config = json.loads((folder / "config.json").read_text())
        assert auto_class in config["auto_map"]
        card = (folder / "README.md").read_text()
        assert "replaced-token detection" in card and f"{STEPS} optimizer steps" in card and "documents" in card
    discriminator = load_file(rtd_run / "discriminator" / "model.safetensors")
    assert not any("delta" in key for key in discriminator)  # E_G + E_delta merged into the table
    generator = load_file(rtd_run / "generator" / "model.safetensors")
    assert not torch.equal(
        discriminator["deberta.embeddings.word_embeddings.weight"],
        generator["deberta.embeddings.word_embeddings.weight"],
    )  # gdes: E_delta was trained


LOAD_SCRIPT = """
import json, sys, torch, transformers
text, results = sys.argv[1], {}
for folder, auto_class in zip(sys.argv[2::2], sys.argv[3::2]):
    model = getattr(transformers, auto_class).from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        results[folder] = model(**tokenizer(text, return_tensors="pt")).logits.flatten()[:40].tolist()
print(json.dumps(results))
"""
ROLES = {"discriminator": "AutoModelForPreTraining", "generator": "AutoModelForMaskedLM"}


@pytest.mark.parametrize("python", ["5.x", "4.57"])
def test_saved_folders_load_where_the_package_is_absent(rtd_run, tmp_path, python):
    import transformers

    interpreter = system_python() if python == "5.x" else PYTHON_4_57
    if python == "4.57" and not Path(interpreter).exists():
        pytest.skip(f"no transformers 4.57 environment at {interpreter}")
    script = tmp_path / "load.py"
    script.write_text(LOAD_SCRIPT)
    args = [CHECK_TEXT, *(str(part) for role, auto_class in ROLES.items() for part in (rtd_run / role, auto_class))]
    result = run_isolated(interpreter, script, args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    for role, auto_class in ROLES.items():
        folder = rtd_run / role
        model = getattr(transformers, auto_class).from_pretrained(folder).eval()  # the installed package
        assert type(model).__module__.startswith("disentangled.")
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        with torch.no_grad():
            local = model(**tokenizer(CHECK_TEXT, return_tensors="pt")).logits.flatten()[:40]
        torch.testing.assert_close(torch.tensor(remote[str(folder)]), local, rtol=1e-5, atol=1e-5)


def test_the_discriminator_fine_tunes_with_the_example_script(rtd_run, tmp_path):
    train, validation = sentiment_files(tmp_path, train=64, validation=16)
    results = run_finetune(
        "--model_name_or_path", rtd_run / "discriminator", "--trust_remote_code",
        "--train_file", train, "--validation_file", validation, "--output_dir", tmp_path / "ft",
        "--do_train", "--do_eval", "--max_steps", 4, "--per_device_train_batch_size", 16,
        "--save_strategy", "no", "--seed", 0,
    )  # fmt: skip
    assert 0.0 <= results["eval"]["eval_accuracy"] <= 1.0
    assert (tmp_path / "ft" / "model.safetensors").is_file()


def test_resume_from_a_checkpoint_repeats_the_uninterrupted_losses(tmp_path):
    whole = tmp_path / "whole"
    extra = ["--logging-steps", "1", "--save-steps", "3", "--generator-layers", "1"]
    assert main(pretrain_args(tmp_path, whole, *extra, steps=6)) == 0
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-3", resumed / "checkpoint-3")
    assert main(pretrain_args(tmp_path, resumed, *extra, steps=6)) == 0  # finds checkpoint-3 and resumes
    for key in ("loss", "discriminator_auc", "generator_accuracy"):
        expected, got = log_losses(whole, key), log_losses(resumed, key)
        assert sorted(got) == [1, 2, 3, 4, 5, 6]  # steps 1-3 come from the checkpoint's log history
        for step in (4, 5, 6):
            assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), (key, step)


def test_continued_pretraining_from_a_converted_v3_checkpoint(tmp_path):
    """microsoft/deberta-v3-base's Hub layout, converted; with learning rate 0 the saved discriminator is the
    checkpoint's encoder and the generator its embeddings, lowest layer and MLM head."""
    from conversion_sources import hub_deberta_v3_base_case
    from tiny_models import spm_model

    from disentangled.conversion.convert import convert

    case = hub_deberta_v3_base_case(tmp_path / "sources", spm_model())
    converted = tmp_path / "converted"
    convert(str(case.source), converted, log=lambda *args, **kwargs: None)
    output = tmp_path / "out"
    args = pretrain_args(tmp_path, output, "--generator-layers", "1", "--learning-rate", "0", steps=2)
    at = args.index("--config")
    args[at : at + 2] = ["--init-from", str(converted)]
    at = args.index("--tokenizer")
    del args[at : at + 2]  # the checkpoint's own tokenizer
    assert main(args) == 0

    source = load_file(converted / "model.safetensors")
    discriminator = load_file(output / "discriminator" / "model.safetensors")
    generator = load_file(output / "generator" / "model.safetensors")
    encoder = [key for key in source if key.startswith("deberta.")]
    assert encoder and all(torch.equal(discriminator[key], source[key]) for key in encoder)
    lowest = [key for key in encoder if ".layer." not in key or ".layer.0." in key]
    assert all(torch.equal(generator[key], source[key]) for key in lowest)
    assert not any(".layer.1." in key for key in generator)  # one generator layer
    heads = [key for key in source if key.startswith("lm_predictions.")]
    assert heads and all(torch.equal(generator[key], source[key]) for key in heads)
    config = json.loads((output / "generator" / "config.json").read_text())
    assert config["enhanced_mask_decoder"] is True and config["num_hidden_layers"] == 1


def _bert_folder(folder: Path) -> Path:
    import transformers

    config = transformers.BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64)  # fmt: skip
    transformers.BertForMaskedLM(config).save_pretrained(folder)
    return folder


def _deberta_without_weights(folder: Path) -> Path:
    """A deberta-v2 config.json beside weights of another model: not DeBERTa-shaped."""
    import transformers

    config_file(folder, vocab_size=200)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "deberta-v2"
    _bert_folder(folder / "bert")
    shutil.copyfile(folder / "bert" / "model.safetensors", folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    assert transformers  # imported for the folder above
    return folder


def _tokenizer_without_mask(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [
        "[PAD]",
        "[CLS]",
        "[SEP]",
        "[UNK]",
        *sorted(set(" ".join(text_file(folder / "t").read_text().split()).split())),
    ]
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]"
    ).save_pretrained(folder)
    return folder


def _wide_generator(folder: Path) -> Path:
    from pretraining_helpers import TINY_V3
    from tiny_models import tokenizer

    from disentangled import DisentangledConfig, DisentangledForMaskedLM

    config = DisentangledConfig(
        **{**TINY_V3, "hidden_size": 64, "intermediate_size": 128, "vocab_size": len(tokenizer())}
    )
    config.enhanced_mask_decoder = True
    DisentangledForMaskedLM(config).save_pretrained(folder)
    return folder


BAD_INPUTS = {  # name -> (how to change the arguments, words of the error)
    "empty training file": (lambda root, a: _replace(a, "--train-file", _empty(root)), "is empty"),
    "missing training file": (lambda root, a: _replace(a, "--train-file", str(root / "nope.txt")), "no such file"),
    "unreadable training file": (lambda root, a: _replace(a, "--train-file", _binary(root)), "not UTF-8"),
    "tokenizer without [MASK]": (
        lambda root, a: _replace(a, "--tokenizer", str(_tokenizer_without_mask(root / "nomask"))),
        "no [MASK] token",
    ),
    "generator wider under gdes": (
        lambda root, a: [*a, "--init-generator", str(_wide_generator(root / "wide"))],
        "wider than the discriminator",
    ),
    "generator wider under es": (
        lambda root, a: [*a, "--init-generator", str(_wide_generator(root / "wide")), "--embedding-sharing", "es"],
        "wider than the discriminator",
    ),
    "init-from a BERT model": (
        lambda root, a: _init_from(a, _bert_folder(root / "bert")),
        "not DeBERTa-v2/v3-shaped",
    ),
    "init-from DeBERTa config, other weights": (
        lambda root, a: _init_from(a, _deberta_without_weights(root / "other")),
        "is not DeBERTa-shaped",
    ),
    "sequences longer than the absolute table": (
        lambda root, a: _replace(a, "--max-seq-length", "300"),
        "longer than the generator's absolute position table",
    ),
    "no tokenizer": (lambda root, a: _drop(a, "--tokenizer"), "give --tokenizer PATH or --vocab-size N"),
}


def _replace(args: list[str], option: str, value: str) -> list[str]:
    args = list(args)
    args[args.index(option) + 1] = value
    return args


def _drop(args: list[str], option: str) -> list[str]:
    at = args.index(option)
    return args[:at] + args[at + 2 :]


def _init_from(args: list[str], folder: Path) -> list[str]:
    return [*_drop(args, "--config"), "--init-from", str(folder)]


def _empty(root: Path) -> str:
    (root / "empty.txt").write_text("\n\n")
    return str(root / "empty.txt")


def _binary(root: Path) -> str:
    (root / "binary.txt").write_bytes(bytes(range(128, 256)) * 8)
    return str(root / "binary.txt")


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_before_anything_is_written(tmp_path, capsys, case):
    change, words = BAD_INPUTS[case]
    output = tmp_path / "out"
    args = change(tmp_path, pretrain_args(tmp_path, output, "--generator-layers", "1"))
    assert main(args) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("disentangled pretrain: error:") and words in error, error
    assert not output.exists()


def test_the_command_lists_every_training_argument(tmp_path):
    import dataclasses

    from transformers import TrainingArguments

    from disentangled.cli import build_parser

    parser = build_parser("pretrain")
    args = parser.parse_args(pretrain_args(tmp_path, tmp_path / "out", "--lr-scheduler-type", "cosine", "--bf16"))
    fields = [field.name for field in dataclasses.fields(TrainingArguments) if field.init]
    assert all(hasattr(args, name) for name in fields)
    assert args.max_steps == 4 and args.lr_scheduler_type == "cosine" and args.bf16 is True


def test_the_recipe_follows_from_the_run_is_printed_and_used(tmp_path, capsys):
    """No --learning-rate / --warmup-steps: from scratch, the preset's rate with 10% warm-up (a config of hidden
    size 32 is nearest the tiny preset); continued pretraining (--init-from), 5e-5 with 6% warm-up."""
    import argparse

    from disentangled.pretraining.command import CONTINUED_LEARNING_RATE, SCRATCH_LEARNING_RATES, default_recipe

    output = tmp_path / "out"
    args = _drop(pretrain_args(tmp_path, output, "--logging-steps", "1", steps=10), "--learning-rate")
    assert main(args) == 0
    printed = capsys.readouterr().out
    rate = SCRATCH_LEARNING_RATES["tiny"]
    assert f"recipe: learning rate {rate:g} (default for pretraining the tiny shape from scratch)" in printed
    assert "warm-up 0.1 of 10 steps (default for pretraining the tiny shape from scratch)" in printed
    logged = [entry["learning_rate"] for entry in json.loads((output / "trainer_state.json").read_text())["log_history"]
              if "learning_rate" in entry]  # fmt: skip
    assert logged[0] == 0 and logged[1] == pytest.approx(rate) == max(logged)  # 1 warm-up step, then decay
    assert logged[-1] < rate / 5
    # the run's last line: the held-out verdict, its figures saved beside the others
    assert "held-out check: the discriminator" in printed.strip().splitlines()[-1]
    held_out = json.loads((output / "held_out_results.json").read_text())
    assert 0.0 <= held_out["held_out_discriminator_auc"] <= 1.0

    continued = argparse.Namespace(init_from="some/model", config=None, learning_rate=None, warmup_steps=None)
    assert default_recipe(continued)["learning_rate"] == (CONTINUED_LEARNING_RATE, "default for continued "
                                                                                   "pretraining (--init-from)")  # fmt: skip
    given = argparse.Namespace(init_from=None, config="base", learning_rate=1e-4, warmup_steps=None)
    chosen = default_recipe(given)
    assert chosen["learning_rate"] == (1e-4, "given") and chosen["warmup_steps"][0] == 0.1


def test_the_discriminator_learns_on_built_in_text(tmp_path, capsys):
    """150 RTD steps of the tiny preset with the default recipe on built-in sentences (one a sequence): on held-out
    sentences with 15% of the tokens replaced by random ones, the discriminator's exact ROC-AUC is far above 0.5. The
    code before issue 28 (learning rate 5e-5 without warm-up, weights drawn with std 0.02, E_delta = E_D - E_G)
    reached 0.66 on this run; now 0.90."""
    from disentangled.demo.data import corpus_lines, pretraining_lines, train_sentencepiece
    from disentangled.integrations.tokenization import tokenizer_from_spm
    from disentangled.modeling import DisentangledForReplacedTokenDetection
    from disentangled.pretraining import random_replacement_auc

    (tmp_path / "train.txt").write_text("\n".join(pretraining_lines(4000, seed=0)) + "\n")
    text = pretraining_lines(3000, seed=5) + corpus_lines(1000, seed=5)
    spm = train_sentencepiece(tmp_path / "tokenizer", text, vocab_size=110)
    output = tmp_path / "out"
    args = ["pretrain", "--objective", "rtd", "--train-file", tmp_path / "train.txt", "--tokenizer", spm,
            "--config", "tiny", "--line-by-line", "--max-seq-length", "32", "--max-steps", "150",
            "--per-device-train-batch-size", "32", "--output-dir", output, "--seed", "0", "--save-strategy", "no",
            *QUIET]  # fmt: skip
    assert main([str(arg) for arg in args]) == 0
    assert "held-out check: the discriminator learned" in capsys.readouterr().out
    tokenizer = tokenizer_from_spm(spm)
    discriminator = DisentangledForReplacedTokenDetection.from_pretrained(output / "discriminator")
    held_out = tokenizer(pretraining_lines(300, seed=99), padding=True, return_tensors="pt")
    special = set(tokenizer.all_special_ids)
    replaceable = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    auc = random_replacement_auc(discriminator, held_out["input_ids"], held_out["attention_mask"], replaceable)
    assert auc > 0.8, auc
