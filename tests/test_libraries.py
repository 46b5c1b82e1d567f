"""The libraries DeBERTa users put on top: sentence-transformers (CrossEncoder reranking, SentenceTransformer
embeddings) through the package and as remote code, and peft LoRA on the attention projections."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
from library_checks import check_cross_encoder, check_sentence_transformer
from parity import uncached_copy
from tiny_models import export_remote_code, save_tiny, tiny_config, tokenizer

from disentangled import DisentangledForSequenceClassification, DisentangledModel


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    tok = tokenizer()
    return {
        "reranker": save_tiny(
            tmp_path_factory.mktemp("reranker"), DisentangledForSequenceClassification, tok, num_labels=1
        ),
        "base": save_tiny(tmp_path_factory.mktemp("base"), DisentangledModel, tok, seed=1),
    }


def test_cross_encoder_through_the_package(folders):
    check_cross_encoder(folders["reranker"], trust_remote_code=False)


def test_sentence_transformer_through_the_package(folders):
    check_sentence_transformer(folders["base"], trust_remote_code=False)


def test_sentence_transformers_as_remote_code_without_the_package(folders, tmp_path):
    remote = {name: str(export_remote_code(folder)) for name, folder in folders.items()}
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("library_checks.py")), json.dumps(remote)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")},
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count(": ok") == 2


def test_lora_on_the_attention_projections_trains_and_merges(tmp_path):
    torch.manual_seed(0)
    model = DisentangledForSequenceClassification(tiny_config(tokenizer(), num_labels=2))
    config = peft.LoraConfig(
        task_type=peft.TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules=["query_proj", "key_proj", "value_proj"]
    )
    lora = peft.get_peft_model(model, config)
    trainable = {name for name, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or "classifier" in name or "pooler" in name for name in trainable)
    assert sum("lora_A" in name for name in trainable) == 3 * 2  # q, k, v in each of 2 layers

    # a learnable toy task: is token 7 in the sequence
    inputs = torch.randint(10, 100, (32, 10))
    labels = torch.arange(32) % 2
    inputs[labels == 1, 4] = 7
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    lora.train()
    losses = []
    for _ in range(30):
        loss = lora(input_ids=inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]

    lora.eval()
    with torch.no_grad():
        adapted = lora(input_ids=inputs).logits
    merged = lora.merge_and_unload()
    assert isinstance(merged, DisentangledForSequenceClassification)
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    merged.save_pretrained(tmp_path / "merged")
    reloaded = DisentangledForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=inputs).logits, adapted, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(reloaded(input_ids=inputs).logits, adapted, rtol=1e-4, atol=1e-5)


def _uncached(model, inputs) -> torch.Tensor:
    """The model's output with no cached position tables."""
    with torch.no_grad():
        return uncached_copy(model)(input_ids=inputs).last_hidden_state


def test_evaluations_see_the_lora_adapters_as_they_are():
    """Evaluate; evaluate with the adapters turned off (`disable_adapter`, an attribute of the LoRA layers, so no
    weight of the projections changes); train the adapters and evaluate again (Trainer's `eval_strategy`). Each
    evaluation is the model's own, not position projections kept from an earlier one."""
    torch.manual_seed(0)
    model = DisentangledModel(tiny_config(tokenizer()))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["query_proj", "key_proj"]))
    with torch.no_grad():  # adapters that matter (lora_B starts at zero)
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    inputs = torch.randint(10, 100, (4, 12))
    lora.eval()
    with torch.no_grad():
        adapted = lora(input_ids=inputs).last_hidden_state
    with lora.disable_adapter(), torch.no_grad():
        without = lora(input_ids=inputs).last_hidden_state
        expected = _uncached(lora, inputs)
    assert not torch.allclose(without, adapted, atol=1e-3)
    torch.testing.assert_close(without, expected, rtol=0, atol=1e-6)

    lora.train()
    optimizer = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=20.0)
    target = torch.randn(4, 12, model.config.hidden_size)
    for _ in range(3):
        (lora(input_ids=inputs).last_hidden_state * target).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    lora.eval()
    with torch.no_grad():
        trained = lora(input_ids=inputs).last_hidden_state
    assert not torch.allclose(trained, adapted, atol=1e-3)
    torch.testing.assert_close(trained, _uncached(lora, inputs), rtol=0, atol=1e-6)
