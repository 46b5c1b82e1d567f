"""`export-onnx --kernel`: each layer's attention as our `disentangled::Attention` operator (`serving/ort_attention.c`)
in ONNX Runtime. The operator alone against the formula written here (softmax of scaled content scores, c2p and p2c
read by bucket, masked keys left out, a sequence of padding attending uniformly), with absent optional inputs and
ragged lengths; the exported graph against PyTorch within 1e-5 for every head, on padded batches, v3's log buckets
and v2's absolute positions and separate projections; transformers' DeBERTa accelerated in place and exported by
torch.onnx.export itself; the refusals (both graphs asked for, bad shapes, no operator library)."""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from parity import inflate_weights
from test_onnx_export import CONFIGS as EXPORT_CONFIGS
from test_onnx_export import (
    HEADS,
    SHAPES,
    TOLERANCE,
    accelerated_deberta,
    assert_matches_transformers,
    export_as_gliner_does,
    run_cli,
)

import disentangled
from disentangled import DisentangledConfig
from disentangled.modeling import native
from disentangled.modeling.disentangled_attention import RelativePositions
from disentangled.serving import onnx_attention, onnx_export, ort_operator

onnxruntime = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytestmark = pytest.mark.skipif(
    ort_operator.why_unavailable() is not None, reason=f"no operator library: {ort_operator.why_unavailable()}"
)

# 64 dimensions per head, as the operator (and every released DeBERTa) has
WIDE = dict(
    vocab_size=64,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=96,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
# the export tests' v3 and v2 settings, and a model with c2p alone
CONFIGS = {**EXPORT_CONFIGS, "c2p-only": dict(position_buckets=8, max_relative_positions=64, pos_att_type="c2p")}


def save_model(tmp_path, head: str, config_name: str):
    config = DisentangledConfig(**WIDE, **CONFIGS[config_name])
    if head == "DisentangledForQuestionAnswering":
        config.num_labels = 2
    model = getattr(disentangled, head)(config)
    inflate_weights(model)
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def operator_graph(with_key: bool, with_query: bool, with_keep: bool, heads: int, scale: float):
    """A graph of one disentangled::Attention node."""
    helper, float32 = onnx.helper, onnx.TensorProto.FLOAT
    names = ["query", "key", "value", "pos_key" if with_key else "", "pos_query" if with_query else ""]
    names += ["column", "c2p_column", "keep" if with_keep else ""]
    types = {"column": onnx.TensorProto.INT32, "c2p_column": onnx.TensorProto.INT32, "keep": onnx.TensorProto.UINT8}
    inputs = [helper.make_tensor_value_info(name, types.get(name, float32), None) for name in names if name]
    node = helper.make_node("Attention", names, ["out"], domain=ort_operator.DOMAIN, heads=heads, scale=scale)
    graph = helper.make_graph([node], "attention", inputs, [helper.make_tensor_value_info("out", float32, None)])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(ort_operator.DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def reference(query, key, value, pos_key, pos_query, column, keep, scale):
    """The formula, element by element of the distance: [B, H, L, D] in, [B, L, H * D] out."""
    batch, heads, length, dim = query.shape
    scores = scale * query @ key.mT
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    bucket = column[i - j + length - 1]  # [L, L]: the table row of each pair's distance
    if pos_key is not None:  # c2p[i, j] = q_i . Kr[c(i - j)]
        scores = scores + torch.einsum("bhid,hijd->bhij", query, pos_key[:, bucket])
    if pos_query is not None:  # p2c[i, j] = k_j . Qr[c(i - j)]
        scores = scores + torch.einsum("bhjd,hijd->bhij", key, pos_query[:, bucket])
    if keep is not None:
        scores = scores.masked_fill(~keep.bool()[:, None, None, :], -math.inf)
    weights = scores.softmax(-1)
    if keep is not None:  # a sequence of padding: uniform over every key
        empty = ~keep.bool().any(-1)
        weights[empty] = 1.0 / length
    return (weights @ value).transpose(1, 2).reshape(batch, length, heads * dim)


@pytest.mark.parametrize(
    ("length", "terms", "masked"),
    [(1, "both", True), (37, "both", True), (130, "both", False), (37, "c2p", True), (50, "p2c", False)],
)
def test_the_operator_computes_the_formula(length, terms, masked):
    torch.manual_seed(length)
    batch, heads, dim, scale = 3, 2, 64, 0.125
    positions = RelativePositions.build(length, span=8, bucket_size=8, max_position=64, device="cpu")
    width = positions.width
    query, key, value = (torch.randn(batch, heads, length, dim) for _ in range(3))
    pos_key = torch.randn(heads, width, dim) * 0.1 if terms in ("both", "c2p") else None
    pos_query = torch.randn(heads, width, dim) * 0.1 if terms in ("both", "p2c") else None
    keep = None
    if masked:
        keep = torch.ones(batch, length, dtype=torch.uint8)
        keep[0, (length + 1) // 2 :] = 0
        keep[1] = 0  # a sequence of padding only
    column = positions.column.to(torch.int32)
    c2p_column = (width - 1) - column.flip(0)
    feeds = {
        "query": query.transpose(1, 2).reshape(batch, length, heads * dim),
        "key": key.transpose(1, 2).reshape(batch, length, heads * dim),
        "value": value.transpose(1, 2).reshape(batch, length, heads * dim),
        "column": column,
        "c2p_column": c2p_column,
    }
    if pos_key is not None:
        feeds["pos_key"] = onnx_attention.kernel_tables(pos_key, reverse=True)
    if pos_query is not None:
        feeds["pos_query"] = onnx_attention.kernel_tables(pos_query, reverse=False)
    if keep is not None:
        feeds["keep"] = keep
    model = operator_graph(pos_key is not None, pos_query is not None, keep is not None, heads, scale)
    options = onnxruntime.SessionOptions()
    ort_operator.register(options)
    runner = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    (actual,) = runner.run(None, {name: value.contiguous().numpy() for name, value in feeds.items()})
    expected = reference(query, key, value, pos_key, pos_query, positions.column, keep, scale)
    difference = (torch.from_numpy(actual) - expected).abs().max().item()
    print(f"operator vs formula, {batch}x{length}, {terms}, masked {masked}: {difference:.1e}")
    assert difference <= TOLERANCE


def test_the_operator_refuses_bad_shapes():
    model = operator_graph(True, True, False, heads=2, scale=0.125)
    options = onnxruntime.SessionOptions()
    ort_operator.register(options)
    runner = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    length, width = 5, 16
    good = {
        "query": torch.zeros(1, length, 128),
        "key": torch.zeros(1, length, 128),
        "value": torch.zeros(1, length, 128),
        "pos_key": torch.zeros(2, width // 16, 64, 16),
        "pos_query": torch.zeros(2, width // 16, 64, 16),
        "column": torch.zeros(2 * length - 1, dtype=torch.int32),
        "c2p_column": torch.zeros(2 * length - 1, dtype=torch.int32),
    }
    for name, bad, message in [
        ("key", torch.zeros(1, length + 1, 128), "key and value must have the query's shape"),
        ("query", torch.zeros(1, length, 96), "query must be [B, L, heads * 64]"),
        ("pos_query", torch.zeros(2, 2, 64, 16), "pos_key and pos_query must be"),
        ("column", torch.zeros(length, dtype=torch.int32), "column and c2p_column must be [2L - 1]"),
    ]:
        feeds = {**good, name: bad}
        with pytest.raises(Exception, match=re.escape(message)):
            runner.run(None, {key: value.numpy() for key, value in feeds.items()})


CASES = [(head, "v3") for head in HEADS] + [("DisentangledForMultipleChoice", "v2"), ("DisentangledModel", "c2p-only")]


@pytest.mark.parametrize(("head", "config_name"), CASES, ids=[f"{head}-{name}" for head, name in CASES])
def test_every_head_matches_pytorch(tmp_path, head, config_name):
    folder = save_model(tmp_path, head, config_name)
    model, task = onnx_export.load_model(folder)
    path = tmp_path / "model.onnx"
    onnx_export.export(model, task, path, kernel=True)
    graph = onnx.load(str(path)).graph
    assert onnx_export.kernel_nodes(graph) == WIDE["num_hidden_layers"]
    assert onnx_export.multi_head_attention_nodes(graph) == 0
    # no [B, H, L, L] gather left: the graph gathers nothing wider than a row of embeddings
    figures = onnx_export.parity(model, task, path, SHAPES + ([(2, 80)] if config_name == "v3" else []))
    print(head, config_name, {f"{b}x{n}": f"{f['max_abs_diff']:.1e}" for (b, n), f in figures.items()})
    assert max(onnx_export.relative_error(figure) for figure in figures.values()) <= TOLERANCE, figures


def test_the_command_writes_the_kernel_graph(tmp_path, capsys):
    folder = save_model(tmp_path, "DisentangledForSequenceClassification", "v3")
    output = tmp_path / "model.onnx"
    assert run_cli(str(folder), str(output), "--kernel") == 0
    printed = capsys.readouterr()
    assert "disentangled::Attention" in printed.out and "wrote" in printed.out
    assert "Warning" not in printed.out + printed.err
    library = ort_operator.library_name()
    assert sorted(path.name for path in tmp_path.iterdir()) == [ort_operator.SIDECAR, library, "model", "model.onnx"]
    assert f"and beside it {library}" in printed.out
    described = json.loads((tmp_path / ort_operator.SIDECAR).read_text())
    assert described["operator"] == "disentangled::Attention" and described["version"] == ort_operator.OPERATOR_VERSION
    assert described["libraries"][library]["instruction_sets"] == list(ort_operator.UNITS[ort_operator.machine_kind()])
    graph = onnx.load(str(output)).graph
    assert onnx_export.kernel_nodes(graph) == 2
    # the feed-forward's bias and exact GELU, one node per layer (lean_graph's fusion)
    assert sum(node.op_type == "BiasGelu" for node in graph.node) == 2
    assert not any(node.op_type == "Erf" for node in graph.node)
    assert run_cli(str(folder), str(tmp_path / "b.onnx"), "--kernel", "--portable") == 2
    assert "--portable and --kernel" in capsys.readouterr().err
    assert not (tmp_path / "b.onnx").exists()


def test_without_the_library_the_command_says_why(tmp_path, capsys, monkeypatch):
    folder = save_model(tmp_path, "DisentangledModel", "v3")
    monkeypatch.setattr(native, "instruction_set", lambda: ("none", "no vector set here (a test)"))
    monkeypatch.setattr(ort_operator, "_state", {})
    assert run_cli(str(folder), str(tmp_path / "a.onnx"), "--kernel") == 2
    error = capsys.readouterr().err
    assert "no vector set here (a test)" in error and "without --kernel" in error
    assert not (tmp_path / "a.onnx").exists()


def test_accelerated_transformers_deberta_exports_the_kernel_graph(tmp_path):
    """GLiNER's way with the kernel graph: transformers' DeBERTa-v2 accelerated in place, torch.onnx.export inside
    `onnx_attention.graph("kernel")`; matches transformers' float32 outputs at the real tokens."""
    reference, model = accelerated_deberta(WIDE)
    path = tmp_path / "accelerated.onnx"
    with onnx_attention.graph("kernel"), onnx_export.quiet_exporter():
        export_as_gliner_does(model, path)
    assert onnx_export.kernel_nodes(onnx.load(str(path)).graph) == reference.config.num_hidden_layers
    assert_matches_transformers(reference, path)


def test_the_kernel_graph_quantizes(tmp_path, capsys, monkeypatch):
    """--kernel --quantize int8: the projections become int8 kernels, the attention stays our operator, no error on
    the way (the quantizer's pre-processing runs with the operator's library loaded). Without --check-texts the
    agreement on generated inputs is reported and never refuses the graph (this untrained model flips a prediction
    of 64 on some processors); the same figures from texts refuse it."""
    folder = save_model(tmp_path, "DisentangledForSequenceClassification", "v3")
    output = tmp_path / "int8.onnx"
    assert run_cli(str(folder), str(output), "--kernel", "--quantize", "int8") == 0
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err and "Failed" not in printed.out + printed.err
    reported = re.findall(r"vs float32 PyTorch on batch \d+, length \d+: argmax agreement \d", printed.out)
    assert len(reported) == 2 and "checked on generated inputs (random token ids)" in printed.out
    assert "prediction check failed" not in printed.out and f"wrote {output}" in printed.out
    graph = onnx.load(str(output)).graph
    assert onnx_export.kernel_nodes(graph) == 2
    assert any(node.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for node in graph.node)
    # the decision itself, on this graph: a low agreement is reported on generated inputs, refused on texts
    model, task = onnx_export.load_model(folder)
    real = onnx_export.compare_predictions
    monkeypatch.setattr(onnx_export, "compare_predictions", lambda *a, **k: {**real(*a, **k), "agreement": 0.5})
    assert onnx_export.check_predictions(model, task, output, 0.99) == 0
    assert "argmax agreement 0.5000 is below 0.99 there" in capsys.readouterr().out
    batches = [onnx_export.example_inputs(model.config, task, 8, 20, seed=1)]  # stand-ins for tokenized texts
    monkeypatch.setattr(onnx_export, "text_batches", lambda model_dir, config, texts: batches)
    assert onnx_export.check_predictions(model, task, output, 0.99, folder, ["a text"]) == 1
    assert "prediction check failed: argmax agreement 0.5000 < 0.99" in capsys.readouterr().out


def test_the_serving_page_kernel_recipe(tmp_path, monkeypatch):
    """docs/serving.md's `--kernel` session block, read from the page and run as written on a graph exported here;
    the session it makes computes the model."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    block = re.search(
        r"<!-- covered: tests/test_onnx_kernel.py::test_the_serving_page_kernel_recipe[^\n]*\n```python\n(.*?)```",
        page,
        re.S,
    )
    assert block, "the --kernel session block of docs/serving.md"
    folder = save_model(tmp_path, "DisentangledModel", "v3")
    model, task = onnx_export.load_model(folder)
    onnx_export.export(model, task, tmp_path / "model-kernel.onnx", kernel=True)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block[1], "docs/serving.md", "exec"), namespace)  # noqa: S102  (the page's own code)
    inputs = onnx_export.example_inputs(model.config, "base", batch=3, length=20, seed=3)
    (actual,) = namespace["kernel_session"].run(None, {name: value.numpy() for name, value in inputs.items()})
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
    assert (torch.from_numpy(actual) - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("kernel", [False, True], ids=["default-graph", "kernel-graph"])
def test_on_onnxruntimes_cuda_provider(tmp_path, kernel):
    """Where onnxruntime-gpu is installed with a GPU: the default graph runs on CUDAExecutionProvider
    (MultiHeadAttention has a CUDA kernel), the kernel graph with our node on the CPU and the rest on the GPU; both
    match PyTorch (1e-4: the GPU's float32 products sum in another order)."""
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers() or not torch.cuda.is_available():
        pytest.skip("no CUDA provider in this onnxruntime, or no GPU (a GPU session runs this)")
    folder = save_model(tmp_path, "DisentangledModel", "v3")
    model, task = onnx_export.load_model(folder)
    path = tmp_path / "model.onnx"
    onnx_export.export(model, task, path, kernel=kernel)
    onnx_export.lean_graph(path, fuse=True)
    options = onnxruntime.SessionOptions()
    if kernel:
        ort_operator.register(options)
    runner = onnxruntime.InferenceSession(
        str(path), options, providers=["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    assert runner.get_providers()[0] == "CUDAExecutionProvider"
    for batch, length in [(3, 5), (2, 80)]:
        inputs = onnx_export.example_inputs(model.config, "base", batch, length, seed=length)
        with torch.no_grad():
            expected = model(**inputs).last_hidden_state
        (actual,) = runner.run(None, {name: value.numpy() for name, value in inputs.items()})
        difference = (torch.from_numpy(actual) - expected).abs().max().item()
        print(f"CUDA provider, {'kernel' if kernel else 'default'} graph, {batch}x{length}: {difference:.1e}")
        assert difference <= 1e-4


@pytest.mark.parametrize("threads", [1, 3])
def test_threads_share_one_kernel_session(tmp_path, threads):
    """Several threads calling one session at once (a server's way), with ONNX Runtime running the operator on 1 or
    3 threads of its own: every answer equals the one-thread, one-caller answer (the operator's workspaces are
    claimed per item, never shared by two items at once)."""
    import concurrent.futures

    folder = save_model(tmp_path, "DisentangledModel", "v3")
    model, task = onnx_export.load_model(folder)
    path = tmp_path / "model.onnx"
    onnx_export.export(model, task, path, kernel=True)
    runner = onnx_export.session(path, threads=threads)
    batches = [onnx_export.example_inputs(model.config, "base", 3, length, seed=length) for length in (7, 40, 90)]
    feeds = [{name: value.numpy() for name, value in inputs.items()} for inputs in batches]
    alone = [runner.run(None, feed)[0] for feed in feeds]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda index: runner.run(None, feeds[index % 3])[0], range(24)))
    for index, output in enumerate(together):
        assert (output == alone[index % 3]).all()
    for inputs, output in zip(batches, alone):
        with torch.no_grad():
            expected = model(**inputs).last_hidden_state
        assert (torch.from_numpy(output) - expected).abs().max().item() <= TOLERANCE


def shipped_library(folder) -> ctypes.CDLL:
    """The library `export-onnx --kernel` writes, loaded with ctypes (it needs no ONNX Runtime to answer)."""
    loaded = ctypes.CDLL(str(ort_operator.write_library(folder)))
    loaded.disentangled_instruction_set.restype = ctypes.c_char_p
    return loaded


def kernel_outputs(path, feeds: dict) -> list:
    options = onnxruntime.SessionOptions()
    ort_operator.register(options, graph=path)
    runner = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return runner.run(None, feeds)


def test_the_shipped_library_needs_only_the_c_library(tmp_path, monkeypatch):
    """The library written beside the graph, as the system's compiler builds it (CC unset: the sanitizer's runtimes
    are CI's, not the product's): ldd shows the C library, libm and the loader only (no OpenMP runtime), and it
    exports ONNX Runtime's entry and its two questions, none of its units' names."""
    if shutil.which("ldd") is None or shutil.which("nm") is None:
        pytest.skip("no ldd or nm here")
    monkeypatch.delenv("CC", raising=False)
    path = ort_operator.write_library(tmp_path)
    plain = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    linked = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=plain, check=True).stdout
    names = sorted(line.split()[0].rsplit("/", 1)[-1] for line in linked.splitlines() if line.strip())
    print(linked)
    assert all(
        re.fullmatch(r"linux-vdso\.so\.1|libc\.so\.6|libm\.so\.6|ld-linux[\w.-]*\.so\.\d", name) for name in names
    )
    exported = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    symbols = sorted(line.split()[-1] for line in exported.stdout.splitlines() if line.strip())
    assert symbols == ["RegisterCustomOps", "disentangled_instruction_set", "disentangled_operator_version"]


def test_the_library_runs_avx2_as_avx512(tmp_path, monkeypatch):
    """On a processor with AVX-512, DISENTANGLED_CPU_ISA=avx2 makes the shipped library run its AVX2 unit (the one
    an AVX2 server runs): the same numbers as its AVX-512 unit, and both PyTorch's within 1e-5, on padded batches
    of ragged lengths through a whole exported model."""
    if native._processor_sets()[0][0] != "avx512":
        pytest.skip("this processor has no AVX-512: the library runs its AVX2 unit already")
    folder = save_model(tmp_path, "DisentangledModel", "v3")
    model, task = onnx_export.load_model(folder)
    path = tmp_path / "model.onnx"
    onnx_export.export(model, task, path, kernel=True)
    library = shipped_library(tmp_path)
    batches = [onnx_export.example_inputs(model.config, "base", 3, length, seed=length) for length in (7, 40, 90)]
    feeds = [{name: value.numpy() for name, value in inputs.items()} for inputs in batches]
    outputs = {}
    for name in ("avx512", "avx2"):
        monkeypatch.setenv("DISENTANGLED_CPU_ISA", name)
        assert library.disentangled_instruction_set().decode() == name
        outputs[name] = [kernel_outputs(path, feed)[0] for feed in feeds]
    for inputs, avx512, avx2 in zip(batches, outputs["avx512"], outputs["avx2"]):
        with torch.no_grad():
            expected = model(**inputs).last_hidden_state
        between = abs(avx512 - avx2).max()
        print(f"{tuple(avx2.shape)}: AVX2 vs AVX-512 {between:.1e}, AVX2 vs PyTorch "
              f"{(torch.from_numpy(avx2) - expected).abs().max().item():.1e}")  # fmt: skip
        assert between <= 1e-6
        assert (torch.from_numpy(avx2) - expected).abs().max().item() <= TOLERANCE
        assert (torch.from_numpy(avx512) - expected).abs().max().item() <= TOLERANCE


def test_the_library_refuses_what_it_cannot_run(tmp_path, monkeypatch):
    """A set asked for that the library lacks is an ONNX Runtime error when the session is made; a graph written for
    another operator version too, naming both versions; the exported graph carries this version."""
    folder = save_model(tmp_path, "DisentangledModel", "v3")
    model, task = onnx_export.load_model(folder)
    path = tmp_path / "model.onnx"
    onnx_export.export(model, task, path, kernel=True)
    library = shipped_library(tmp_path)
    assert library.disentangled_operator_version() == ort_operator.OPERATOR_VERSION
    proto = onnx.load(str(path))
    domains = {opset.domain: opset.version for opset in proto.opset_import}
    assert domains[ort_operator.DOMAIN] == ort_operator.OPERATOR_VERSION
    nodes = [node for node in proto.graph.node if node.domain == ort_operator.DOMAIN]
    assert [onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "version")) for node in nodes] == [
        ort_operator.OPERATOR_VERSION
    ] * len(nodes)  # fmt: skip
    feed = {name: value.numpy() for name, value in onnx_export.example_inputs(model.config, "base", 2, 9).items()}
    for node in nodes:
        next(a for a in node.attribute if a.name == "version").i = ort_operator.OPERATOR_VERSION + 1
    onnx.save(proto, str(tmp_path / "later.onnx"))
    with pytest.raises(Exception, match=f"written for version {ort_operator.OPERATOR_VERSION + 1} of the operator"):
        kernel_outputs(tmp_path / "later.onnx", feed)
    monkeypatch.setenv("DISENTANGLED_CPU_ISA", "sse2")
    assert library.disentangled_instruction_set().decode().startswith("none: DISENTANGLED_CPU_ISA=sse2 names no set")
    with pytest.raises(Exception, match="disentangled::Attention cannot run here: DISENTANGLED_CPU_ISA=sse2"):
        kernel_outputs(path, feed)


EMULATED = (  # in ONNX Runtime under emulation: the set the library reports, then the session's outputs or error
    "import ctypes, sys, numpy, onnxruntime\n"
    "library = ctypes.CDLL(sys.argv[1])\n"
    "library.disentangled_instruction_set.restype = ctypes.c_char_p\n"
    "print(library.disentangled_instruction_set().decode())\n"
    "options = onnxruntime.SessionOptions()\n"
    "options.intra_op_num_threads = 1\n"
    "options.register_custom_ops_library(sys.argv[1])\n"
    "try:\n"
    "    runner = onnxruntime.InferenceSession('graph.onnx', options, providers=['CPUExecutionProvider'])\n"
    "except Exception as error:\n"
    "    sys.exit(str(error))\n"
    "numpy.save('out.npy', runner.run(None, dict(numpy.load('feeds.npz')))[0])\n"
)


@pytest.mark.parametrize("processor", ["Haswell", "Nehalem"])
def test_the_library_chooses_from_the_processor(tmp_path, monkeypatch, processor):
    """ONNX Runtime under qemu-user's x86-64 emulation of an AVX2 processor without AVX-512 (Haswell) and of one with
    neither set (Nehalem): the library loads (no vector instruction runs before the choice); on Haswell it runs its
    AVX2 unit and gives this machine's numbers, on Nehalem the session is refused with the reason. Built as shipped
    (CC unset: a sanitizer's build needs its runtime preloaded, which the emulated Python has not)."""
    emulator = shutil.which("qemu-x86_64")
    if ort_operator.machine_kind() != "x86_64" or emulator is None:
        pytest.skip("needs an x86-64 machine and qemu-user's qemu-x86_64")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("DISENTANGLED_CPU_ISA", raising=False)
    path = ort_operator.write_library(tmp_path)
    torch.manual_seed(0)
    batch, heads, length = 2, 2, 37
    positions = RelativePositions.build(length, span=8, bucket_size=8, max_position=64, device="cpu")
    column = positions.column.to(torch.int32)
    feeds = {name: torch.randn(batch, length, heads * 64).numpy() for name in ("query", "key", "value")}
    for name, reverse in (("pos_key", True), ("pos_query", False)):
        table = torch.randn(heads, positions.width, 64) * 0.1
        feeds[name] = onnx_attention.kernel_tables(table, reverse=reverse).contiguous().numpy()
    feeds |= {"column": column.numpy(), "c2p_column": ((positions.width - 1) - column.flip(0)).numpy()}
    graph = operator_graph(True, True, False, heads, 0.125)
    (tmp_path / "graph.onnx").write_bytes(graph.SerializeToString())
    import numpy

    numpy.savez(tmp_path / "feeds.npz", **feeds)
    plain = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    answer = subprocess.run(
        [emulator, "-cpu", processor, os.path.realpath(sys.executable), "-c", EMULATED, str(path)],
        capture_output=True, text=True, env=plain, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    if processor == "Nehalem":
        assert answer.stdout.startswith("none: this processor has neither"), answer.stdout
        assert "disentangled::Attention cannot run here: this processor has neither" in answer.stderr
        return
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() == "avx2"
    here = kernel_outputs(tmp_path / "graph.onnx", feeds)[0]
    emulated = numpy.load(tmp_path / "out.npy")
    print(f"{processor} under emulation vs this processor: {abs(emulated - here).max():.1e}")
    assert abs(emulated - here).max() <= 1e-6


def test_the_command_writes_the_aarch64_library_too(tmp_path, monkeypatch):
    """--kernel-for aarch64 on another machine: the aarch64 library beside the graph too (Debian's cross compiler),
    both in the sidecar; it needs the C library alone, and under qemu-user a program of that machine loads it and
    hears version and set (NEON)."""
    if ort_operator.machine_kind() == "aarch64":
        pytest.skip("this is an aarch64 machine: --kernel writes its library already")
    compiler, emulator = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if compiler is None or emulator is None or shutil.which("readelf") is None:
        pytest.skip("needs aarch64-linux-gnu-gcc, qemu-aarch64 and readelf")
    monkeypatch.delenv("CC", raising=False)  # the cross compiler is the plain one: the libraries as shipped
    folder = save_model(tmp_path, "DisentangledModel", "v3")
    assert run_cli(str(folder), str(tmp_path / "model.onnx"), "--kernel", "--kernel-for", "aarch64", "--no-check") == 0
    library = tmp_path / ort_operator.library_name("aarch64")
    described = json.loads((tmp_path / ort_operator.SIDECAR).read_text())
    assert described["libraries"][library.name]["instruction_sets"] == ["neon"]
    assert ort_operator.library_name() in described["libraries"]
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert sorted(re.findall(r"\(NEEDED\)\s+Shared library: \[(.*?)\]", dynamic)) == ["libc.so.6", "libm.so.6"]
    ask = tmp_path / "ask.c"
    ask.write_text(
        "#include <dlfcn.h>\n#include <stdio.h>\n"
        "int main(int argc, char **argv) {\n"
        "    (void)argc;\n"
        "    void *library = dlopen(argv[1], RTLD_NOW);\n"
        "    if (!library) return puts(dlerror()), 1;\n"
        '    int (*version)(void) = (int (*)(void))dlsym(library, "disentangled_operator_version");\n'
        '    const char *(*set)(void) = (const char *(*)(void))dlsym(library, "disentangled_instruction_set");\n'
        '    printf("%d %s\\n", version(), set());\n'
        "    return 0;\n"
        "}\n"
    )
    subprocess.run([compiler, str(ask), "-o", str(tmp_path / "ask"), "-ldl"], check=True, capture_output=True)
    plain = {key: value for key, value in os.environ.items() if key not in ("LD_PRELOAD", "DISENTANGLED_CPU_ISA")}
    answer = subprocess.run(
        [emulator, "-L", "/usr/aarch64-linux-gnu", str(tmp_path / "ask"), str(library)],
        capture_output=True, text=True, env=plain, timeout=120,
    )  # fmt: skip
    assert answer.stdout.strip() == f"{ort_operator.OPERATOR_VERSION} neon", answer.stdout + answer.stderr
    assert run_cli(str(folder), str(tmp_path / "b.onnx"), "--kernel-for", "aarch64") == 2
