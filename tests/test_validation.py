"""Bad input fails at the top of forward with a ValueError that names the argument, what was given and what is
allowed, never with an IndexError or RuntimeError from deep inside the model."""

from __future__ import annotations

import pytest
import torch

import disentangled
from disentangled import DisentangledConfig

VOCAB, TYPES, MAX_POSITIONS, BATCH, LENGTH = 50, 2, 16, 2, 6


def tiny_config(**overrides) -> DisentangledConfig:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=MAX_POSITIONS,
        position_biased_input=True,
        type_vocab_size=TYPES,
        position_buckets=4,
        max_relative_positions=8,
        num_labels=3,
    )
    return DisentangledConfig(**{**fields, **overrides})


MODELS: dict[str, torch.nn.Module] = {}


def model(name: str = "DisentangledModel", **overrides) -> torch.nn.Module:
    key = name + repr(sorted(overrides.items()))
    if key not in MODELS:
        if name == "DisentangledForQuestionAnswering":  # start and end logits
            overrides = {"num_labels": 2, **overrides}
        MODELS[key] = getattr(disentangled, name)(tiny_config(**overrides)).eval()
    return MODELS[key]


def ids(*shape: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, shape or (BATCH, LENGTH))


def mask(*shape: int) -> torch.Tensor:
    return torch.ones(shape or (BATCH, LENGTH), dtype=torch.long)


# name -> (head, inputs, the argument the message must name, a fragment of what is allowed)
BAD_INPUTS = {
    "token-id-too-large": ("DisentangledModel", lambda: dict(input_ids=ids().index_fill(1, torch.tensor(2), VOCAB)), "input_ids", f"vocab_size={VOCAB}"),
    "token-id-negative": ("DisentangledModel", lambda: dict(input_ids=ids().index_fill(1, torch.tensor(0), -1)), "input_ids", "[0, "),
    "token-ids-float": ("DisentangledModel", lambda: dict(input_ids=ids().float()), "input_ids", "integers"),
    "token-ids-one-dimensional": ("DisentangledModel", lambda: dict(input_ids=ids(LENGTH)), "input_ids", "[batch, length]"),
    "both-ids-and-embeds": ("DisentangledModel", lambda: dict(input_ids=ids(), inputs_embeds=torch.randn(BATCH, LENGTH, 16)), "input_ids or inputs_embeds", "both"),
    "neither-ids-nor-embeds": ("DisentangledModel", lambda: dict(attention_mask=mask()), "input_ids or inputs_embeds", "neither"),
    "embeds-wrong-width": ("DisentangledModel", lambda: dict(inputs_embeds=torch.randn(BATCH, LENGTH, 7)), "inputs_embeds", "size 16"),
    "attention-mask-short": ("DisentangledModel", lambda: dict(input_ids=ids(), attention_mask=mask(BATCH, LENGTH - 1)), "attention_mask", f"[{BATCH}, {LENGTH}]"),
    "attention-mask-batch": ("DisentangledModel", lambda: dict(input_ids=ids(), attention_mask=mask(BATCH + 1, LENGTH)), "attention_mask", "pairwise"),
    "attention-mask-pairwise-shape": ("DisentangledModel", lambda: dict(input_ids=ids(), attention_mask=mask(BATCH, LENGTH, LENGTH + 1)), "attention_mask", f"[{BATCH}, {LENGTH}, {LENGTH}]"),
    "attention-mask-additive": ("DisentangledModel", lambda: dict(input_ids=ids(), attention_mask=torch.zeros(BATCH, LENGTH).index_fill(1, torch.tensor(5), -10000.0)), "attention_mask", "0 for padding"),
    "token-type-ids-shape": ("DisentangledModel", lambda: dict(input_ids=ids(), token_type_ids=torch.zeros(BATCH, LENGTH + 2, dtype=torch.long)), "token_type_ids", f"[{BATCH}, {LENGTH}]"),
    "token-type-ids-too-large": ("DisentangledModel", lambda: dict(input_ids=ids(), token_type_ids=torch.full((BATCH, LENGTH), TYPES)), "token_type_ids", f"type_vocab_size={TYPES}"),
    "token-type-ids-negative": ("DisentangledModel", lambda: dict(input_ids=ids(), token_type_ids=torch.full((BATCH, LENGTH), -1)), "token_type_ids", "[0, "),
    "position-ids-shape": ("DisentangledModel", lambda: dict(input_ids=ids(), position_ids=torch.arange(LENGTH + 1)[None]), "position_ids", f"[1, {LENGTH}]"),
    "position-ids-too-large": ("DisentangledModel", lambda: dict(input_ids=ids(), position_ids=torch.arange(LENGTH)[None] + MAX_POSITIONS), "position_ids", f"max_position_embeddings={MAX_POSITIONS}"),
    "too-long-for-absolute-positions": ("DisentangledModel", lambda: dict(input_ids=ids(1, MAX_POSITIONS + 1)), "input_ids", f"max_position_embeddings={MAX_POSITIONS}"),
    "zero-length": ("DisentangledModel", lambda: dict(input_ids=ids(BATCH, 0)), "input_ids", "at least one token"),
    "zero-length-embeds": ("DisentangledModel", lambda: dict(inputs_embeds=torch.randn(BATCH, 0, 16)), "inputs_embeds", "at least one token"),
    "mlm-labels-shape": ("DisentangledForMaskedLM", lambda: dict(input_ids=ids(), labels=ids(BATCH, LENGTH + 1)), "labels", f"[{BATCH}, {LENGTH}]"),
    "mlm-labels-range": ("DisentangledForMaskedLM", lambda: dict(input_ids=ids(), labels=ids() + VOCAB), "labels", "-100 to ignore"),
    "token-labels-range": ("DisentangledForTokenClassification", lambda: dict(input_ids=ids(), labels=torch.full((BATCH, LENGTH), 3)), "labels", "[0, 3)"),
    "token-labels-float": ("DisentangledForTokenClassification", lambda: dict(input_ids=ids(), labels=torch.zeros(BATCH, LENGTH)), "labels", "integers"),
    "sequence-labels-shape": ("DisentangledForSequenceClassification", lambda: dict(input_ids=ids(), labels=torch.zeros(BATCH + 1, dtype=torch.long)), "labels", f"[{BATCH}]"),
    "sequence-labels-range": ("DisentangledForSequenceClassification", lambda: dict(input_ids=ids(), labels=torch.tensor([0, 3])), "labels", "below 3"),
    "sequence-soft-labels-width": ("DisentangledForSequenceClassification", lambda: dict(input_ids=ids(), labels=torch.rand(BATCH, 4)), "labels", f"[{BATCH}, 3]"),
    "choice-labels-range": ("DisentangledForMultipleChoice", lambda: dict(input_ids=ids(BATCH, 3, LENGTH), labels=torch.tensor([0, 3])), "labels", "[0, 3)"),
    "choice-mask-shape": ("DisentangledForMultipleChoice", lambda: dict(input_ids=ids(BATCH, 3, LENGTH), attention_mask=mask(BATCH, LENGTH)), "attention_mask", f"[{BATCH}, 3, {LENGTH}]"),
    "choice-ids-two-dimensional": ("DisentangledForMultipleChoice", lambda: dict(input_ids=ids()), "input_ids", "[batch, choices, length]"),
    "qa-start-without-end": ("DisentangledForQuestionAnswering", lambda: dict(input_ids=ids(), start_positions=torch.tensor([0, 1])), "end_positions", "both"),
    "qa-positions-negative": ("DisentangledForQuestionAnswering", lambda: dict(input_ids=ids(), start_positions=torch.tensor([0, -1]), end_positions=torch.tensor([1, 1])), "start_positions", ">= 0"),
    "qa-positions-shape": ("DisentangledForQuestionAnswering", lambda: dict(input_ids=ids(), start_positions=torch.tensor([0, 1, 2]), end_positions=torch.tensor([1, 1, 2])), "start_positions", f"[{BATCH}]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_the_argument(case):
    head, inputs, argument, allowed = BAD_INPUTS[case]
    with pytest.raises(ValueError) as error:
        model(head)(**inputs())
    message = str(error.value)
    assert argument in message, message
    assert allowed in message, message


def test_relative_only_models_accept_any_length():
    relative_only = model(position_biased_input=False)
    output = relative_only(ids(1, 3 * MAX_POSITIONS)).last_hidden_state
    assert output.shape == (1, 3 * MAX_POSITIONS, 16) and torch.isfinite(output).all()


def test_position_ids_beyond_the_table_are_accepted_when_unused():
    """Relative-only models ignore position_ids (as DeBERTa-v3 does); only their shape is checked."""
    relative_only = model(position_biased_input=False)
    relative_only(ids(), position_ids=torch.arange(LENGTH)[None] + 1000)


def test_token_types_are_ignored_without_a_token_type_table():
    """DeBERTa-v3 tokenizers emit token_type_ids for pairs although the model has no table for them."""
    no_types = model(type_vocab_size=0)
    no_types(ids(), token_type_ids=torch.ones(BATCH, LENGTH, dtype=torch.long))


@pytest.mark.parametrize(
    "good",
    [
        dict(attention_mask=torch.ones(BATCH, LENGTH, dtype=torch.bool)),
        dict(attention_mask=torch.ones(BATCH, LENGTH, LENGTH)),
        dict(position_ids=torch.arange(LENGTH)[None]),
        dict(position_ids=torch.arange(LENGTH).expand(BATCH, LENGTH)),
        dict(token_type_ids=torch.ones(BATCH, LENGTH, dtype=torch.long)),
    ],
    ids=["bool-mask", "pairwise-float-mask", "shared-positions", "positions-per-row", "token-types"],
)
def test_good_inputs_pass(good):
    model()(ids(), **good)


@pytest.mark.parametrize(
    "head, labels",
    [
        ("DisentangledForMaskedLM", torch.full((BATCH, LENGTH), -100).index_fill(1, torch.tensor(1), 4)),
        ("DisentangledForTokenClassification", torch.tensor([[0, 1, 2, -100, -100, -100]] * BATCH)),
        ("DisentangledForSequenceClassification", torch.tensor([2, -1])),  # DeBERTa: negative labels are ignored
        ("DisentangledForSequenceClassification", torch.tensor([[2], [0]])),
        ("DisentangledForSequenceClassification", torch.rand(BATCH, 3)),  # soft targets
    ],
)
def test_good_labels_give_a_finite_loss(head, labels):
    assert torch.isfinite(model(head)(ids(), labels=labels).loss)


def test_question_answering_ignores_positions_past_the_input():
    output = model("DisentangledForQuestionAnswering", num_labels=2)(
        ids(), start_positions=torch.tensor([1, 50]), end_positions=torch.tensor([[2], [60]])
    )
    assert torch.isfinite(output.loss)


def test_empty_batch_is_allowed():
    assert model()(ids(0, LENGTH)).last_hidden_state.shape == (0, LENGTH, 16)
