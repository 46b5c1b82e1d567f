"""`disentangled export-onnx MODEL_DIR OUT.onnx`: a model folder to ONNX, checked against PyTorch with onnxruntime.

Uses PyTorch's current exporter (`torch.onnx.export(..., dynamo=True)`, through `torch.export`) with dynamic
batch and sequence axes (and choices, for multiple choice). The relative bucket index is computed inside the
graph from the symbolic length, so one file serves every length; the absolute position table, where the model
has one, bounds the length at `max_position_embeddings`.

The exported graph does not validate its input (tracing skips the checks of `modeling/validation.py`): token ids
outside the vocabulary make onnxruntime fail on a Gather, or read garbage on some providers. Validate before
calling it.

`--quantize int8` writes an int8 graph instead (`quantize_int8`): onnxruntime's dynamic quantization of the
exported graph, prepared so that every matrix product against a constant is quantized (see `quantize_int8`); its
check compares predictions (argmax agreement, largest change of a probability) with the float32 model's, since
int8 logits differ from float32 ones by far more than 1e-4.

The file is written in a temporary folder beside OUT.onnx and moved there once complete: a failed export leaves
nothing half-written.

Security: MODEL_DIR must be a local folder; weights are read from safetensors only (no pickle), and the model
classes are this package's, never code from the folder (`trust_remote_code` is not used).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

from ..configuration import DisentangledConfig
from ..modeling import (
    DisentangledForMaskedLM,
    DisentangledForMultipleChoice,
    DisentangledForQuestionAnswering,
    DisentangledForSequenceClassification,
    DisentangledForTokenClassification,
    DisentangledModel,
)
from ..modeling.modeling_disentangled import DISENTANGLED_ATTENTION_FUNCTIONS

# task -> (class, output names)
TASKS = {
    "base": (DisentangledModel, ["last_hidden_state"]),
    "masked-lm": (DisentangledForMaskedLM, ["logits"]),
    "sequence-classification": (DisentangledForSequenceClassification, ["logits"]),
    "token-classification": (DisentangledForTokenClassification, ["logits"]),
    "question-answering": (DisentangledForQuestionAnswering, ["start_logits", "end_logits"]),
    "multiple-choice": (DisentangledForMultipleChoice, ["logits"]),
}
# config.json "architectures" entry -> task; transformers' DeBERTa-v2 names read the same folder layout
ARCHITECTURES = {
    **{model_class.__name__: task for task, (model_class, _) in TASKS.items()},
    **{
        name.replace("Disentangled", "DebertaV2"): task
        for name, task in ((cls.__name__, task) for task, (cls, _) in TASKS.items())
    },
}
NOT_EXPORTABLE = {"flex_attention": "ONNX has no FlexAttention operator; use eager or sdpa"}
DEFAULT_OPSET = 18
TOLERANCE = 1e-4
QUANTIZATIONS = ["int8"]
MIN_AGREEMENT = 0.99  # int8 check: share of predictions (argmax) that must match the float32 model's


class ExportWrapper(nn.Module):
    """The model with named tensor inputs and a tuple of the task's outputs, as the exporter wants them."""

    def __init__(self, model: nn.Module, output_names: list[str]):
        super().__init__()
        self.model = model
        self.output_names = output_names

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None):
        output = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return tuple(getattr(output, name) for name in self.output_names)


def resolve_task(config: DisentangledConfig, task: str) -> str:
    if task != "auto":
        return task
    for architecture in config.architectures or []:
        if architecture in ARCHITECTURES:
            return ARCHITECTURES[architecture]
    return "base"


def load_model(model_dir: str | Path, task: str = "auto", attn_implementation: str = "eager") -> tuple[nn.Module, str]:
    """Our class for the folder's task, from its config.json and safetensors weights only."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"MODEL_DIR {str(model_dir)!r} is not a local folder (download Hub models first)")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"MODEL_DIR {str(model_dir)!r} has no config.json")
    exportable = sorted(set(DISENTANGLED_ATTENTION_FUNCTIONS) - set(NOT_EXPORTABLE))
    if attn_implementation not in exportable:
        reason = NOT_EXPORTABLE.get(attn_implementation, "unknown implementation")
        raise ValueError(
            f"--attn-implementation {attn_implementation!r} cannot be exported ({reason}); use one of {exportable}"
        )
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if model_type not in (DisentangledConfig.model_type, "deberta-v2"):
        raise ValueError(f"MODEL_DIR holds a {model_type!r} model; expected 'disentangled' or 'deberta-v2'")
    config = DisentangledConfig.from_pretrained(model_dir)
    task = resolve_task(config, task)
    model_class, _ = TASKS[task]
    model = model_class.from_pretrained(
        model_dir, config=config, use_safetensors=True, attn_implementation=attn_implementation
    )
    return model.eval(), task


def example_inputs(
    config: DisentangledConfig, task: str, batch: int, length: int, seed: int = 0, choices: int = 3
) -> dict:
    """Token ids, a mask that pads the first sequence to half its length, and token types where the model has them."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, choices, length) if task == "multiple-choice" else (batch, length)
    input_ids = torch.randint(1, config.vocab_size, shape, generator=generator)
    attention_mask = torch.ones(shape, dtype=torch.long)
    attention_mask[0, ..., (length + 1) // 2 :] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if config.type_vocab_size > 0:
        inputs["token_type_ids"] = (torch.arange(length) >= length // 2).long().expand(shape).contiguous()
    return inputs


def export(model: nn.Module, task: str, path: str | Path, opset: int = DEFAULT_OPSET) -> None:
    """Export with dynamic batch and sequence axes (and choices); the file is written at `path`."""
    config = model.config
    _, output_names = TASKS[task]
    batch = torch.export.Dim("batch")
    max_length = config.max_position_embeddings if config.position_biased_input else None
    sequence = torch.export.Dim("sequence", max=max_length) if max_length else torch.export.Dim("sequence")
    axes = (
        {0: batch, 1: torch.export.Dim("choices"), 2: sequence}
        if task == "multiple-choice"
        else {0: batch, 1: sequence}
    )
    # Traced sizes all differ (2, 3, 11), so that no two axes are taken for the same symbol.
    inputs = example_inputs(config, task, batch=2, length=min(11, max_length or 11), choices=3)
    program = torch.onnx.export(
        ExportWrapper(model, output_names),
        (),
        kwargs=inputs,
        dynamo=True,
        dynamic_shapes={name: axes for name in inputs},
        input_names=list(inputs),
        output_names=output_names,
        opset_version=opset,
        verbose=False,
    )
    program.save(str(path))


def einsums_to_matmuls(graph) -> int:
    """Rewrite each `Einsum("bhld,hrd->bhlr", content, rows)` (`position_table`: c2p and p2c against the relative
    rows) as `MatMul(content, Transpose(rows))`, the same product broadcast over the batch. onnxruntime's CPU
    Einsum runs it several times slower than its MatMul, and its quantizer handles MatMul only. Returns the count.
    """
    import onnx

    nodes, count = [], 0
    for node in graph.node:
        equation = next((a.s.decode() for a in node.attribute if a.name == "equation"), "")
        if node.op_type == "Einsum" and equation.replace(" ", "") == "bhld,hrd->bhlr":
            rows_t = f"{node.output[0]}_rows_transposed"  # [H, D, R]
            nodes.append(
                onnx.helper.make_node("Transpose", [node.input[1]], [rows_t], f"{node.name}_transpose", perm=[0, 2, 1])
            )
            nodes.append(
                onnx.helper.make_node("MatMul", [node.input[0], rows_t], list(node.output), f"{node.name}_matmul")
            )
            count += 1
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return count


def lean_graph(path: str | Path) -> int:
    """`einsums_to_matmuls` on the ONNX file at `path`, in place; returns the number of rewritten Einsums."""
    import onnx

    model = onnx.load(str(path))
    count = einsums_to_matmuls(model.graph)
    if count:
        onnx.save(model, str(path))
    return count


def quantize_int8(
    float_path: str | Path, output_path: str | Path, per_channel: bool = False, position_tables: bool = True
) -> None:
    """onnxruntime's dynamic int8 quantization of the float graph at `float_path`, written to `output_path`.

    `quantize_dynamic` as is leaves much of the work in float32 here: the exporter writes the query and key
    projections as `MatMul(x, Transpose(W))` and the position tables as an Einsum of weight-only terms, and
    the quantizer takes only MatMuls whose second input is a constant. So, first: Einsums become MatMuls
    (`einsums_to_matmuls`) and onnxruntime's basic graph optimizations fold every weight-only subgraph into
    a constant (`quant_pre_process`: the transposed weights, the projected relative rows, LayerNorm of the
    relative embeddings). Then every MatMul against a constant is quantized: int8 weights with one scale
    (one per output channel with `per_channel`), uint8 activations quantized per call; at load time
    onnxruntime fuses each into one DynamicQuantizeMatMul / MatMulIntegerToFloat kernel. That includes the
    c2p / p2c tables (content against the constant [H, D, 2S] relative rows) unless `position_tables` is
    False; onnxruntime has no per-channel kernel for their 3-d weights, so `per_channel` keeps them float32.
    Products of two activations (q . k, probabilities . v), LayerNorm, softmax, the bias gathers and the
    embeddings stay float32.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory(dir=Path(output_path).parent) as folder:
        prepared = Path(folder) / "prepared.onnx"
        quant_pre_process(str(float_path), str(prepared), skip_symbolic_shape=True)
        graph = onnx.load(str(prepared), load_external_data=False).graph
        rank = {initializer.name: len(initializer.dims) for initializer in graph.initializer}
        float_tables = per_channel or not position_tables
        excluded = [n.name for n in graph.node if n.op_type == "MatMul" and float_tables and rank.get(n.input[1]) == 3]
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # "consider pre-processing" is printed although it was done
        try:
            quantize_dynamic(
                prepared,
                output_path,
                op_types_to_quantize=["MatMul"],
                per_channel=per_channel,
                weight_type=QuantType.QInt8,
                nodes_to_exclude=excluded,
                extra_options={"MatMulConstBOnly": True},
            )
        finally:
            root.setLevel(level)


def onnxruntime_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def session(path: str | Path, threads: int | None = None, spinning: bool = True):
    """An onnxruntime CPU session with every graph optimization on (the int8 fusions need them). `spinning`
    False stops idle threads from spinning between calls (fairer when other work shares the cores)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def parity(model: nn.Module, task: str, path: str | Path, shapes: list[tuple[int, int]]) -> dict[tuple[int, int], dict]:
    """Per (batch, length), on padded random batches: the largest |onnxruntime - PyTorch| over all outputs and
    positions (padding included), and the largest |PyTorch| output it is measured against."""
    runner = session(path)
    _, output_names = TASKS[task]
    figures = {}
    for batch, length in shapes:
        inputs = example_inputs(model.config, task, batch, length, seed=batch * 1000 + length, choices=2)
        with torch.no_grad():
            expected = ExportWrapper(model, output_names)(**inputs)
        actual = runner.run(output_names, {name: value.numpy() for name, value in inputs.items()})
        figures[(batch, length)] = {
            "max_abs_diff": max((torch.from_numpy(a) - e).abs().max().item() for a, e in zip(actual, expected)),
            "max_abs_reference": max(e.abs().max().item() for e in expected),
        }
    return figures


def agreement(
    model: nn.Module, task: str, path: str | Path, shapes: list[tuple[int, int]]
) -> dict[tuple[int, int], dict]:
    """Per (batch, length), on padded random batches: how often the graph at `path` predicts what PyTorch does.

    `agreement` is the share of argmax predictions that match over every output's last axis (a label per
    sequence or token, a start / end position, a choice, a word), padded tokens left out of per-token outputs;
    `max_prob_diff` the largest change of a softmax probability. For hidden states (task "base"), which
    predict nothing, `agreement` is the smallest cosine similarity of a token's vector to PyTorch's.
    """
    figures = {}
    runner = session(path)
    _, output_names = TASKS[task]
    for batch, length in shapes:
        inputs = example_inputs(model.config, task, batch, length, seed=batch * 1000 + length, choices=2)
        with torch.no_grad():
            expected = ExportWrapper(model, output_names)(**inputs)
        actual = runner.run(output_names, {name: value.numpy() for name, value in inputs.items()})
        kept = inputs["attention_mask"].bool()
        matches, max_prob_diff = [], 0.0
        for quantized, reference in zip(map(torch.from_numpy, actual), expected):
            if task == "base":
                matches.append(torch.cosine_similarity(quantized, reference, dim=-1)[kept])
                continue
            # per-token outputs ([B, L, C] logits; [B, L] start / end logits over positions) keep real tokens
            per_token = reference.dim() == 3 and reference.shape[:2] == kept.shape
            if reference.shape == kept.shape:  # start / end logits: padded positions are never predicted
                quantized = quantized.masked_fill(~kept, torch.finfo(quantized.dtype).min)
                reference = reference.masked_fill(~kept, torch.finfo(reference.dtype).min)
            same = quantized.argmax(-1) == reference.argmax(-1)
            matches.append((same[kept] if per_token else same.flatten()).float())
            max_prob_diff = max(max_prob_diff, (quantized.softmax(-1) - reference.softmax(-1)).abs().max().item())
        matches = torch.cat(matches)
        figures[(batch, length)] = {
            "agreement": (matches.min() if task == "base" else matches.mean()).item(),
            "predictions": matches.numel(),
            "max_prob_diff": max_prob_diff,
        }
    return figures


def agreement_shapes(config: DisentangledConfig) -> list[tuple[int, int]]:
    """Enough sequences (96) that one changed prediction of a classifier moves agreement by about 1%."""
    _, middle, longest = (length for _, length in check_shapes(config))
    return [(64, middle), (32, longest)]


def relative_error(figure: dict) -> float:
    """max |diff| / max(1, max |reference|): absolute for outputs of order one (hidden states), relative for
    large logits, as the conversion's parity check measures."""
    return figure["max_abs_diff"] / max(1.0, figure["max_abs_reference"])


def check_shapes(config: DisentangledConfig) -> list[tuple[int, int]]:
    """Batch sizes other than the traced 2, lengths below and beyond position_buckets (and 1)."""
    longest = config.max_position_embeddings if config.position_biased_input else None
    buckets = config.position_buckets if config.position_buckets > 0 else 8
    lengths = [1, max(2, buckets // 2), 2 * buckets + 3]
    if longest is not None:
        lengths = sorted({min(length, longest) for length in lengths})
    return [(1, lengths[0]), (3, lengths[1]), (4, lengths[-1])]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="local folder with config.json and model.safetensors")
    parser.add_argument("output", metavar="OUT.onnx", help="where to write the ONNX file")
    parser.add_argument("--task", choices=["auto", *TASKS], default="auto", help="head to export (auto: from config)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    parser.add_argument(
        "--attn-implementation",
        default="eager",
        help="attention backend traced into the graph (default eager, the reference)",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=None,
        help="int8: onnxruntime's dynamic quantization of the graph (checked on predictions, not logits)",
    )
    parser.add_argument(
        "--min-agreement",
        type=float,
        default=MIN_AGREEMENT,
        help=f"--quantize check: least share of matching predictions (default {MIN_AGREEMENT})",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT.onnx if it exists")
    parser.add_argument("--no-check", action="store_true", help="skip the onnxruntime parity check")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help=f"tolerance on max |diff| / max(1, max |output|) (default {TOLERANCE})",
    )


def run(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if output.suffix != ".onnx":
        raise ValueError(f"OUT.onnx must end in .onnx, got {str(output)!r}")
    if not output.parent.is_dir():
        raise FileNotFoundError(f"the folder of OUT.onnx, {str(output.parent)!r}, does not exist")
    if output.exists() and not args.overwrite:
        raise FileExistsError(f"{str(output)!r} exists; pass --overwrite to replace it")
    if not 0.0 <= args.min_agreement <= 1.0:
        raise ValueError(f"--min-agreement is a share between 0 and 1, got {args.min_agreement}")
    model, task = load_model(args.model_dir, args.task, args.attn_implementation)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.stem}-") as folder:
        written = Path(folder) / output.name  # beside OUT.onnx, moved there only once complete
        export(model, task, written, opset=args.opset)
        lean_graph(written)
        if args.quantize == "int8":
            quantize_int8(written, Path(folder) / "int8.onnx")
            os.replace(Path(folder) / "int8.onnx", written)
        for file in Path(folder).iterdir():  # OUT.onnx and its external data, if the exporter wrote any
            if file.is_file():
                os.replace(file, output.parent / file.name)
    kind = f"{args.quantize} " if args.quantize else ""
    print(f"wrote {output} ({kind}{task}, opset {args.opset}, dynamic batch and sequence axes)")
    if args.no_check:
        return 0
    if args.quantize:
        return check_predictions(model, task, output, args.min_agreement)
    figures = parity(model, task, output, check_shapes(model.config))
    for (batch, length), figure in figures.items():
        print(
            f"onnxruntime vs PyTorch, batch {batch}, length {length}: max |diff| {figure['max_abs_diff']:.2e} "
            f"(outputs up to {figure['max_abs_reference']:.3g}; relative {relative_error(figure):.2e})"
        )
    worst = max(relative_error(figure) for figure in figures.values())
    if not worst <= args.tolerance:
        print(f"parity check failed: {worst:.2e} > {args.tolerance:.0e} (max |diff| / max(1, max |output|))")
        return 1
    return 0


def check_predictions(model: nn.Module, task: str, path: Path, min_agreement: float) -> int:
    """The quantized graph's check: its predictions against the float32 PyTorch model's (see `agreement`)."""
    figures = agreement(model, task, path, agreement_shapes(model.config))
    measure = "smallest cosine similarity per token" if task == "base" else "argmax agreement"
    for (batch, length), figure in figures.items():
        detail = "" if task == "base" else f", max |diff| of a probability {figure['max_prob_diff']:.2e}"
        print(
            f"int8 onnxruntime vs float32 PyTorch, batch {batch}, length {length}: {measure} "
            f"{figure['agreement']:.4f} over {figure['predictions']} predictions{detail}"
        )
    worst = min(figure["agreement"] for figure in figures.values())
    if not worst >= min_agreement:
        print(f"prediction check failed: {measure} {worst:.4f} < {min_agreement} (--min-agreement)")
        return 1
    return 0
