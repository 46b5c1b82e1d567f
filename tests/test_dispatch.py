"""The one function that decides the attention path (`modeling/dispatch.py`): each path from the facts that lead to
it, each with a reason that names the fact; the switches; and the decision is what runs (the backends dispatch on
it, nothing else decides). The Triton kernel's share of the decision is in tests/test_triton_attention.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from parity import inflate_weights, padded_batch

import disentangled
from disentangled import environment
from disentangled.modeling import (
    cpu_inference,
    cpu_training,
    dispatch,
    flex_attention,
    modeling_disentangled,
    native,
    sdpa_attention,
)
from disentangled.modeling.disentangled_attention import PositionScores, RelativePositions, _warned

V3_CALL = dict(device="cpu", dtype=torch.float32, head_size=64, length=512, heads=12, mask="keys", width=511)


@pytest.fixture
def compiled_kernel(monkeypatch):
    """The decision as on a processor where the compiled CPU kernels are built (AVX-512; fused bfloat16 on AMX)."""
    monkeypatch.setattr(dispatch, "native_built", lambda: True)
    monkeypatch.setattr(dispatch, "native_attend", lambda dtype: dtype in (torch.float32, torch.bfloat16))
    monkeypatch.setattr(dispatch, "native_workspace_bytes", lambda length, width: 2 * length * width * 4)


def decide(**facts) -> dispatch.Decision:
    return dispatch.decide(dispatch.Call(**{**V3_CALL, **facts}))


def fell_back(decision: dispatch.Decision, path: str) -> str:
    """The reason `path` was passed over."""
    return dict(decision.skipped)[path]


def test_cpu_inference_takes_the_fused_kernel_then_the_bias_kernel_then_pytorch(compiled_kernel, switch):
    assert decide().path == "cpu-fused" and not decide().skipped
    assert decide(dtype=torch.bfloat16).path == "cpu-fused"
    assert decide(mask="none").path == "cpu-fused"
    for facts, because in [(dict(head_size=32), "64 dimensions per head"), (dict(mask="pairs"), "query-key pairs")]:
        decision = decide(**facts)
        assert decision.path == "cpu-bias-kernel" and because in fell_back(decision, "cpu-fused"), facts
    decision = decide(dtype=torch.float16)
    assert decision.path == "cpu-by-distance" and "float32 or bfloat16, not float16" in fell_back(decision, "cpu-fused")
    decision = decide(tiled_columns=False)
    assert decision.path == "cpu-by-distance" and dispatch.UNTILED == fell_back(decision, "cpu-fused")
    decision = decide(head_size=32, length=32768)  # one sequence's p2c table too large for the bias kernel
    assert decision.path == "cpu-by-distance" and "KERNEL_TABLE_ELEMENTS" in fell_back(decision, "cpu-bias-kernel")
    switch(CPU_FUSED=False)
    assert decide().path == "cpu-bias-kernel" and "CPU_FUSED" in fell_back(decide(dtype=torch.bfloat16), "cpu-fused")
    switch(CPU_KERNEL=False)
    assert decide().path == "cpu-by-distance" and "CPU_KERNEL" in fell_back(decide(), "cpu-fused")


def test_bfloat16_without_amx_or_a_workspace_too_large_takes_the_bias_kernel(compiled_kernel, monkeypatch):
    monkeypatch.setattr(dispatch, "native_attend", lambda dtype: dtype == torch.float32)
    decision = decide(dtype=torch.bfloat16)
    assert decision.path == "cpu-bias-kernel" and "AMX" in fell_back(decision, "cpu-fused")
    monkeypatch.setattr(dispatch, "FUSED_WORKSPACE_BYTES", 1024)
    decision = decide()
    assert decision.path == "cpu-bias-kernel" and "FUSED_WORKSPACE_BYTES" in fell_back(decision, "cpu-fused")


def test_cpu_training_and_the_paths_that_leave_the_cpu_kernels(compiled_kernel, switch):
    training = dict(gradients=True, dropout=0.1)
    assert decide(**training).path == "cpu-training-kernel"
    assert decide(**training, dtype=torch.float16).path == "cpu-training"
    decision = decide(**training, terms=("c2p", "p2c", "p2p"))
    assert decision.path == "sdpa-blocked" and "p2p" in decision.describe()
    assert decide(terms=("c2p", "p2p")).path == "sdpa-blocked"
    assert decide(dropout=0.1).path == "sdpa-blocked"  # a module in training mode under no_grad
    switch(TRAINING_KERNEL=False)
    decision = decide(**training)
    assert decision.path == "cpu-training" and "TRAINING_KERNEL" in fell_back(decision, "cpu-training-kernel")


def test_without_the_compiled_kernel_its_reason_is_given():
    """On this machine as it is: the paths that need the compiled kernel give native.why_unavailable()."""
    if native.available():
        pytest.skip("the compiled kernel runs here")
    decision = decide()
    assert decision.path == "cpu-by-distance" and native.why_unavailable() in fell_back(decision, "cpu-fused")
    assert decide(gradients=True).path == "cpu-training"


def test_in_the_hub_bundle_the_package_s_paths_are_passed_over(monkeypatch, switch):
    """As in the Hub bundle, which carries neither native.py nor kernel_check.py: CPU calls take the PyTorch paths and
    a CUDA call sdpa's blocked path (the Triton kernel only unchecked, DISENTANGLED_TRITON=1), each saying why; the
    line the model logs names each path it lacks."""
    monkeypatch.setattr(dispatch, "native", None)
    monkeypatch.setattr(dispatch, "kernel_check", None)
    decision = decide()
    assert decision.path == "cpu-by-distance" and dispatch.NOT_IN_THE_BUNDLE in fell_back(decision, "cpu-fused")
    decision = decide(gradients=True)
    assert decision.path == "cpu-training" and dispatch.NOT_IN_THE_BUNDLE in fell_back(decision, "cpu-training-kernel")
    monkeypatch.setattr(dispatch, "TRITON_AVAILABLE", True)
    cuda = dict(device="cuda", dtype=torch.float16, gpu="NVIDIA H100 80GB HBM3", capability=(9, 0))
    decision = decide(**cuda)
    assert decision.path == "sdpa-blocked" and dispatch.NOT_IN_THE_BUNDLE in fell_back(decision, "triton")
    switch(TRITON="1")
    assert decide(**cuda).path == "triton"
    for path in ("cpu-fused", "cpu-bias-kernel", "cpu-training-kernel", "triton"):
        assert path in dispatch.without_the_package()
    monkeypatch.setattr(dispatch, "native", native)
    assert dispatch.without_the_package() is None  # the package says nothing


def test_implementations_and_the_dense_paths(switch):
    assert decide(implementation="eager").path == "eager"
    decision = decide(output_attentions=True)
    assert decision.implementation == "eager" and "no probabilities" in decision.skipped[0][1]
    assert decide(implementation="flex_attention").path == "flex"
    for facts, because in [
        (dict(gradients=True), "inference only on CPU"),
        (dict(dropout=0.1), "no attention dropout"),
    ]:
        decision = decide(implementation="flex_attention", **facts)
        assert decision.implementation == "sdpa" and because in fell_back(decision, "flex"), facts
    assert decide(implementation="flex_attention", device="cuda", gradients=True, capability=(9, 0)).path == "flex"
    assert decide(implementation="my_attention").path == "registered"
    assert decide(terms=()).path == "sdpa-dense" and decide(tracing=True).path == "sdpa-dense"
    switch(FLEX_COMPILED=False)
    assert decide(implementation="flex_attention").path == "flex-reference"


def test_switched_checks_names_and_values_and_puts_them_back():
    with pytest.raises(ValueError, match="no switch named USE_KERNEL; the switches are TRITON, CPU_KERNEL"):
        with dispatch.switched(USE_KERNEL=False):
            pass
    with pytest.raises(ValueError, match="set it to 0 .* 1 .* or check"):
        with dispatch.switched(TRITON="on"):
            pass
    assert dispatch.TRITON in dispatch.TRITON_VALUES
    with pytest.raises(RuntimeError, match="inside"):
        with dispatch.switched(CPU_KERNEL=False, KEEP_WORKSPACE=False):
            assert not dispatch.CPU_KERNEL and not dispatch.KEEP_WORKSPACE
            raise RuntimeError("inside")
    assert dispatch.CPU_KERNEL and dispatch.KEEP_WORKSPACE
    assert set(dispatch.switches()) == set(dispatch.SWITCHES)


def test_the_triton_switch_is_read_from_the_environment():
    """DISENTANGLED_TRITON sets dispatch.TRITON when the module is imported; a bad value is named when a call is
    decided, with the values it takes."""
    script = (
        "import torch\nfrom disentangled.modeling import dispatch\nprint(dispatch.TRITON)\n"
        "call = dispatch.Call(device='cuda', gpu='G', capability=(9, 0))\n"
        "try:\n    dispatch.decide(call)\nexcept ValueError as error:\n    print(error)\n"
    )
    for value, expected in [("0", "0"), ("nonsense", "set it to 0")]:
        environment = {**os.environ, "DISENTANGLED_TRITON": value}
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment)
        assert result.returncode == 0 and expected in result.stdout, result.stderr[-2000:]


def test_call_facts_read_the_tensors():
    query = torch.randn(2, 4, 24, 32, requires_grad=True)
    positions = RelativePositions.build(24, 8, 8, 64, "cpu")
    scores = PositionScores(query, query, None, query[0, :, :15], None, positions)
    keys = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    call = dispatch.call_facts(query, query, query, keys, scores, 0.1, "sdpa")
    assert (call.device, call.dtype, call.head_size, call.length, call.heads) == ("cpu", torch.float32, 32, 24, 4)
    assert call.gradients and call.dropout == 0.1 and call.mask == "keys" and call.terms == ("p2c",)
    assert call.width == positions.width and call.uniform
    with torch.no_grad():
        assert not dispatch.call_facts(query, query, query, None, scores).gradients
    assert dispatch.call_facts(query, query, query, keys.expand(2, 1, 24, 24), None).mask == "pairs"
    assert dispatch.call_facts(query, query, query, keys.float(), None).mask == "other"
    assert not dispatch.call_facts(query, query.half(), query, None, None).uniform
    assert dispatch.call_facts(query, query, query, None, None).terms == ()


TINY = dict(
    vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
    position_buckets=16, max_relative_positions=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.1,
)  # fmt: skip


def ran_paths(monkeypatch) -> tuple[list, list]:
    """(the decisions the layers took, the paths that then ran), recorded at the functions each path calls; the
    backend deciding again fails the test."""
    decisions, ran = [], []
    decide_ = modeling_disentangled.decide
    monkeypatch.setattr(modeling_disentangled, "decide", lambda call: decisions.append(decide_(call)) or decisions[-1])
    monkeypatch.setattr(sdpa_attention, "decide", lambda call: pytest.fail("the backend decided the call again"))
    by_distance, fused, blocked, apply = (
        cpu_inference._attend_by_distance,
        cpu_inference._attend_fused,
        sdpa_attention.blocked_attention,
        cpu_training.BlockedAttention.apply,
    )

    def distance(*args, path, **kwargs):
        ran.append(path)
        return by_distance(*args, path=path, **kwargs)

    def training(*args):
        ran.append("cpu-training-kernel" if args[-1] else "cpu-training")
        return apply(*args)

    monkeypatch.setattr(cpu_inference, "_attend_by_distance", distance)
    monkeypatch.setattr(cpu_inference, "_attend_fused", lambda *a: ran.append("cpu-fused") or fused(*a))
    monkeypatch.setattr(sdpa_attention, "blocked_attention", lambda *a: ran.append("sdpa-blocked") or blocked(*a))
    monkeypatch.setattr(cpu_training.BlockedAttention, "apply", training)
    return decisions, ran


@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch", "compiled-kernel"])
def test_the_decision_is_the_path_that_runs(monkeypatch, switch, kernel):
    """A model's calls on the CPU (inference, training, p2p, a training-mode module under no_grad) run exactly the
    path `decide` gave each; with the compiled kernel switched on where it builds, and off."""
    if kernel and not native.available():
        pytest.skip(f"the kernel does not run here: {native.why_unavailable()}")
    switch(CPU_KERNEL=kernel, TRAINING_KERNEL=kernel)
    batch = padded_batch(100, [40, 23])
    for overrides in ({}, dict(pos_att_type="c2p|p2c|p2p")):
        torch.manual_seed(0)
        model = disentangled.DisentangledModel(disentangled.DisentangledConfig(**TINY, **overrides))
        inflate_weights(model)
        model.set_attn_implementation("sdpa")
        decisions, ran = ran_paths(monkeypatch)
        with torch.no_grad():
            model.eval()(**batch)
            model.train()(**batch)
        model.train()(**batch).last_hidden_state.sum().backward()
        assert [decision.path for decision in decisions] == ran and len(ran) == 3, (overrides, ran)
        monkeypatch.undo()  # the recorders, before the next model's
        if "p2p" in overrides.get("pos_att_type", ""):
            assert ran == ["sdpa-blocked"] * 3
        else:
            assert ran[1] == "sdpa-blocked" and ran[2].startswith("cpu-training")


def test_the_model_warns_once_where_the_implementation_it_was_given_cannot_serve(monkeypatch, switch):
    """flex_attention with gradients on the CPU: sdpa serves, one warning says why (the decision's reason); the
    switch FLEX_COMPILED reaches the model through the decision (its dense reference runs)."""
    model = disentangled.DisentangledModel(disentangled.DisentangledConfig(**TINY))
    model.set_attn_implementation("flex_attention")
    batch = padded_batch(100, [40, 23])
    _warned.clear()
    with pytest.warns(UserWarning, match="compiled flex_attention runs inference only on CPU"):
        model.eval()(**batch)
    calls = []
    flex = flex_attention.flex_disentangled
    monkeypatch.setattr(modeling_disentangled, "flex_disentangled", lambda *a, **k: calls.append(k) or flex(*a, **k))
    switch(FLEX_COMPILED=False)
    with torch.no_grad():
        model.eval()(**batch)
    assert calls and all(call["compiled"] is False for call in calls)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_one_decision_per_layer_call(monkeypatch, implementation):
    """`dispatch.decide` is asked once per attention call: a 3-layer model's forward counts 3, in inference and in
    training (the layer decides, the backend runs its decision); and the backend's table of runners holds every path
    of the dispatcher that sdpa serves."""
    asked = []
    decide_ = dispatch.decide
    for module in (modeling_disentangled, sdpa_attention):
        monkeypatch.setattr(module, "decide", lambda call: asked.append(call) or decide_(call))
    model = disentangled.DisentangledModel(disentangled.DisentangledConfig(**dict(TINY, num_hidden_layers=3)))
    model.set_attn_implementation(implementation)
    batch = padded_batch(100, [40, 23])
    with torch.no_grad():
        model.eval()(**batch)
    assert len(asked) == 3
    model.train()(**batch).last_hidden_state.sum().backward()
    assert len(asked) == 6
    assert set(sdpa_attention.RUNNERS) <= set(dispatch.PATHS)
    assert set(dispatch.PATHS) - set(sdpa_attention.RUNNERS) == {"eager", "flex", "flex-reference", "registered"}


def test_an_onnx_export_writes_the_path_decided(monkeypatch):
    """Exported within each graph kind, every layer's decision names the graph that was written: MultiHeadAttention
    nodes (onnx-fused), our operator's nodes (onnx-kernel) or neither (onnx-portable); `disentangled env` reports
    that path for an export of that kind."""
    pytest.importorskip("onnxscript")
    from disentangled.serving import onnx_attention, onnx_export

    sizes = {**TINY, "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 128}  # 64 per head
    model = disentangled.DisentangledModel(disentangled.DisentangledConfig(**sizes)).eval()
    inputs = onnx_export.example_inputs(model.config, "base", batch=2, length=11)
    decisions, decide_ = [], modeling_disentangled.decide
    monkeypatch.setattr(modeling_disentangled, "decide", lambda call: decisions.append(decide_(call)) or decisions[-1])
    for kind in ("fused", "kernel", "portable"):
        decisions.clear()
        with onnx_attention.graph(kind), onnx_export.quiet_exporter():
            graph = torch.onnx.export(model, (), kwargs=inputs, dynamo=True).model_proto.graph
        assert [decision.path for decision in decisions] == [f"onnx-{kind}"] * 2, kind
        assert onnx_export.multi_head_attention_nodes(graph) == (2 if kind == "fused" else 0)
        assert onnx_export.kernel_nodes(graph) == (2 if kind == "kernel" else 0)
        (row,) = [row for row in environment.paths([{"device": "cpu"}]) if row["mode"] == f"onnx {kind}"]
        assert row["path"] == decisions[0].path, kind


def test_an_onnx_export_takes_the_graph_asked_for_or_says_why_not():
    """The ONNX graph is a fact of the call (`Call.onnx`, from `dispatch.onnx_graph`): each kind its own path, and
    each fact that a graph cannot take falls back to the next, with the reason."""
    assert decide(onnx="fused").path == "onnx-fused" and decide(onnx="portable").path == "onnx-portable"
    assert decide(onnx="kernel").path == "onnx-kernel" and decide(onnx="kernel", mask="none").path == "onnx-kernel"
    for facts, because in [(dict(head_size=32), "64 dimensions"), (dict(mask="pairs"), "query-key pairs")]:
        decision = decide(onnx="kernel", **facts)
        assert decision.path == "onnx-fused" and because in fell_back(decision, "onnx-kernel"), facts
    for facts, because in [(dict(terms=("c2p", "p2c", "p2p")), "p2p"), (dict(torchscript=True), "TorchScript")]:
        for asked in ("fused", "kernel"):
            decision = decide(onnx=asked, **facts)
            assert decision.path == "onnx-portable" and because in fell_back(decision, f"onnx-{asked}"), facts
    assert decide(onnx="fused", terms=()).path == "sdpa-dense"  # no position terms: torch's own attention
    assert decide(onnx="fused", implementation="eager").path == "eager"


def test_the_onnx_graph_is_a_fact_of_the_calls_made_within_its_block():
    """`call_facts` reads the graph asked for only while an ONNX export runs; `onnx_graph` checks the kind, and the
    kernel graph comes with its writer."""
    query = torch.randn(1, 2, 8, 64)
    assert dispatch.call_facts(query, query, query, None, None).onnx is None  # no export running
    with dispatch.onnx_graph("portable"):
        assert dispatch.onnx_graph_asked().kind == "portable"
    assert dispatch.onnx_graph_asked().kind == "fused"  # the package's default
    with pytest.raises(ValueError, match="is not one of"):
        with dispatch.onnx_graph("dense"):
            pass
    with pytest.raises(ValueError, match="needs its writer"):
        with dispatch.onnx_graph("kernel"):
            pass
