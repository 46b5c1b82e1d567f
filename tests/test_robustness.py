"""Property-based robustness: over small random configs, heads, lengths, paddings, masks and dtypes,

- every attention backend agrees with the eager reference,
- a sequence's outputs at its real positions do not depend on its padding or on its batch neighbours,
- a row that is all padding gives finite outputs,
- random bad input raises a ValueError, never an IndexError, a RuntimeError or a crash.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from robustness import (
    BACKENDS,
    HEADS,
    MAX_POSITIONS,
    POOLED,
    PROPERTY_SETTINGS,
    TOLERANCE,
    VOCAB,
    alone,
    build,
    configs,
    dense_flex,
    pad,
    per_sequence_error,
    run,
    sequences,
    with_backend,
)


@pytest.fixture(autouse=True, scope="module")
def _dense_flex():
    with dense_flex():
        yield


lengths = st.lists(st.integers(1, 20), min_size=1, max_size=3)


@settings(max_examples=30, **PROPERTY_SETTINGS)
@given(
    config=configs(),
    head=st.sampled_from(list(HEADS)),
    lengths=lengths,
    extra=st.integers(0, 5),
    side=st.sampled_from(["right", "left"]),
    mask_kind=st.sampled_from(["tokens", "pairwise", "bool"]),
    seed=st.integers(0, 2**16),
)
def test_padding_invariance_and_backend_agreement_float32(config, head, lengths, extra, side, mask_kind, seed):
    if head in POOLED:
        side = "right"  # the pooler reads the first token, which left padding moves
    model = build(head, config, seed=seed)
    seqs = sequences(lengths, config, seed)
    references = alone(model, head, seqs)  # eager, unpadded, one sequence at a time
    batch = pad(seqs, extra, side, mask_kind, all_padding_row=True)
    for backend in BACKENDS:
        outputs = run(with_backend(model, backend), head, batch)
        for name, value in outputs.items():
            assert torch.isfinite(value).all(), f"{backend}: {name} is not finite (all-padding row included)"
        error = per_sequence_error(head, outputs, references, batch.spans)
        assert error <= TOLERANCE[torch.float32], f"{backend}: {error:.2e}"


@settings(max_examples=15, **PROPERTY_SETTINGS)
@given(
    config=configs(),
    head=st.sampled_from(["Model", "MaskedLM", "SequenceClassification"]),
    lengths=lengths,
    extra=st.integers(0, 5),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_low_precision_backends_agree_and_stay_close_to_float32(config, head, lengths, extra, dtype, seed):
    """In bfloat16 and float16, padded batches on every backend stay within TOLERANCE[dtype] of eager float32
    run one sequence at a time, and stay finite (the all-padding row included)."""
    model = build(head, config, seed=seed)
    seqs = sequences(lengths, config, seed)
    references = alone(model, head, seqs)
    batch = pad(seqs, extra, all_padding_row=True)
    model.to(dtype)
    for backend in BACKENDS:
        outputs = run(with_backend(model, backend), head, batch)
        for name, value in outputs.items():
            assert torch.isfinite(value).all(), f"{backend} {dtype}: {name} is not finite"
        error = per_sequence_error(head, outputs, references, batch.spans)
        assert error <= TOLERANCE[dtype], f"{backend} {dtype}: {error:.2e}"


@st.composite
def bad_inputs(draw):
    """Inputs of random shapes and values around the valid ones: some valid, most not."""
    batch, length = draw(st.integers(0, 3)), draw(st.integers(0, MAX_POSITIONS + 3))

    def maybe_wrong(shape):  # mostly the right shape, sometimes one dimension off or missing
        choice = draw(st.integers(0, 9))
        if choice == 0:
            return shape[:-1]
        if choice == 1:
            return [*shape[:-1], shape[-1] + 1]
        if choice == 2:
            return [shape[0] + 1, *shape[1:]]
        return shape

    def integers(shape, low, high):
        return torch.randint(low, high, shape) if all(shape) else torch.zeros(shape, dtype=torch.long)

    inputs = {}
    given = draw(st.sampled_from(["ids"] * 7 + ["embeds", "embeds", "both", "neither"]))
    if given in ("embeds", "both"):
        inputs["inputs_embeds"] = torch.randn(*maybe_wrong([batch, length]), draw(st.sampled_from([16, 16, 7])))
    if given in ("ids", "both"):
        ids_shape = maybe_wrong([batch, length])
        inputs["input_ids"] = integers(ids_shape, draw(st.sampled_from([0, -3])), VOCAB + draw(st.sampled_from([0, 3])))
        if draw(st.integers(0, 9)) == 0:
            inputs["input_ids"] = inputs["input_ids"].float()
    if draw(st.booleans()):
        mask = torch.ones(maybe_wrong([batch, length]))
        if draw(st.booleans()) and mask.numel():
            mask[..., -1] = draw(st.sampled_from([0.0, -10000.0, 2.0]))
        inputs["attention_mask"] = mask
    if draw(st.booleans()):
        inputs["token_type_ids"] = integers(maybe_wrong([batch, length]), 0, draw(st.sampled_from([1, 2, 4])))
    if draw(st.booleans()):
        inputs["position_ids"] = integers(maybe_wrong([1, length]), 0, draw(st.sampled_from([MAX_POSITIONS, 99])))
    if draw(st.booleans()):
        labels_shape = draw(st.sampled_from([[batch], [batch, length], [batch + 1]]))
        inputs["labels"] = integers(labels_shape, draw(st.sampled_from([0, -100, -1])), draw(st.sampled_from([3, 9])))
    return inputs


@pytest.mark.parametrize("head", ["MaskedLM", "SequenceClassification", "TokenClassification"])
def test_random_bad_input_raises_only_value_errors(head):
    @settings(max_examples=60, **PROPERTY_SETTINGS)
    @given(config=configs(), inputs=bad_inputs())
    def check(config, inputs):
        config.hidden_size, config.embedding_size = 16, None  # so that inputs_embeds of width 16 can be valid
        config.num_attention_heads, config.attention_head_size = 2, None
        model = build(head, config)
        try:
            with torch.no_grad():
                output = model(**inputs)
        except ValueError as error:
            event(f"ValueError: {str(error).split()[0]}")
            return
        event("accepted")
        # Accepted: then the output is finite.
        assert torch.isfinite(output.logits).all()
        if output.loss is not None:
            assert torch.isfinite(output.loss)

    check()
