"""The Enhanced Mask Decoder against a reference built by hand from the model's public weights.

The reference (`emd_reference.py`) follows Microsoft's `EnhancedMaskDecoder.emd_context_layer` and
`DisentangledSelfAttention` (microsoft/DeBERTa): H is the last layer's input, the query stream starts as Z + H (Z: rows
of the absolute table), and the last layer runs twice, queries from the stream, keys and values from H; the MLM head
reads the second output. The layer is written out term by term there; it never calls a module of the model, only
reads its weights. Padded batches; outputs compared at real positions (float32, 1e-5 relative)
and every parameter's gradient (1e-4), the absolute table and the last layer included.

Reproduce the figures: `python -m pytest -q -s tests/test_emd.py`.
"""

from __future__ import annotations

import copy

import pytest
import tiny_models
import torch
from emd_reference import Spec, emd_states, layer_norm, mlm_logits, prefixed
from parity import gradient_mismatches, inflate_weights, max_abs_diff, padded_batch

import disentangled
from disentangled.modeling import blocks, cpu_inference

BASE = dict(tiny_models.TINY, vocab_size=200, legacy=False, enhanced_mask_decoder=True, position_biased_input=False)
V3 = dict(  # deberta-v3: log buckets, shared keys, normalised relative embeddings
    relative_attention=True,
    position_buckets=256,
    max_relative_positions=-1,
    max_position_embeddings=512,
    share_att_key=True,
    norm_rel_ebd="layer_norm",
    pos_att_type="p2c|c2p",
)
CONFIGS = {
    "v3-base (log buckets, shared keys)": dict(V3, num_hidden_layers=2),
    "v2-xlarge (log buckets, shared keys, conv, head size)": dict(
        V3, num_hidden_layers=3, conv_kernel_size=3, conv_act="gelu", attention_head_size=6
    ),
    "v3 one layer (H = embeddings)": dict(V3, num_hidden_layers=1),
    "v1-base (clipped distances, separate projections)": dict(
        relative_attention=True,
        position_buckets=-1,
        max_relative_positions=16,
        max_position_embeddings=512,
        share_att_key=False,
        norm_rel_ebd="none",
        pos_att_type="c2p|p2c",
        num_hidden_layers=2,
    ),
}
LENGTHS = [300, 171]  # 300 passes the 128 exact buckets of v3, and the v1 clip of 16


def reference_logits(model, batch: dict) -> torch.Tensor:
    """EMD logits from the weights; H (the last layer's input) is the encoder's second-to-last hidden state."""
    config = model.config
    spec = Spec.of(config)
    weights = dict(model.named_parameters())  # parameters themselves: gradients reach them
    hidden = model.deberta(**batch, output_hidden_states=True).hidden_states[-2]
    rel_table = weights["deberta.encoder.rel_embeddings.weight"]
    if "layer_norm" in config.norm_rel_ebd:
        rel_table = layer_norm(rel_table, weights, "deberta.encoder.LayerNorm", spec.eps)
    last = prefixed(weights, f"deberta.encoder.layer.{config.num_hidden_layers - 1}.")
    table = weights["deberta.embeddings.position_embeddings.weight"]  # Z, before any LayerNorm
    states = emd_states(last, spec, rel_table, hidden, table, batch["attention_mask"].bool())
    word_embeddings = weights["deberta.embeddings.word_embeddings.weight"]
    return mlm_logits(prefixed(weights, "lm_predictions.lm_head."), word_embeddings, states, spec.eps)


def plain_head(model, hidden: torch.Tensor) -> torch.Tensor:
    """The MLM head on given states, from the weights."""
    weights = dict(model.named_parameters())
    word_embeddings = weights["deberta.embeddings.word_embeddings.weight"]
    return mlm_logits(
        prefixed(weights, "lm_predictions.lm_head."), word_embeddings, hidden, model.config.layer_norm_eps
    )


# ---------------------------------------------------------------------------------------------------------------


def build(implementation: str = "eager", **config) -> disentangled.DisentangledForMaskedLM:
    torch.manual_seed(0)
    model = disentangled.DisentangledForMaskedLM(disentangled.DisentangledConfig(**dict(BASE, **config)))
    inflate_weights(model)
    model.set_attn_implementation(implementation)
    return model.eval()


def weighted_sum(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A loss over real positions with a fixed, non-trivial cotangent."""
    weights = torch.linspace(-1, 1, logits.numel()).view_as(logits) * mask[..., None]
    return (logits * weights).sum()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_emd_matches_hand_built_reference(name):
    model = build(**CONFIGS[name])
    batch = padded_batch(BASE["vocab_size"], LENGTHS)
    mask = batch["attention_mask"]

    logits = model(**batch).logits
    model.zero_grad()
    weighted_sum(logits, mask).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected = reference_logits(model, batch)
    model.zero_grad()
    weighted_sum(expected, mask).backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    relative = max_abs_diff(logits, expected, mask) / max(1.0, expected.abs().max().item())
    model.zero_grad()
    for n, p in model.named_parameters():
        p.grad = ours.get(n)
    problems = gradient_mismatches(model, reference_grads, rtol=1e-4)
    overall = max(g.abs().max().item() for g in reference_grads.values())
    gradient = max(  # the measure `gradient_mismatches` bounds by 1e-4: error / the parameter's gradient scale
        (ours[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-3 * overall) for n, g in reference_grads.items()
    )
    print(f"\nEMD {name}: logits max relative diff {relative:.2e}, max gradient relative diff {gradient:.2e}")
    assert torch.isfinite(logits).all()
    assert relative <= 1e-5, relative
    assert not problems, problems

    # The decoder is what trains the absolute table and (in the MLM objective) the last layer.
    table = "deberta.embeddings.position_embeddings.weight"
    last = f"deberta.encoder.layer.{model.config.num_hidden_layers - 1}.attention.self.query_proj.weight"
    for parameter in (table, last):
        assert reference_grads[parameter].abs().max() > 0, parameter


def test_emd_differs_from_the_plain_head_and_is_off_by_default():
    """The decoder changes the logits; without the field the same weights give the last-hidden-state head."""
    model = build(**CONFIGS["v3-base (log buckets, shared keys)"])
    plain_config = copy.deepcopy(model.config)
    plain_config.enhanced_mask_decoder = False
    plain = disentangled.DisentangledForMaskedLM(plain_config).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "position_embeddings" not in k}, strict=True)
    assert disentangled.DisentangledConfig().enhanced_mask_decoder is False
    batch = padded_batch(BASE["vocab_size"], [20, 13])
    with torch.no_grad():
        emd = model(**batch).logits
        last = plain(**batch).logits
        by_hand = plain_head(model, model.deberta(**batch).last_hidden_state)
    assert max_abs_diff(last, by_hand, batch["attention_mask"]) <= 1e-5 * by_hand.abs().max()
    assert max_abs_diff(emd, last, batch["attention_mask"]) > 1e-2 * last.abs().max()


def test_position_biased_input_reduces_to_the_last_layer():
    """As in Microsoft's code: with absolute positions in the input, the decoder is the plain last layer."""
    model = build(**dict(CONFIGS["v3-base (log buckets, shared keys)"], position_biased_input=True))
    batch = padded_batch(BASE["vocab_size"], [20, 13])
    with torch.no_grad():
        by_hand = plain_head(model, model.deberta(**batch).last_hidden_state)
        assert max_abs_diff(model(**batch).logits, by_hand, batch["attention_mask"]) <= 1e-5 * by_hand.abs().max()


def test_inputs_embeds_and_position_ids_give_the_same_logits():
    model = build(**CONFIGS["v3-base (log buckets, shared keys)"])
    batch = padded_batch(BASE["vocab_size"], [20, 13])
    with torch.no_grad():
        expected = model(**batch).logits
        embeds = model.deberta.embeddings.word_embeddings(batch["input_ids"])
        from_embeds = model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).logits
        positions = torch.arange(20)[None].expand(2, 20)
        with_positions = model(**batch, position_ids=positions).logits
        shifted = model(**batch, position_ids=positions + 3).logits
    assert torch.equal(from_embeds, expected)
    assert torch.equal(with_positions, expected)
    assert max_abs_diff(shifted, expected, batch["attention_mask"]) > 1e-3  # Z follows position_ids


def test_gradient_checkpointing_keeps_emd_gradients():
    model = build(**CONFIGS["v3-base (log buckets, shared keys)"])
    batch = padded_batch(BASE["vocab_size"], [20, 13])
    weighted_sum(model(**batch).logits, batch["attention_mask"]).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.train()  # checkpointing runs in training only; dropout is 0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    weighted_sum(model(**batch).logits, batch["attention_mask"]).backward()
    assert not gradient_mismatches(model, expected, rtol=1e-4)


@pytest.mark.parametrize(
    "config_name", ["v3-base (log buckets, shared keys)", "v1-base (clipped distances, separate projections)"]
)
def test_backends_match_eager_with_a_separate_query_stream(monkeypatch, switch, config_name):
    """The query stream reaches every backend as projected queries: sdpa (several query blocks, and the blocked
    autograd path on the CPU with gradients) and flex's score_mod must match eager."""
    monkeypatch.setattr(blocks, "SDPA_BLOCK_ELEMENTS", 2 * 4 * 40 * 7)  # 7 query rows per block
    monkeypatch.setattr(cpu_inference, "DISTANCE_BLOCK_ELEMENTS", 2 * 4 * 40 * 7)
    monkeypatch.setattr(cpu_inference, "DISTANCE_MIN_ROWS", 1)
    switch(FLEX_COMPILED=False)  # flex's dense reference of the same score_mod
    eager = build(**CONFIGS[config_name])
    batch = padded_batch(BASE["vocab_size"], [40, 23])
    mask = batch["attention_mask"]
    weighted_sum(logits := eager(**batch).logits, mask).backward()
    expected_grads = {n: p.grad.clone() for n, p in eager.named_parameters() if p.grad is not None}
    scale = max(1.0, logits.abs().max().item())
    for implementation in ("sdpa", "flex_attention"):
        other = copy.deepcopy(eager)
        other.zero_grad()
        other.set_attn_implementation(implementation)
        with torch.no_grad():
            diff = max_abs_diff(other(**batch).logits, logits, mask) / scale
        print(f"\nEMD {config_name}, {implementation} vs eager: logits max relative diff {diff:.2e}")
        assert diff <= 1e-5
    sdpa = copy.deepcopy(eager)
    sdpa.zero_grad()
    sdpa.set_attn_implementation("sdpa")
    weighted_sum(sdpa(**batch).logits, mask).backward()
    assert not gradient_mismatches(sdpa, expected_grads, rtol=1e-4)


def test_packed_sequences_match_padded():
    model = build(**CONFIGS["v3-base (log buckets, shared keys)"])
    batch = padded_batch(BASE["vocab_size"], [20, 13])
    with torch.no_grad():
        padded = model(**batch).logits
        ids = torch.cat([batch["input_ids"][0, :20], batch["input_ids"][1, :13]])[None]
        packed = model(input_ids=ids, cu_seqlens=[0, 20, 33]).logits
    assert max_abs_diff(packed[0, :20], padded[0]) <= 1e-5 * padded.abs().max()
    assert max_abs_diff(packed[0, 20:], padded[1, :13]) <= 1e-5 * padded.abs().max()


def test_bad_configs_and_inputs_are_refused():
    with pytest.raises(ValueError, match="enhanced_mask_decoder.*legacy"):
        disentangled.DisentangledForMaskedLM(disentangled.DisentangledConfig(**dict(BASE, legacy=True)))
    with pytest.raises(ValueError, match="embedding_size"):
        disentangled.DisentangledForMaskedLM(disentangled.DisentangledConfig(**dict(BASE, embedding_size=16)))
    with pytest.raises(ValueError, match="enhanced_mask_decoder"):
        disentangled.DisentangledConfig(enhanced_mask_decoder="yes")
    model = build(**dict(CONFIGS["v3-base (log buckets, shared keys)"], max_position_embeddings=300))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(input_ids=torch.ones(1, 301, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long), position_ids=torch.tensor([[0, 1, 2, 300]]))


def test_from_dict_of_a_deberta_v2_config_leaves_the_decoder_off():
    config = disentangled.DisentangledConfig.from_dict(
        {"model_type": "deberta-v2", "hidden_size": 32, "num_attention_heads": 4}
    )
    assert config.enhanced_mask_decoder is False


@pytest.mark.parametrize("head", ["emd", "legacy"])
def test_sparse_prediction_gives_the_dense_logits_loss_and_gradients_at_the_labelled_tokens(head):
    """`sparse_prediction=True` (pretraining's generator): logits [M, V] equal to the dense logits at the labelled
    tokens in row-major order, the same loss and the same gradients; without labels it is refused."""
    config = CONFIGS["v3-base (log buckets, shared keys)"]
    if head == "legacy":  # transformers' cls.predictions head, no decoder
        config = dict(config, enhanced_mask_decoder=False, legacy=True)
    model = build(**config)
    batch = padded_batch(BASE["vocab_size"], [20, 13])
    labels = torch.where(torch.rand(batch["input_ids"].shape, generator=torch.Generator().manual_seed(0)) < 0.3,
                         batch["input_ids"], -100).masked_fill(batch["attention_mask"] == 0, -100)  # fmt: skip
    picked = labels != -100
    dense = model(**batch, labels=labels)
    dense.loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    sparse = model(**batch, labels=labels, sparse_prediction=True)
    sparse.loss.backward()
    assert sparse.logits.shape == (int(picked.sum()), BASE["vocab_size"])
    torch.testing.assert_close(sparse.logits, dense.logits[picked], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse.loss, dense.loss, rtol=1e-6, atol=0)
    assert not gradient_mismatches(model, expected, rtol=1e-4)
    with pytest.raises(ValueError, match="sparse_prediction=True.*labels"):
        model(**batch, sparse_prediction=True)
