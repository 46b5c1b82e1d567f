"""int8 inference: `disentangled.quantize_dynamic` (PyTorch) and `export-onnx --quantize int8` (onnxruntime).

Quantized models are checked on predictions, as users read them: a tiny classifier trained here on the built-in
sentiment data must predict the same labels as its float32 self on held-out texts, with probabilities that move
little; the same check must fail for a graph of another model.
"""

from __future__ import annotations

import contextlib
import io
import re

import numpy as np
import pytest
import tiny_models
import torch
from tiny_models import tokenizer as tiny_tokenizer

import disentangled
from disentangled import DisentangledConfig, cli
from disentangled.demo.data import sentiment_examples
from disentangled.serving import onnx_export

TINY = dict(tiny_models.TINY, position_buckets=8, max_relative_positions=64, num_labels=2)
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
    tokenizer.save_pretrained(folder)  # --check-texts tokenizes with the folder's own tokenizer
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
def check_texts(tmp_path_factory):
    """Held-out texts of the sentiment task, one a line, as a user's file."""
    path = tmp_path_factory.mktemp("texts") / "texts.txt"
    path.write_text("\n".join(row["text"] for row in sentiment_examples(200, seed=7)) + "\n")
    return path


@pytest.fixture(scope="module")
def int8_graph(trained, check_texts, tmp_path_factory):
    """The int8 graph, checked on texts of the task (random token ids, unlike anything the model was trained on, can
    refuse this good model: one changed prediction of 32 was seen)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    _, folder, _ = trained
    output = tmp_path_factory.mktemp("onnx") / "int8.onnx"
    argv = ["export-onnx", str(folder), str(output), "--quantize", "int8", "--check-texts", str(check_texts)]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        code = cli.main(argv)
    return code, output, printed.getvalue()


def test_export_onnx_int8_end_to_end(trained, int8_graph):
    """The CLI writes one quantized graph (every constant MatMul in int8, no Einsum), its check passes, and the
    graph predicts the float32 model's labels on held-out texts."""
    import onnx

    model, _, (inputs, _) = trained
    code, output, _ = int8_graph
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
    # hidden size 32: int8 moves a probability by up to 0.087 here (0.107 with the portable graph, whose position
    # products are int8 too; the fused graph keeps them float32)
    assert (logits.softmax(-1) - reference.softmax(-1)).abs().max() < 0.1
    assert (logits - reference).abs().max() > 1e-4  # quantized: a float parity check at 1e-4 would fail it


def test_int8_check_fails_for_another_models_graph(trained, int8_graph, check_texts, capsys):
    """The prediction check can fail: against a differently trained model's graph its agreement drops. On texts it
    refuses; on generated inputs it reports the low agreement and does not refuse."""
    model, folder, _ = trained
    _, output, _ = int8_graph
    torch.manual_seed(1)
    other = disentangled.DisentangledForSequenceClassification(model.config).eval()
    with torch.no_grad():
        other.classifier.weight.mul_(100.0)  # decisive, different predictions
    figures = onnx_export.agreement(other, "sequence-classification", output, [(64, 9)])
    assert figures[(64, 9)]["agreement"] < 0.9, figures
    texts = onnx_export.read_check_texts(check_texts, "text", 1024)
    assert onnx_export.check_predictions(other, "sequence-classification", output, 0.99, folder, texts) == 1
    assert "prediction check failed" in capsys.readouterr().out
    assert onnx_export.check_predictions(other, "sequence-classification", output, 0.99) == 0
    printed = capsys.readouterr().out
    assert "is below 0.99 there; generated inputs inform" in printed and "prediction check failed" not in printed


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

    def broken(model, task, path, opset, portable, kernel=False):
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


def test_int8_check_on_the_users_texts(int8_graph):
    """--check-texts: the check runs on the file's texts through the folder's tokenizer and says so (without it,
    the output says the check ran on generated inputs: `test_failed_int8_check_leaves_nothing_and_says_what_to_do`).
    The export is `int8_graph`'s, whose printed output is kept."""
    code, output, printed = int8_graph
    print(printed)
    assert code == 0
    assert "on your texts: argmax agreement" in printed and "checked on 200 texts of --check-texts" in printed
    assert output.is_file()


def test_failed_int8_check_leaves_nothing_and_says_what_to_do(trained, check_texts, tmp_path, monkeypatch, capsys):
    """Below --min-agreement on texts: figures, the fix, and no OUT.onnx (nor temporaries). On generated inputs the
    same figures are reported and the graph is written: random token ids inform, they do not refuse."""
    _, folder, _ = trained
    real = onnx_export.compare_predictions

    def worse(*args, **kwargs):  # the real figures, with agreement made too low
        return {**real(*args, **kwargs), "agreement": 0.5}

    monkeypatch.setattr(onnx_export, "compare_predictions", worse)
    output = tmp_path / "model.onnx"
    argv = ["export-onnx", str(folder), str(output), "--quantize", "int8"]
    assert cli.main([*argv, "--check-texts", str(check_texts)]) == 1
    printed = capsys.readouterr().out
    assert "prediction check failed: argmax agreement 0.5000 < 0.99" in printed
    assert "export without --quantize" in printed and "nothing written to" in printed
    assert list(tmp_path.iterdir()) == []
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "checked on generated inputs (random token ids)" in printed
    assert "argmax agreement 0.5000 is below 0.99 there; generated inputs inform" in printed
    assert "prediction check failed" not in printed and f"wrote {output}" in printed
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.onnx"]


def test_check_texts_bad_input_fails_clearly(trained, tmp_path, capsys):
    _, folder, _ = trained
    output = tmp_path / "out" / "model.onnx"
    output.parent.mkdir()
    argv = ["export-onnx", str(folder), str(output), "--quantize", "int8", "--check-texts"]
    assert cli.main([*argv, str(tmp_path / "missing.txt")]) == 2
    assert "is not a file" in capsys.readouterr().err
    table = tmp_path / "texts.csv"
    table.write_text("sentence,label\na good movie,1\n")
    assert cli.main([*argv, str(table)]) == 2
    assert "no column 'text'" in capsys.readouterr().err
    assert cli.main(["export-onnx", str(folder), str(output), "--check-texts", str(table)]) == 2
    assert "add --quantize int8" in capsys.readouterr().err
    assert list(output.parent.iterdir()) == []


def test_ranking_agreement_by_hand():
    """One score per text (a reranker): pairs ordered alike, largest score and rank changes, computed by hand."""
    reference = torch.tensor([3.0, 2.0, 1.0, 0.0])
    same_order = onnx_export.ranking_agreement(reference + 0.1, reference)
    assert same_order["agreement"] == 1.0 and same_order["max_rank_change"] == 0
    assert abs(same_order["max_score_diff"] - 0.1) < 1e-6
    swapped = onnx_export.ranking_agreement(torch.tensor([3.0, 0.5, 1.0, 0.0]), reference)  # texts 1 and 2 swap
    assert swapped["agreement"] == 5 / 6 and swapped["max_rank_change"] == 1 and swapped["predictions"] == 6


def test_int8_reranker_is_checked_by_ranking(tmp_path, capsys):
    """A one-logit model (reranker): the check ranks, where argmax over one value would always agree; against another
    model's graph the ranking agreement drops."""
    pytest.importorskip("onnxruntime")
    config = DisentangledConfig(**{**TINY, "num_labels": 1}, vocab_size=100)
    torch.manual_seed(0)
    reranker = disentangled.DisentangledForSequenceClassification(config).eval()
    reranker.save_pretrained(tmp_path / "reranker")
    output = tmp_path / "reranker.onnx"
    argv = ["export-onnx", str(tmp_path / "reranker"), str(output), "--quantize", "int8"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "pairs ranked alike" in printed and "largest rank change" in printed
    # untrained: its scores nearly tie, so int8 swaps neighbours; 0.9 of the pairs must keep their order
    figures = re.findall(r"PyTorch on batch \d+, length \d+: pairs ranked alike (\d\.\d+)", printed)
    ranked_alike = [float(share) for share in figures]
    assert len(ranked_alike) == 2 and min(ranked_alike) >= 0.9, printed
    other = disentangled.DisentangledForSequenceClassification(config).eval()  # other weights (seed moved on)
    runner = onnx_export.session(output)
    batch = [onnx_export.example_inputs(config, "sequence-classification", 64, 9)]
    assert onnx_export.compare_predictions(other, "sequence-classification", runner, batch)["agreement"] < 0.9
