"""The Enhanced Mask Decoder against a reference built by hand from the model's public weights.

The reference follows Microsoft's `EnhancedMaskDecoder.emd_context_layer` and `DisentangledSelfAttention`
(microsoft/DeBERTa): H is the last layer's input, the query stream starts as Z + H (Z: rows of the absolute table),
and the last layer runs twice, queries from the stream, keys and values from H; the MLM head reads the second
output. The layer is written out term by term here (projections, relative indices from the bucketing formula,
c2p and p2c gathered Microsoft's way, a pairwise mask, output and feed-forward sublayers): it never calls a module
of the model, only reads its weights. Padded batches; outputs compared at real positions (float32, 1e-5 relative)
and every parameter's gradient (1e-4), the absolute table and the last layer included.

Reproduce the figures: `python -m pytest -q -s tests/test_emd.py`.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from parity import gradient_mismatches, inflate_weights, max_abs_diff, padded_batch

import disentangled
from disentangled.modeling import disentangled_attention as backends

BASE = dict(
    vocab_size=200,
    hidden_size=32,
    num_attention_heads=4,
    intermediate_size=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    legacy=False,
    enhanced_mask_decoder=True,
    position_biased_input=False,
)
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


# ---------------------------------------------------------------------------------------------------------------
# The reference, from the formula


def log_bucket_position(rel: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    """Microsoft's `make_log_bucket_position`: exact within bucket_size // 2, logarithmic beyond."""
    sign = torch.sign(rel)
    mid = bucket_size // 2
    abs_pos = torch.where((rel < mid) & (rel > -mid), torch.full_like(rel, mid - 1), rel.abs())
    log_pos = torch.ceil(torch.log(abs_pos / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, rel, log_pos * sign).long()


def relative_position(config, length: int) -> torch.Tensor:
    """[L, L]: the (bucketed) i - j."""
    rel = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).double()
    if config.position_buckets > 0:
        reach = config.max_relative_positions if config.max_relative_positions > 0 else config.max_position_embeddings
        return log_bucket_position(rel, config.position_buckets, reach)
    return rel.long()


def linear(x: torch.Tensor, module) -> torch.Tensor:
    return x @ module.weight.T + module.bias


def layer_norm(x: torch.Tensor, module) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + module.eps) * module.weight + module.bias


def gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def reference_layer(model, layer, hidden: torch.Tensor, query_states: torch.Tensor, input_mask: torch.Tensor):
    """One run of `layer` with queries from `query_states` and keys/values from `hidden`, Microsoft's way."""
    config = model.config
    attention = layer.attention.self
    heads, head_dim = config.num_attention_heads, config.head_size
    batch, length, _ = hidden.shape

    def split(x):  # [B, L, H * D] or [W, H * D] -> [B, H, L, D] or [H, W, D]
        return x.view(*x.shape[:-1], heads, head_dim).transpose(-3, -2)

    query = split(linear(query_states, attention.query_proj))
    key = split(linear(hidden, attention.key_proj))
    value = split(linear(hidden, attention.value_proj))
    terms = config.pos_att_type
    scale = math.sqrt(head_dim * (1 + len(terms)))
    scores = query @ key.transpose(-1, -2) / scale  # c2c

    encoder = model.deberta.encoder
    rel_table = encoder.rel_embeddings.weight
    if "layer_norm" in config.norm_rel_ebd:
        rel_table = layer_norm(rel_table, encoder.LayerNorm)
    relative = relative_position(config, length)
    if config.position_buckets > 0:
        att_span = config.position_buckets
    else:  # v1: the rows within reach of this length
        att_span = min(length, config.max_relative_positions)
    table_span = rel_table.shape[0] // 2
    rel_rows = rel_table[table_span - att_span : table_span + att_span]
    key_proj = attention.key_proj if config.share_att_key else attention.pos_key_proj
    query_proj = attention.query_proj if config.share_att_key else attention.pos_query_proj
    if "c2p" in terms:  # query (from the query stream) against the relative key rows of i - j
        pos_key = split(linear(rel_rows, key_proj))
        c2p = query @ pos_key.transpose(-1, -2) / scale  # [B, H, L, 2 span]
        index = torch.clamp(relative + att_span, 0, 2 * att_span - 1)
        scores = scores + torch.gather(c2p, -1, index.expand(batch, heads, length, length))
    if "p2c" in terms:  # key (from H) against the relative query rows, gathered by -(j - i) and transposed
        pos_query = split(linear(rel_rows, query_proj))
        p2c = key @ pos_query.transpose(-1, -2) / scale  # [B, H, L, 2 span]
        index = torch.clamp(-relative + att_span, 0, 2 * att_span - 1)
        scores = scores + torch.gather(p2c, -1, index.expand(batch, heads, length, length)).transpose(-1, -2)

    pair = (input_mask[:, None, :, None] & input_mask[:, None, None, :]).bool()  # Microsoft's [B, 1, L, L] mask
    scores = scores.masked_fill(~pair, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, -1).masked_fill(~pair, 0.0)
    context = (probs @ value).transpose(1, 2).reshape(batch, length, heads * head_dim)

    out = layer.attention.output
    attention_output = layer_norm(linear(context, out.dense) + query_states, out.LayerNorm)  # residual: the queries
    intermediate = gelu(linear(attention_output, layer.intermediate.dense))
    return layer_norm(linear(intermediate, layer.output.dense) + attention_output, layer.output.LayerNorm)


def reference_logits(model, batch: dict) -> torch.Tensor:
    """EMD logits from the weights; H (the last layer's input) is the encoder's second-to-last hidden state."""
    hidden = model.deberta(**batch, output_hidden_states=True).hidden_states[-2]
    input_mask = batch["attention_mask"].bool()
    z = model.deberta.embeddings.position_embeddings.weight[: hidden.shape[1]][None]  # Z, before any LayerNorm
    query_states = z + hidden
    last = model.deberta.encoder.layer[-1]
    for _ in range(2):
        query_states = reference_layer(model, last, hidden, query_states, input_mask)
    head = model.lm_predictions.lm_head
    states = layer_norm(gelu(linear(query_states, head.dense)), head.LayerNorm)
    return states @ model.deberta.embeddings.word_embeddings.weight.T + head.bias


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
        hidden = model.deberta(**batch).last_hidden_state
        head = model.lm_predictions.lm_head
        by_hand = layer_norm(gelu(linear(hidden, head.dense)), head.LayerNorm)
        by_hand = by_hand @ model.deberta.embeddings.word_embeddings.weight.T + head.bias
    assert max_abs_diff(last, by_hand, batch["attention_mask"]) <= 1e-5 * by_hand.abs().max()
    assert max_abs_diff(emd, last, batch["attention_mask"]) > 1e-2 * last.abs().max()


def test_position_biased_input_reduces_to_the_last_layer():
    """As in Microsoft's code: with absolute positions in the input, the decoder is the plain last layer."""
    model = build(**dict(CONFIGS["v3-base (log buckets, shared keys)"], position_biased_input=True))
    batch = padded_batch(BASE["vocab_size"], [20, 13])
    with torch.no_grad():
        hidden = model.deberta(**batch).last_hidden_state
        head = model.lm_predictions.lm_head
        by_hand = layer_norm(gelu(linear(hidden, head.dense)), head.LayerNorm)
        by_hand = by_hand @ model.deberta.embeddings.word_embeddings.weight.T + head.bias
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
def test_backends_match_eager_with_a_separate_query_stream(monkeypatch, config_name):
    """The query stream reaches every backend as projected queries: sdpa (several query blocks, and the blocked
    autograd path on the CPU with gradients) and flex's score_mod must match eager."""
    monkeypatch.setattr(backends, "SDPA_BLOCK_ELEMENTS", 2 * 4 * 40 * 7)  # 7 query rows per block
    monkeypatch.setattr(backends, "FLEX_COMPILED", False)  # flex's dense reference of the same score_mod
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
