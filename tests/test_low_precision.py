"""bfloat16 and float16: finite outputs with attention logits that overflow float16 unless scaled before the product
(mDeBERTa's fp16 failure), errors within a small multiple of transformers' own, and bfloat16 autocast training."""

from __future__ import annotations

import pytest
import torch
import transformers
from parity import inflate_weights, padded_batch
from robustness import BACKENDS, dense_flex, skip_unless_supported, with_backend

import disentangled
from disentangled import DisentangledConfig


@pytest.fixture(autouse=True, scope="module")
def _dense_flex():
    with dense_flex():
        yield


FLOAT16_MAX = torch.finfo(torch.float16).max
LOW = [torch.bfloat16, torch.float16]


def mdeberta_like(**overrides) -> DisentangledConfig:
    """head_dim 64 as in mDeBERTa-v3-base, so the scaling (1 / sqrt(3 * 64)) is as small as there."""
    fields = dict(
        vocab_size=64,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        position_buckets=8,
        max_relative_positions=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    return DisentangledConfig(**{**fields, **overrides})


def content_scores(model, batch) -> list[torch.Tensor]:
    """Each layer's unscaled q_i . k_j ([B, H, L, L]), in float32."""
    captured = {}
    hooks = [
        module.register_forward_hook(lambda m, i, o, name=name: captured.__setitem__(name, o))
        for name, module in model.named_modules()
        if name.endswith("self.query_proj") or name.endswith("self.key_proj")
    ]
    with torch.no_grad():
        model(**batch)
    for hook in hooks:
        hook.remove()
    scores = []
    for name in sorted(n for n in captured if n.endswith("query_proj")):
        attention = model.get_submodule(name.rsplit(".", 1)[0])
        query, key = attention.heads(captured[name]), attention.heads(captured[name.replace("query", "key")])
        scores.append(query @ key.mT)
    return scores


def inflate_attention_logits(model, batch, target: float = 1.2e5) -> None:
    """Scale every query and key projection so that the largest unscaled q . k is about `target` (> float16 max)
    while the scaled logits (about target / 14) still fit float16 comfortably."""
    for _ in range(3):  # the later layers' inputs change with the earlier layers' weights
        largest = max(score.abs().max().item() for score in content_scores(model, batch))
        factor = (target / largest) ** 0.5
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".self.query_proj." in name or ".self.key_proj." in name:
                    param.mul_(factor)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_with_attention_logits_beyond_float16(backend, dtype):
    model = disentangled.DisentangledForSequenceClassification(mdeberta_like()).eval()
    inflate_weights(model)
    batch = padded_batch(64, [20, 13])
    batch["attention_mask"] = torch.cat([batch["attention_mask"], torch.zeros(1, 20, dtype=torch.long)])  # all pad
    batch["input_ids"] = torch.cat([batch["input_ids"], torch.zeros(1, 20, dtype=torch.long)])
    inflate_attention_logits(model, batch)
    scores = content_scores(model, batch)
    assert max(s.abs().max().item() for s in scores) > FLOAT16_MAX  # the unscaled product would overflow ...
    scaling = model.deberta.encoder.layer[0].attention.self.scaling
    assert max(s.abs().max().item() for s in scores) * scaling < FLOAT16_MAX / 4  # ... the scaled logits do not

    with_backend(model, backend).to(dtype)
    with torch.no_grad():
        output = model(**batch, output_hidden_states=True)
    for hidden in output.hidden_states:
        assert torch.isfinite(hidden).all()
    assert torch.isfinite(output.logits).all()


def test_the_naive_product_overflows_float16():
    """Why the eager reference scales the query first: the same logits, computed as (q . k) * scaling, are inf."""
    query = torch.full((1, 1, 4, 64), 45.0, dtype=torch.float16)  # q . k = 64 * 45 * 45 = 129600
    key = query.clone()
    scaling = (64 * 3) ** -0.5
    assert torch.isinf((query @ key.mT) * scaling).all()
    assert torch.isfinite((query * scaling) @ key.mT).all()
    for backend, attend in disentangled.modeling.modeling_disentangled.DISENTANGLED_ATTENTION_FUNCTIONS.items():
        context, _ = attend(None, query, key, query, None, scaling=scaling)
        assert torch.isfinite(context).all(), backend


def v2_pair(tmp_path):
    """transformers' DebertaV2Model and ours on the same (inflated) weights, in float32."""
    config = transformers.DebertaV2Config(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        relative_attention=True,
        position_buckets=8,
        max_relative_positions=32,
        pos_att_type="p2c|c2p",
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    reference = transformers.DebertaV2Model(config)
    inflate_weights(reference)
    reference.save_pretrained(tmp_path)
    ours = disentangled.DisentangledModel.from_pretrained(tmp_path, attn_implementation="eager")
    return reference.eval(), ours.eval()


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_error_within_a_small_multiple_of_transformers(tmp_path, dtype):
    reference, ours = v2_pair(tmp_path)
    batch = padded_batch(64, [40, 23, 7])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        exact = reference(**batch).last_hidden_state
        theirs = reference.to(dtype)(**batch).last_hidden_state.float()
        their_error = (theirs - exact).abs()[real].max().item()
        ours.to(dtype)
        for backend in BACKENDS:
            our_error = (with_backend(ours, backend)(**batch).last_hidden_state.float() - exact).abs()[real].max()
            print(f"{dtype} {backend}: ours {our_error.item():.2e}, transformers {their_error:.2e}")
            assert our_error.item() <= 2 * their_error + 1e-3, backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_autocast_training(backend):
    skip_unless_supported(backend, "cpu-training")
    torch.manual_seed(0)
    model = disentangled.DisentangledForMaskedLM(mdeberta_like(hidden_size=64, num_attention_heads=4)).train()
    inflate_weights(model)
    with_backend(model, backend)
    batch = padded_batch(64, [24, 17, 9])
    labels = torch.where(torch.rand(batch["input_ids"].shape) < 0.3, batch["input_ids"], -100)
    labels[~batch["attention_mask"].bool()] = -100

    def loss_and_grads(autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch, labels=labels).loss
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    exact_loss, exact_grads = loss_and_grads(autocast=False)
    loss, grads = loss_and_grads(autocast=True)
    assert torch.isfinite(grads).all()
    assert abs(loss - exact_loss) <= 2e-2 * abs(exact_loss), (loss, exact_loss)
    cosine = torch.nn.functional.cosine_similarity(grads, exact_grads, dim=0).item()
    print(f"bf16 autocast {backend}: loss {loss:.4f} vs {exact_loss:.4f} float32, gradient cosine {cosine:.5f}")
    assert cosine > 0.99, cosine

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())
