"""`disentangled export-onnx MODEL_DIR OUT.onnx`: a model folder to ONNX, checked against PyTorch with onnxruntime.

Uses PyTorch's current exporter (`torch.onnx.export(..., dynamo=True)`, through `torch.export`) with dynamic
batch and sequence axes (and choices, for multiple choice). The relative bucket index is computed inside the
graph from the symbolic length, so one file serves every length; the absolute position table, where the model
has one, bounds the length at `max_position_embeddings`.

The exported graph does not validate its input (tracing skips the checks of `modeling/validation.py`): token ids
outside the vocabulary make onnxruntime fail on a Gather, or read garbage on some providers. Validate before
calling it.

Security: MODEL_DIR must be a local folder; weights are read from safetensors only (no pickle), and the model
classes are this package's, never code from the folder (`trust_remote_code` is not used).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from .configuration import DisentangledConfig
from .modeling import (
    DisentangledForMaskedLM,
    DisentangledForMultipleChoice,
    DisentangledForQuestionAnswering,
    DisentangledForSequenceClassification,
    DisentangledForTokenClassification,
    DisentangledModel,
)
from .modeling.disentangled_attention import DISENTANGLED_ATTENTION_FUNCTIONS

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


def parity(model: nn.Module, task: str, path: str | Path, shapes: list[tuple[int, int]]) -> dict[tuple[int, int], dict]:
    """Per (batch, length), on padded random batches: the largest |onnxruntime - PyTorch| over all outputs and
    positions (padding included), and the largest |PyTorch| output it is measured against."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    _, output_names = TASKS[task]
    figures = {}
    for batch, length in shapes:
        inputs = example_inputs(model.config, task, batch, length, seed=batch * 1000 + length, choices=2)
        with torch.no_grad():
            expected = ExportWrapper(model, output_names)(**inputs)
        actual = session.run(output_names, {name: value.numpy() for name, value in inputs.items()})
        figures[(batch, length)] = {
            "max_abs_diff": max((torch.from_numpy(a) - e).abs().max().item() for a, e in zip(actual, expected)),
            "max_abs_reference": max(e.abs().max().item() for e in expected),
        }
    return figures


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
    model, task = load_model(args.model_dir, args.task, args.attn_implementation)
    export(model, task, output, opset=args.opset)
    print(f"wrote {output} ({task}, opset {args.opset}, dynamic batch and sequence axes)")
    if args.no_check:
        return 0
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
