"""`disentangled demo` end to end on a cut-down budget: a short pretraining run as the stand-in checkpoint, exported to
transformers' format, verified conversion, pipelines and Trainer in a fresh process through trust_remote_code, the
fine-tuned model saved and loaded back; and the stand-in has learned: its fill-mask answers are words of the right
kind, measured against the same model untrained."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

COUNTRIES = "france germany italy spain england austria".split()  # disentangled.demo.data.COUNTRIES, written out here
CITIES = "paris berlin rome madrid london vienna".split()


def country_mass(model, tokenizer) -> tuple[float, list[str]]:
    """Mean probability on the country tokens at the gap of 'CITY is the capital of [MASK].', and the top answers."""
    country_ids = [tokenizer.convert_tokens_to_ids("▁" + country) for country in COUNTRIES]
    assert tokenizer.unk_token_id not in country_ids  # each country is one piece of the demo's tokenizer
    texts = [f"{city} is the capital of {tokenizer.mask_token}." for city in CITIES]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    gap = batch["input_ids"] == tokenizer.mask_token_id
    probabilities = logits[gap].softmax(-1)  # [cities, vocab]
    tops = tokenizer.convert_ids_to_tokens(probabilities.argmax(-1).tolist())
    return probabilities[:, country_ids].sum(-1).mean().item(), [top.lstrip("▁") for top in tops]


@pytest.mark.slow
@pytest.mark.parametrize(  # each seed a group of its own: under `-n 2` the seeds run side by side (conftest.py)
    "seed", [pytest.param(seed, marks=pytest.mark.xdist_group(f"demo-seed-{seed}")) for seed in (0, 1, 2)]
)
def test_demo_runs_end_to_end(tmp_path, seed):
    """The demo as a user runs it, on three seeds: the stand-in answers the facts it was taught (every city's own
    country first), and fine-tuning from it reaches at least 0.95 and beats the same fine-tuning from random weights
    (same recipe, same seed) on each seed. Both fine-tunings are seeded, new classifier included, so a seed's figures
    repeat from run to run."""
    command = [sys.executable, "-m", "disentangled.cli", "demo", "--output-dir", str(tmp_path), "--seed", str(seed)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "disentangled pretrain --objective mlm --no-enhanced-mask-decoder" in out
    reached = re.search(r"accuracy on masked tokens (\d\.\d+) -> (\d\.\d+)", out)
    assert reached and float(reached[2]) > float(reached[1])
    assert "parity (DebertaV2ForMaskedLM vs DisentangledForMaskedLM)" in out  # the export to transformers' format
    assert "parity (transformers" in out and "from transformers_modules." in out
    assert "`import disentangled` is blocked here" in out
    assert "hidden states of shape (1, " in out
    before = float(re.search(r"accuracy before fine-tuning: (\d\.\d+)", out)[1])
    assert 0.0 <= before <= 1.0
    # what `python -m studies.demo` records for the manual's table, read the same way
    from studies.demo import parse

    figures = parse(out)
    assert figures["paris_answer"] == "france", out[-3000:]
    assert figures["masked_accuracy"] == float(reached[2])
    after, from_random = figures["fine_tuned"], figures["from_random"]
    assert after >= 0.95 and after > from_random, (after, from_random)
    assert re.search(r"demo done in \d+ s", out)
    source = json.loads((tmp_path / "source" / "config.json").read_text())
    assert source["model_type"] == "deberta-v2" and source["architectures"] == ["DebertaV2ForMaskedLM"]
    saved = json.loads((tmp_path / "finetuned" / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForSequenceClassification"].endswith("DisentangledForSequenceClassification")
    assert (tmp_path / "finetuned" / "modeling_disentangled.py").is_file()

    # What the pretraining taught, against the same architecture untrained: the gap after "is the capital of" is
    # filled with a country for every city, and the countries take far more probability than chance gives them.
    from transformers import AutoTokenizer

    from disentangled import DisentangledForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "converted")
    trained = DisentangledForMaskedLM.from_pretrained(tmp_path / "converted").eval()
    torch.manual_seed(0)
    untrained = DisentangledForMaskedLM(trained.config).eval()
    trained_mass, trained_tops = country_mass(trained, tokenizer)
    untrained_mass, _ = country_mass(untrained, tokenizer)
    assert trained_tops == COUNTRIES, trained_tops  # every city's own country first: the facts, not just the kind
    assert trained_mass > 0.5 and trained_mass > 5 * untrained_mass, (trained_mass, untrained_mass)
    for city, country in zip(CITIES, COUNTRIES):  # and the other way round: "the capital of COUNTRY is CITY."
        ids = tokenizer(f"the capital of {country} is {city}.", return_tensors="pt")["input_ids"]
        gap = ids == tokenizer.convert_tokens_to_ids("▁" + city)  # the city's own piece, masked in place
        with torch.no_grad():
            logits = trained(input_ids=ids.masked_fill(gap, tokenizer.mask_token_id)).logits[gap]
        assert tokenizer.convert_ids_to_tokens(int(logits.argmax())) == "▁" + city
