"""int8 inference: `disentangled.quantize_dynamic` (PyTorch) and `export-onnx --quantize int8` (onnxruntime).

Quantized models are checked on predictions, as users read them: a tiny classifier trained here on the built-in
sentiment data must predict the same labels as its float32 self on held-out texts, with probabilities that move
little; the same check must fail for a graph of another model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tokenizer as tiny_tokenizer

import disentangled
from disentangled import DisentangledConfig, cli
from disentangled.demo.data import sentiment_examples
from disentangled.serving import onnx_export

TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    position_buckets=8,
    max_relative_positions=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    num_labels=2,
)
LABELS = {"negative": 0, "positive": 1}


def encode(tokenizer, rows: list[dict]) -> tuple[dict, torch.Tensor]:
    encoded = dict(tokenizer([row["text"] for row in rows], padding=True, return_tensors="pt"))
    encoded.pop("token_type_ids", None)
    return encoded, torch.tensor([LABELS[row["label"]] for row in rows])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny classifier trained on the built-in sentiment task (its predictions mean something), its folder,
    and held-out texts."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = DisentangledConfig(**TINY, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model = disentangled.DisentangledForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = sentiment_examples(1024, seed=1)
    for step in range(60):
        inputs, labels = encode(tokenizer, rows[step * 16 % 1024 :][:16])
        loss = model(**inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    folder = tmp_path_factory.mktemp("int8") / "classifier"
    model.save_pretrained(folder)
    held_out = encode(tokenizer, sentiment_examples(256, seed=3))
    return model, folder, held_out


def test_trained_classifier_is_better_than_chance(trained):
    model, _, (inputs, labels) = trained
    with torch.no_grad():
        accuracy = (model(**inputs).logits.argmax(-1) == labels).float().mean().item()
    assert accuracy > 0.8, accuracy


ENGINES = [None] + [name for name in ("fbgemm", "onednn") if name in torch.backends.quantized.supported_engines]


@pytest.mark.parametrize("engine", ENGINES, ids=lambda name: name or "default")
def test_torch_quantize_dynamic_keeps_predictions(trained, engine):
    model, _, (inputs, _) = trained
    global_engine = torch.backends.quantized.engine
    quantized = disentangled.quantize_dynamic(model, engine=engine)
    assert torch.backends.quantized.engine == global_engine  # packed with `engine`, torch's setting left alone
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    replaced = dict(quantized.named_modules())
    assert linears and all(replaced[name]._get_name() == "DynamicQuantizedLinear" for name in linears)
    assert all(isinstance(module, torch.nn.Linear) for name, module in model.named_modules() if name in linears)
    with torch.no_grad():
        reference, logits = model(**inputs).logits, quantized(**inputs).logits
    with torch.inference_mode():  # no cached position tables of quantized weights
        assert torch.equal(quantized(**inputs).logits, logits)
    assert not torch.equal(logits, reference)  # int8 weights: not the float32 model
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agreement >= 0.99, agreement
    assert (logits.softmax(-1) - reference.softmax(-1)).abs().max() < 0.05


def test_quantize_dynamic_rejects_what_it_cannot_quantize(trained):
    model, _, _ = trained
    with pytest.raises(ValueError, match="float32"):
        disentangled.quantize_dynamic(disentangled.DisentangledModel(model.config).to(torch.bfloat16))
    with pytest.raises(ValueError, match="nn.Module"):
        disentangled.quantize_dynamic(model.state_dict())
    with pytest.raises(ValueError, match="engine 'tpu'.*use one of"):
        disentangled.quantize_dynamic(model, engine="tpu")


def test_default_engine_is_onednn_only_where_the_cpu_has_amx(monkeypatch):
    from disentangled import quantization

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    expected = "onednn" if "onednn" in torch.backends.quantized.supported_engines else torch.backends.quantized.engine
    assert quantization.default_engine() == expected
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert quantization.default_engine() == torch.backends.quantized.engine


@pytest.fixture(scope="module")
def int8_graph(trained, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    _, folder, _ = trained
    output = tmp_path_factory.mktemp("onnx") / "int8.onnx"
    code = cli.main(["export-onnx", str(folder), str(output), "--quantize", "int8"])
    return code, output


def test_export_onnx_int8_end_to_end(trained, int8_graph):
    """The CLI writes one quantized graph (every constant MatMul in int8, no Einsum), its check passes, and the
    graph predicts the float32 model's labels on held-out texts."""
    import onnx

    model, _, (inputs, _) = trained
    code, output = int8_graph
    assert code == 0
    assert sorted(path.name for path in output.parent.iterdir()) == ["int8.onnx"]  # no temporary files left
    graph = onnx.load(str(output)).graph
    operators = {node.op_type for node in graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= operators and "Einsum" not in operators
    constants = {initializer.name for initializer in graph.initializer}
    assert not [n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] in constants]
    session = onnx_export.session(output)
    logits = torch.from_numpy(session.run(["logits"], {k: v.numpy() for k, v in inputs.items()})[0])
    with torch.no_grad():
        reference = model(**inputs).logits
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.99
    assert (logits.softmax(-1) - reference.softmax(-1)).abs().max() < 0.05
    assert (logits - reference).abs().max() > 1e-4  # quantized: a float parity check at 1e-4 would fail it


def test_int8_check_fails_for_another_models_graph(trained, int8_graph, capsys):
    """The prediction check can fail: against a differently trained model's graph its agreement drops."""
    model, _, _ = trained
    _, output = int8_graph
    torch.manual_seed(1)
    other = disentangled.DisentangledForSequenceClassification(model.config).eval()
    with torch.no_grad():
        other.classifier.weight.mul_(100.0)  # decisive, different predictions
    figures = onnx_export.agreement(other, "sequence-classification", output, [(64, 9)])
    assert figures[(64, 9)]["agreement"] < 0.9, figures
    assert onnx_export.check_predictions(other, "sequence-classification", output, 0.99) == 1
    assert "prediction check failed" in capsys.readouterr().out


def test_quantize_bad_input_fails_clearly_writing_nothing(trained, tmp_path, capsys):
    _, folder, _ = trained
    output = tmp_path / "out" / "model.onnx"
    output.parent.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export-onnx", str(folder), str(output), "--quantize", "int4"])
    assert exit_info.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    assert cli.main(["export-onnx", str(folder), str(output), "--quantize", "int8", "--min-agreement", "1.5"]) == 2
    assert "--min-agreement" in capsys.readouterr().err
    assert list(output.parent.iterdir()) == []


def test_failed_export_leaves_nothing(trained, tmp_path, monkeypatch):
    """A failure after the file was started (here: in the exporter) leaves neither OUT.onnx nor temporaries."""
    _, folder, _ = trained

    def broken(model, task, path, opset):
        path.write_bytes(b"half")
        raise ValueError("export failed")

    monkeypatch.setattr(onnx_export, "export", broken)
    assert cli.main(["export-onnx", str(folder), str(tmp_path / "model.onnx"), "--quantize", "int8"]) == 2
    assert [path.name for path in tmp_path.iterdir()] == []


def test_einsum_rewrite_is_the_same_product():
    """`einsums_to_matmuls` against numpy's einsum, run by onnxruntime (the position tables' equation)."""
    onnx = pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    helper, TensorProto = onnx.helper, onnx.TensorProto
    node = helper.make_node("Einsum", ["content", "rows"], ["table"], "position_table", equation="bhld,hrd->bhlr")
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("content", TensorProto.FLOAT, [2, 3, 5, 4]),
            helper.make_tensor_value_info("rows", TensorProto.FLOAT, [3, 7, 4]),
        ],
        [helper.make_tensor_value_info("table", TensorProto.FLOAT, [2, 3, 5, 7])],
    )
    assert onnx_export.einsums_to_matmuls(graph) == 1
    assert [n.op_type for n in graph.node] == ["Transpose", "MatMul"]
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    rng = np.random.default_rng(0)
    content, rows = rng.standard_normal((2, 3, 5, 4), np.float32), rng.standard_normal((3, 7, 4), np.float32)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (table,) = session.run(None, {"content": content, "rows": rows})
    np.testing.assert_allclose(table, np.einsum("bhld,hrd->bhlr", content, rows), rtol=1e-5, atol=1e-5)
