"""torch.compile(model, fullgraph=True, dynamic=True): one graph (no breaks, no recompiles) across batch sizes and
lengths below and beyond position_buckets, the same outputs and gradients as eager, for every attention backend.

Dynamo's capture is checked with the cheap "eager" / "aot_eager" compiler backends (the graph is what breaks, not
the code generator); one slow test runs inductor end to end."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from parity import inflate_weights, padded_batch
from robustness import BACKENDS, dense_flex, skip_unless_supported, with_backend

import disentangled
from disentangled import DisentangledConfig


@pytest.fixture(autouse=True, scope="module")
def _dense_flex():
    with dense_flex():
        yield


# Everything on: three position terms, log buckets (8 per side), absolute positions, token types, conv, projections.
CONFIG = dict(
    tiny_models.TINY,
    vocab_size=64,
    num_hidden_layers=1,  # tracing time grows with depth; one layer exercises every path
    intermediate_size=48,
    position_buckets=8,
    max_relative_positions=32,
    pos_att_type="c2p|p2c|p2p",
    share_att_key=False,
    position_biased_input=True,
    type_vocab_size=2,
    conv_kernel_size=3,
    num_labels=3,
)
BATCHES = [[5, 3], [12, 7, 2], [29, 20, 11, 1]]  # first call traces; the others must reuse its graph


def batch_of(lengths: list[int]) -> dict:
    batch = padded_batch(64, lengths, seed=len(lengths))
    batch["token_type_ids"] = (torch.arange(max(lengths)) % 3 == 0).long().expand(len(lengths), -1).contiguous()
    return batch


def model_of(head: str, backend: str) -> torch.nn.Module:
    model = getattr(disentangled, head)(DisentangledConfig(**CONFIG))
    inflate_weights(model)
    return with_backend(model, backend)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_inference_one_graph_same_outputs(backend):
    model = model_of("DisentangledForTokenClassification", backend).eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="eager")
    with torch.no_grad():
        for i, lengths in enumerate(BATCHES):
            batch = batch_of(lengths)
            with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
                actual = compiled(**batch).logits
            expected = model(**batch).logits
            assert torch.isfinite(actual).all()
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # fullgraph=True raises on a graph break; fail_on_recompile raises on a new length or batch size
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_training_one_graph_same_loss_and_gradients(backend):
    """Forward and backward through AOTAutograd; the classification loss has no data-dependent branch."""
    skip_unless_supported(backend, "cpu-training")
    model = model_of("DisentangledForSequenceClassification", backend).train()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, lengths in enumerate(BATCHES):
        batch = batch_of(lengths)
        labels = torch.arange(len(lengths)) % 4 - 1  # -1: DeBERTa ignores negative labels
        results = []
        for run in (compiled, model):
            model.zero_grad()
            with torch.compiler.set_stance("fail_on_recompile" if i and run is compiled else "default"):
                loss = run(**batch, labels=labels).loss
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        (loss, grads), (expected_loss, expected_grads) = results
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
        assert len(grads) == len(expected_grads)
        for grad, expected in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.slow
def test_inductor_inference_dynamic_lengths():
    """The default compiler, end to end (about a minute of C++ compilation on two cores)."""
    model = model_of("DisentangledModel", "sdpa").eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for i, lengths in enumerate(BATCHES):
            batch = batch_of(lengths)
            with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
                actual = compiled(**batch).last_hidden_state
            torch.testing.assert_close(actual, model(**batch).last_hidden_state, rtol=1e-4, atol=1e-4)
