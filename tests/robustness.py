"""Shared pieces of the robustness tests: random small configs (hypothesis), padded batches, per-sequence outputs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from parity import inflate_weights

import disentangled
from disentangled import DisentangledConfig
from disentangled.modeling import dispatch
from disentangled.modeling.modeling_disentangled import DISENTANGLED_ATTENTION_FUNCTIONS

# Reproducible in CI: the same examples every run, no wall-clock deadline on a loaded 2-core machine.
PROPERTY_SETTINGS = dict(
    deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("robustness", **PROPERTY_SETTINGS)

VOCAB = 40
MAX_POSITIONS = 48
BACKENDS = list(DISENTANGLED_ATTENTION_FUNCTIONS)
HEADS = {
    "Model": disentangled.DisentangledModel,
    "MaskedLM": disentangled.DisentangledForMaskedLM,
    "SequenceClassification": disentangled.DisentangledForSequenceClassification,
    "TokenClassification": disentangled.DisentangledForTokenClassification,
    "QuestionAnswering": disentangled.DisentangledForQuestionAnswering,
    "MultipleChoice": disentangled.DisentangledForMultipleChoice,
}
# What a backend cannot do here (CPU), and why: a test that needs it skips that backend, every other test runs it.
LIMITS = {
    "flex_attention": {
        "onnx": "ONNX has no FlexAttention operator; export with eager or sdpa",
        "cpu-training": "flex_attention has no CPU backward (the model runs sdpa for gradients there)",
    },
}
POOLED = ("SequenceClassification", "MultipleChoice")  # one output per sequence, read from its first token
# Relative to the output's scale, max(1, max|reference|): float32, then what low precision reaches on CPU.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 6e-2, torch.float16: 1e-2}


def skip_unless_supported(backend: str, capability: str) -> None:
    if reason := LIMITS.get(backend, {}).get(capability):
        pytest.skip(f"{backend}: {reason}")


@contextlib.contextmanager
def dense_flex():
    """flex_attention's dense reference of the same score_mod instead of its kernel, which compiles per shape (about
    a minute each on a CI CPU)."""
    with dispatch.switched(FLEX_COMPILED=False):
        yield


@st.composite
def configs(draw) -> DisentangledConfig:
    """Small configs over the switches that change the numerics: terms, buckets, projections, embeddings, conv."""
    heads = draw(st.sampled_from([1, 2, 4]))
    hidden = draw(st.sampled_from([16, 32]))
    relative = draw(st.booleans()) or draw(st.booleans())  # mostly on
    terms = draw(st.lists(st.sampled_from(["c2p", "p2c", "p2p"]), unique=True, max_size=3))
    buckets = draw(st.sampled_from([-1, 4, 8]))
    if buckets > 0:
        max_relative = draw(st.sampled_from([-1, buckets // 2 + 2, 64]))  # the smallest valid reach
    else:
        max_relative = draw(st.sampled_from([-1, 3, 16]))
    conv = draw(st.sampled_from([0, 0, 3]))
    return DisentangledConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=draw(st.integers(1, 2)),
        num_attention_heads=heads,
        attention_head_size=draw(st.sampled_from([None, 8])),
        intermediate_size=24,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=MAX_POSITIONS,
        relative_attention=relative,
        pos_att_type=terms,
        position_buckets=buckets,
        max_relative_positions=max_relative,
        share_att_key=draw(st.booleans()),
        position_biased_input=draw(st.booleans()),
        type_vocab_size=draw(st.sampled_from([0, 2])),
        norm_rel_ebd=draw(st.sampled_from(["layer_norm", "none"])),
        conv_kernel_size=conv,
        conv_groups=draw(st.sampled_from([1, 2])) if conv else 1,
        embedding_size=draw(st.sampled_from([None, 24])),
        legacy=draw(st.booleans()),
        num_labels=3,
    )


def build(head: str, config: DisentangledConfig, backend: str = "eager", seed: int = 0) -> torch.nn.Module:
    if head == "QuestionAnswering":
        config = DisentangledConfig.from_dict({**config.to_dict(), "num_labels": 2})
    model = HEADS[head](config)
    inflate_weights(model, seed)
    model.config._attn_implementation = backend
    return model.eval()


def with_backend(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    model.config._attn_implementation = backend
    return model


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L] or [B, L, L]
    token_type_ids: torch.Tensor | None
    position_ids: torch.Tensor | None
    spans: list[tuple[int, int]]  # where each sequence's real tokens are: (start, length)


def sequences(lengths: list[int], config: DisentangledConfig, seed: int) -> list[dict]:
    """One unpadded sequence per length: token ids and, where the model has them, token types."""
    generator = torch.Generator().manual_seed(seed)
    result = []
    for length in lengths:
        sequence = {"input_ids": torch.randint(1, VOCAB, (length,), generator=generator)}
        if config.type_vocab_size:
            sequence["token_type_ids"] = torch.randint(0, config.type_vocab_size, (length,), generator=generator)
        result.append(sequence)
    return result


def pad(
    seqs: list[dict], extra: int, side: str = "right", mask_kind: str = "tokens", all_padding_row: bool = False
) -> Batch:
    """Pad to the longest + `extra`; left padding passes position_ids so that absolute positions stay put."""
    longest = max(len(s["input_ids"]) for s in seqs) + extra
    rows = len(seqs) + all_padding_row
    input_ids = torch.zeros(rows, longest, dtype=torch.long)
    token_mask = torch.zeros(rows, longest, dtype=torch.long)
    has_types = "token_type_ids" in seqs[0]
    token_type_ids = torch.zeros(rows, longest, dtype=torch.long) if has_types else None
    position_ids = torch.zeros(rows, longest, dtype=torch.long)
    spans = []
    for row, sequence in enumerate(seqs):
        length = len(sequence["input_ids"])
        start = longest - length if side == "left" else 0
        input_ids[row, start : start + length] = sequence["input_ids"]
        token_mask[row, start : start + length] = 1
        if has_types:
            token_type_ids[row, start : start + length] = sequence["token_type_ids"]
        position_ids[row, start : start + length] = torch.arange(length)
        spans.append((start, length))
    if mask_kind == "pairwise":
        attention_mask = token_mask[:, :, None] * token_mask[:, None, :]
    elif mask_kind == "bool":
        attention_mask = token_mask.bool()
    else:
        attention_mask = token_mask
    return Batch(input_ids, attention_mask, token_type_ids, position_ids if side == "left" else None, spans)


def run(model: torch.nn.Module, head: str, batch: Batch, dtype=None) -> dict[str, torch.Tensor]:
    """The head's outputs with the batch dimension first, one row per sequence, in float32."""
    inputs = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "token_type_ids": batch.token_type_ids,
        "position_ids": batch.position_ids,
    }
    if head == "MultipleChoice":  # the sequences are the choices of one question
        inputs = {k: v.unsqueeze(0) if v is not None else None for k, v in inputs.items()}
    with torch.no_grad():
        output = model(**inputs)
    if head == "Model":
        outputs = {"last_hidden_state": output.last_hidden_state}
    elif head == "QuestionAnswering":
        outputs = {"start_logits": output.start_logits, "end_logits": output.end_logits}
    else:
        outputs = {"logits": output.logits.squeeze(0) if head == "MultipleChoice" else output.logits}
    return {name: value.float() for name, value in outputs.items()}


def alone(model: torch.nn.Module, head: str, seqs: list[dict]) -> list[dict[str, torch.Tensor]]:
    """Each sequence run on its own, without padding: the reference for padded batches."""
    return [run(model, head, pad([sequence], extra=0)) for sequence in seqs]


def per_sequence_error(
    head: str, outputs: dict[str, torch.Tensor], references: list[dict[str, torch.Tensor]], spans
) -> float:
    """Largest |batched - alone| at real positions, relative to the output's scale max(1, max|alone|)."""
    worst = 0.0
    for row, ((start, length), reference) in enumerate(zip(spans, references)):
        for name, expected in reference.items():
            actual = outputs[name][row]
            if head not in POOLED:
                actual, expected = actual[start : start + length], expected[0, :length]
            else:
                expected = expected[0]
            scale = max(1.0, expected.abs().max().item())
            worst = max(worst, (actual - expected).abs().max().item() / scale)
    return worst
