"""`disentangled export-onnx`: the graph onnxruntime runs matches PyTorch within 1e-5 (float32, relative to outputs of
size above one), for every head, the fused graph and the portable one, on padded batches, for lengths below and beyond
position_buckets and for batch sizes other than the traced one; and transformers' DeBERTa, accelerated in place,
exports the same fused graph through torch.onnx.export itself."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import inflate_weights
from robustness import skip_unless_supported

import disentangled
from disentangled import DisentangledConfig, cli
from disentangled.modeling import onnx_fused
from disentangled.modeling.modeling_disentangled import DISENTANGLED_ATTENTION_FUNCTIONS
from disentangled.serving import onnx_export

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
onnx = pytest.importorskip("onnx")

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
TOLERANCE = 1e-5
HEADS = {
    "DisentangledModel": "base",
    "DisentangledForMaskedLM": "masked-lm",
    "DisentangledForSequenceClassification": "sequence-classification",
    "DisentangledForTokenClassification": "token-classification",
    "DisentangledForQuestionAnswering": "question-answering",
    "DisentangledForMultipleChoice": "multiple-choice",
}


def save_model(tmp_path, head: str, config_name: str):
    config = DisentangledConfig(**TINY, **CONFIGS[config_name])
    if head == "DisentangledForQuestionAnswering":  # a start and an end logit
        config.num_labels = 2
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
    printed = capsys.readouterr()
    print(printed.out)
    fused = backend == "sdpa"  # the fused graph is sdpa's export; eager writes the reference's portable graph
    assert ("fused attention" in printed.out) == fused
    assert "training mode" not in printed.out + printed.err and "Warning" not in printed.out + printed.err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model", "model.onnx"]  # nothing else left
    model, task = onnx_export.load_model(folder, attn_implementation=backend)
    assert task == "sequence-classification"
    assert onnx_export.multi_head_attention_nodes(onnx.load(str(output)).graph) == (2 if fused else 0)
    figures = onnx_export.parity(model, task, output, SHAPES)
    print(backend, {f"batch {b}, length {n}": f"{f['max_abs_diff']:.1e}" for (b, n), f in figures.items()})
    assert max(onnx_export.relative_error(figure) for figure in figures.values()) <= TOLERANCE, figures


CASES = [(head, "v3", False) for head in HEADS] + [
    ("DisentangledForMultipleChoice", "v2", False),
    ("DisentangledForMultipleChoice", "v2", True),
    ("DisentangledForTokenClassification", "v3", True),
]


@pytest.mark.parametrize(
    ("head", "config_name", "portable"),
    CASES,
    ids=[f"{head}-{name}-{'portable' if portable else 'fused'}" for head, name, portable in CASES],
)
def test_every_head_matches_pytorch(tmp_path, head, config_name, portable):
    """Every head with v3 settings (log buckets, shared keys); v2-xlarge-like ones (absolute positions up to 40, token
    types, separate position projections, conv) through multiple choice, whose choices are dynamic too; both graphs."""
    folder = save_model(tmp_path, head, config_name)
    model, task = onnx_export.load_model(folder)
    assert task == HEADS[head]
    path = tmp_path / "model.onnx"
    onnx_export.export(model, task, path, portable=portable)
    assert onnx_export.multi_head_attention_nodes(onnx.load(str(path)).graph) == (0 if portable else 2)
    # v3: 80 tokens reach beyond max_relative_positions (64), where the products by distance stop and an edge pad
    # gives the farther columns
    figures = onnx_export.parity(model, task, path, SHAPES + ([(2, 80)] if config_name == "v3" else []))
    print(head, config_name, {f"{b}x{n}": f"{f['max_abs_diff']:.1e}" for (b, n), f in figures.items()})
    assert max(onnx_export.relative_error(figure) for figure in figures.values()) <= TOLERANCE, figures


def test_relative_shift_is_the_skew():
    """out[i, j] = by_distance[i, L - 1 - i + j], against a loop, for L = 1 (no row to shift) to 6."""
    for length in range(1, 7):
        by_distance = torch.arange(length * 2 * length, dtype=torch.float32).view(length, 2 * length)
        expected = torch.tensor(
            [[by_distance[i, length - 1 - i + j].item() for j in range(length)] for i in range(length)]
        )
        assert torch.equal(onnx_fused.relative_shift(by_distance), expected)


def accelerated_deberta(sizes: dict):
    """transformers' DebertaV2Model of `sizes` (v3's settings, seeded and inflated weights) and a copy of it after
    `disentangled.accelerate`."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DebertaV2Config(
        **{key: value for key, value in sizes.items() if key != "vocab_size"},
        vocab_size=64,
        position_buckets=8,
        max_relative_positions=64,
        relative_attention=True,
        pos_att_type="p2c|c2p",
        position_biased_input=False,
        norm_rel_ebd="layer_norm",
    )
    torch.manual_seed(0)
    reference = transformers.DebertaV2Model(config).eval()
    inflate_weights(reference)
    return reference, disentangled.accelerate(copy.deepcopy(reference))


def export_as_gliner_does(model, path) -> None:
    """The library's own torch.onnx.export call: dynamic batch and sequence, no token types."""
    inputs = onnx_export.example_inputs(model.config, "base", batch=2, length=11)
    inputs.pop("token_type_ids", None)
    torch.onnx.export(
        model,
        (),
        kwargs=inputs,
        f=str(path),
        input_names=list(inputs),
        output_names=["last_hidden_state"],
        dynamic_shapes={name: {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")} for name in inputs},
        dynamo=True,
    )


def assert_matches_transformers(reference, path) -> None:
    """The graph at `path` in onnxruntime against transformers' float32 model, at the real tokens of padded
    batches."""
    runner = onnx_export.session(path)
    for batch, length in [(3, 5), (2, 37)]:
        inputs = onnx_export.example_inputs(reference.config, "base", batch, length, seed=length)
        inputs.pop("token_type_ids", None)
        with torch.no_grad():
            expected = reference(**inputs).last_hidden_state
        (actual,) = runner.run(["last_hidden_state"], {k: v.numpy() for k, v in inputs.items()})
        kept = inputs["attention_mask"].bool()
        difference = (torch.from_numpy(actual) - expected)[kept].abs().max().item()
        print(f"accelerated DeBERTa in onnxruntime vs transformers, {batch}x{length}: {difference:.1e}")
        assert difference <= TOLERANCE


def test_accelerated_transformers_deberta_exports_the_fused_graph(tmp_path):
    """GLiNER's way: transformers' DeBERTa-v2, `disentangled.accelerate(model)`, then torch.onnx.export itself; the
    graph has the fused attention and matches transformers' own float32 outputs on padded batches (real tokens)."""
    reference, model = accelerated_deberta(TINY)
    path = tmp_path / "accelerated.onnx"
    export_as_gliner_does(model, path)
    assert onnx_export.multi_head_attention_nodes(onnx.load(str(path)).graph) == reference.config.num_hidden_layers
    assert_matches_transformers(reference, path)


def test_export_restores_the_training_mode(tmp_path):
    folder = save_model(tmp_path, "DisentangledModel", "v3")
    model, task = onnx_export.load_model(folder)
    model.train()
    onnx_export.export(model, task, tmp_path / "model.onnx")
    assert model.training


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
