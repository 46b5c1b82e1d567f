"""Parity with transformers' DeBERTa v1 classes after mapping the fused `in_proj` layout to ours."""

from __future__ import annotations

import pytest
import torch
import transformers
from deberta_shapes import V1_SHAPES, cut
from parity import check_parity, inflate_weights, padded_batch

import disentangled
from disentangled.configuration.configuration_disentangled import deberta_v1_fields
from disentangled.conversion.deberta_v1 import convert_v1_state_dict, split_in_proj

HEADS = {
    "Model": ("DebertaModel", disentangled.DisentangledModel),
    "MaskedLM": ("DebertaForMaskedLM", disentangled.DisentangledForMaskedLM),
    "SequenceClassification": ("DebertaForSequenceClassification", disentangled.DisentangledForSequenceClassification),
    "TokenClassification": ("DebertaForTokenClassification", disentangled.DisentangledForTokenClassification),
    "QuestionAnswering": ("DebertaForQuestionAnswering", disentangled.DisentangledForQuestionAnswering),
}


def build_v1_pair(shape: dict, head: str, **overrides):
    reference_name, ours_class = HEADS[head]
    fields = cut(dict(shape, **overrides))
    config = transformers.DebertaConfig(**fields, num_labels=2 if head == "QuestionAnswering" else 3)
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    reference = getattr(transformers, reference_name)(config)
    inflate_weights(reference)
    ours_config = disentangled.DisentangledConfig(**deberta_v1_fields(config.to_dict()))
    ours = ours_class(ours_config)
    state_dict = convert_v1_state_dict(reference.state_dict(), config.num_attention_heads)
    ours.load_state_dict(state_dict, strict=True)
    return reference.eval(), ours.eval()


def v1_names(reference):
    """Reference gradients under our names, without the zero biases the conversion adds (v1 has no key bias)."""

    def rename(grads):
        converted = convert_v1_state_dict(grads, reference.config.num_attention_heads)
        return {name: grad for name, grad in converted.items() if not name.endswith("key_proj.bias")}

    return rename


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("shape_name", list(V1_SHAPES))
def test_parity_with_transformers_deberta_v1(shape_name, head):
    reference, ours = build_v1_pair(V1_SHAPES[shape_name], head)
    diffs = check_parity(reference, ours, head, padded_batch(1000, [300, 171]), rename_gradients=v1_names(reference))
    print(f"{shape_name} {head}: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))


@pytest.mark.parametrize(
    "overrides",
    [dict(max_relative_positions=64), dict(pos_att_type=["p2c"]), dict(position_biased_input=True, type_vocab_size=2)],
    ids=["clipped-at-64", "p2c-only", "absolute-positions"],
)
def test_parity_v1_variants(overrides):
    reference, ours = build_v1_pair(V1_SHAPES["deberta-base"], "Model", **overrides)
    check_parity(reference, ours, "Model", padded_batch(1000, [150, 97]), rename_gradients=v1_names(reference))


def test_in_proj_is_split_head_by_head():
    heads, head_dim, hidden = 3, 2, 5
    weight = torch.arange(3 * heads * head_dim * hidden, dtype=torch.float32).view(3 * heads * head_dim, hidden)
    query, key, value = split_in_proj(weight, heads)
    for h in range(heads):  # head h owns rows [3hD, 3hD + 3D): its query, then key, then value
        base = 3 * h * head_dim
        assert torch.equal(query[h * head_dim : (h + 1) * head_dim], weight[base : base + head_dim])
        assert torch.equal(key[h * head_dim : (h + 1) * head_dim], weight[base + head_dim : base + 2 * head_dim])
        assert torch.equal(value[h * head_dim : (h + 1) * head_dim], weight[base + 2 * head_dim : base + 3 * head_dim])


def test_talking_head_is_rejected():
    with pytest.raises(ValueError, match="talking_head"):
        disentangled.DisentangledConfig(talking_head=True)


@pytest.mark.parametrize(
    "ours_class", [disentangled.DisentangledModel, disentangled.DisentangledForSequenceClassification]
)
def test_v1_folder_loaded_directly_fails_with_one_line_naming_convert(tmp_path, ours_class):
    """A v1 folder through `from_pretrained` would load with random attention weights: it must say to convert."""
    reference, _ = build_v1_pair(V1_SHAPES["deberta-base"], "Model")
    reference.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as error:
        ours_class.from_pretrained(tmp_path)
    message = str(error.value)
    assert "\n" not in message and "disentangled convert" in message and "v1" in message
