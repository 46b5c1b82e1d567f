"""Parity with transformers' DebertaV2 classes: every head, every released v2/v3 shape, outputs and gradients.

The transformers model is saved as a checkpoint folder and loaded with `DisentangledForX.from_pretrained`,
so the test also proves that such a folder loads directly, with no missing or unexpected weights.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from deberta_shapes import V2_SHAPES, cut
from parity import check_parity, inflate_weights, padded_batch

import disentangled

HEADS = {
    "Model": ("DebertaV2Model", disentangled.DisentangledModel),
    "MaskedLM": ("DebertaV2ForMaskedLM", disentangled.DisentangledForMaskedLM),
    "SequenceClassification": (
        "DebertaV2ForSequenceClassification",
        disentangled.DisentangledForSequenceClassification,
    ),
    "TokenClassification": ("DebertaV2ForTokenClassification", disentangled.DisentangledForTokenClassification),
    "QuestionAnswering": ("DebertaV2ForQuestionAnswering", disentangled.DisentangledForQuestionAnswering),
    "MultipleChoice": ("DebertaV2ForMultipleChoice", disentangled.DisentangledForMultipleChoice),
}
LENGTHS = [300, 171]  # the longest is beyond position_buckets (256), so log buckets are exercised


def build_pair(tmp_path, shape: dict, head: str, **overrides):
    reference_name, ours_class = HEADS[head]
    num_labels = 2 if head == "QuestionAnswering" else 3
    config = transformers.DebertaV2Config(**cut(dict(shape, **overrides)), num_labels=num_labels)
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    torch.manual_seed(0)
    reference = getattr(transformers, reference_name)(config)
    inflate_weights(reference)
    reference.save_pretrained(tmp_path / "reference")
    ours, info = ours_class.from_pretrained(
        tmp_path / "reference", output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return reference.eval(), ours.eval()


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("shape_name", list(V2_SHAPES))
def test_parity_with_transformers_deberta_v2(tmp_path, shape_name, head):
    reference, ours = build_pair(tmp_path, V2_SHAPES[shape_name], head)
    batch = padded_batch(1000, LENGTHS)
    diffs = check_parity(reference, ours, head, batch)
    print(f"{shape_name} {head}: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))


VARIANTS = {
    "separate-position-projections": dict(share_att_key=False),
    "clipped-distances": dict(position_buckets=-1, max_relative_positions=64),
    "c2p-only": dict(pos_att_type="c2p"),
    "p2c-only": dict(pos_att_type="p2c"),
    "absolute-positions-token-types": dict(position_biased_input=True, type_vocab_size=2),
    "embedding-projection": dict(embedding_size=128),
    "mlm-v3-head": dict(legacy=False),
    "no-relative-attention": dict(relative_attention=False, pos_att_type=None),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_variants(tmp_path, variant):
    head = "MaskedLM" if variant in ("mlm-v3-head", "embedding-projection") else "Model"
    reference, ours = build_pair(tmp_path, V2_SHAPES["deberta-v3-xsmall"], head, **VARIANTS[variant])
    batch = padded_batch(1000, LENGTHS)
    if variant == "absolute-positions-token-types":
        batch["token_type_ids"] = (torch.arange(300) > 100).long().expand(2, 300).contiguous()
    check_parity(reference, ours, head, batch)


def test_hidden_states_and_attentions_match(tmp_path):
    reference, ours = build_pair(tmp_path, V2_SHAPES["deberta-v2-xlarge"], "Model")
    batch = padded_batch(1000, LENGTHS)
    expected = reference(**batch, output_hidden_states=True, output_attentions=True)
    actual = ours(**batch, output_hidden_states=True, output_attentions=True)
    real = batch["attention_mask"].bool()
    assert len(actual.hidden_states) == len(expected.hidden_states) == 3
    for ours_states, reference_states in zip(actual.hidden_states, expected.hidden_states):
        torch.testing.assert_close(ours_states[real], reference_states[real], rtol=0, atol=1e-5)
    for ours_probs, reference_probs in zip(actual.attentions, expected.attentions):
        rows = real[:, None, :, None].expand_as(ours_probs)  # real query rows, every key column
        torch.testing.assert_close(ours_probs[rows], reference_probs[rows], rtol=0, atol=1e-6)
