"""`disentangled export-onnx`: the graph onnxruntime runs matches PyTorch within 1e-4, for lengths below and beyond
position_buckets and for batch sizes other than the traced one."""

from __future__ import annotations

import pytest
import torch
from parity import inflate_weights
from robustness import skip_unless_supported

import disentangled
from disentangled import DisentangledConfig, cli
from disentangled.modeling.modeling_disentangled import DISENTANGLED_ATTENTION_FUNCTIONS
from disentangled.serving import onnx_export

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
CONFIGS = {
    # DeBERTa-v3: relative only, log buckets (span 8, reaching 64), shared keys; any length
    "v3": dict(position_buckets=8, max_relative_positions=64, num_labels=3),
    # DeBERTa-v2-xlarge-like: absolute positions up to 40, token types, separate position projections, conv
    "v2": dict(
        position_buckets=8,
        max_relative_positions=32,
        position_biased_input=True,
        max_position_embeddings=40,
        type_vocab_size=2,
        share_att_key=False,
        conv_kernel_size=3,
        pos_att_type="p2c|c2p",
    ),
}
SHAPES = [(1, 1), (3, 5), (4, 29), (1, 37)]  # (batch, length); traced with (2, 11); position_buckets = 8


def save_model(tmp_path, head: str, config_name: str):
    config = DisentangledConfig(**TINY, **CONFIGS[config_name])
    model = getattr(disentangled, head)(config)
    inflate_weights(model)
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def run_cli(*argv: str) -> int:
    return cli.main(["export-onnx", *argv])


@pytest.mark.parametrize("backend", list(DISENTANGLED_ATTENTION_FUNCTIONS))
def test_export_matches_pytorch(tmp_path, backend, capsys):
    skip_unless_supported(backend, "onnx")
    folder = save_model(tmp_path, "DisentangledForSequenceClassification", "v3")
    output = tmp_path / "model.onnx"
    assert run_cli(str(folder), str(output), "--attn-implementation", backend) == 0
    print(capsys.readouterr().out)
    model, task = onnx_export.load_model(folder, attn_implementation=backend)
    assert task == "sequence-classification"
    figures = onnx_export.parity(model, task, output, SHAPES)
    print(backend, {f"batch {b}, length {n}": f"{f['max_abs_diff']:.1e}" for (b, n), f in figures.items()})
    assert max(onnx_export.relative_error(figure) for figure in figures.values()) <= 1e-4, figures


def test_export_multiple_choice_absolute_positions_token_types_conv(tmp_path):
    """Dynamic choices too; absolute positions bound the length (40)."""
    head = "DisentangledForMultipleChoice"
    folder = save_model(tmp_path, head, "v2")
    model, task = onnx_export.load_model(folder)
    onnx_export.export(model, task, tmp_path / "model.onnx")
    figures = onnx_export.parity(model, task, tmp_path / "model.onnx", SHAPES)
    print(head, {f"batch {b}, length {n}": f"{f['max_abs_diff']:.1e}" for (b, n), f in figures.items()})
    assert max(onnx_export.relative_error(figure) for figure in figures.values()) <= 1e-4, figures


def test_export_refuses_bad_paths(tmp_path, capsys):
    folder = save_model(tmp_path, "DisentangledModel", "v3")
    assert run_cli(str(tmp_path / "missing"), str(tmp_path / "a.onnx")) == 2
    assert run_cli(str(folder), str(tmp_path / "a.txt")) == 2
    assert run_cli(str(folder), str(tmp_path / "no-such-folder" / "a.onnx")) == 2
    (tmp_path / "exists.onnx").write_bytes(b"")
    assert run_cli(str(folder), str(tmp_path / "exists.onnx")) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_export_refuses_pickled_weights(tmp_path):
    folder = save_model(tmp_path, "DisentangledModel", "v3")
    (folder / "model.safetensors").rename(folder / "renamed.safetensors")
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises((OSError, ValueError)):
        onnx_export.load_model(folder)


def test_a_transformers_deberta_v2_folder_loads_as_ours(tmp_path):
    """export-onnx reads transformers' own DeBERTa-v2 folders too, with the head their architectures name."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DebertaV2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48, num_labels=3
    )
    transformers.DebertaV2ForSequenceClassification(config).save_pretrained(tmp_path)
    model, task = onnx_export.load_model(tmp_path)
    assert task == "sequence-classification"
    assert isinstance(model, disentangled.DisentangledForSequenceClassification)
