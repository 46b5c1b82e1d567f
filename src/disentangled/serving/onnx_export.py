"""`disentangled export-onnx MODEL_DIR OUT.onnx`: a model folder to ONNX, checked against PyTorch with onnxruntime.

Uses PyTorch's current exporter (`torch.onnx.export(..., dynamo=True)`, through `torch.export`) with dynamic
batch and sequence axes (and choices, for multiple choice), the model in eval mode. The relative bucket index is
computed inside the graph from the symbolic length, so one file serves every length; the absolute position table,
where the model has one, bounds the length at `max_position_embeddings`.

The attention is written for ONNX Runtime (`modeling/onnx_fused.py`: `com.microsoft.MultiHeadAttention` with the
position terms as its bias, made by products and relative shifts); `--kernel` writes our operator instead
(`onnx_attention.py`), `--portable` standard operators only, for other runtimes; `dispatch.decide` names the path
each layer's attention takes (`onnx-fused`, `onnx-kernel`, `onnx-portable`). The exporter's own messages
(warnings, progress) are kept from the user unless it fails.

The exported graph does not validate its input (tracing skips the checks of `modeling/validation.py`): token ids
outside the vocabulary make onnxruntime fail on a Gather, or read garbage on some providers. Validate before
calling it.

`--quantize int8` writes an int8 graph instead (`quantize_int8`): onnxruntime's dynamic quantization of the
exported graph, prepared so that every matrix product against a constant is quantized (see `quantize_int8`); its
check compares predictions (argmax agreement, largest change of a probability) with the float32 model's, since
int8 logits differ from float32 ones by far more than 1e-4. On the user's texts (`--check-texts`) the check decides:
below `--min-agreement` nothing is written. On generated inputs (random token ids, unlike anything a model was
trained on) it reports the agreement and never refuses: one flipped prediction of 64 there says little of real text.

The file is written in a temporary folder beside OUT.onnx and moved there once complete: a failed export leaves
nothing half-written.

Security: MODEL_DIR must be a local folder; weights are read from safetensors only (no pickle), and the model
classes are this package's, never code from the folder (`trust_remote_code` is not used).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import sys
import tempfile
import warnings
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
from . import onnx_attention, ort_operator

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
DEFAULT_ATTENTION = "sdpa"  # the backend whose export writes the fused graph (`modeling/onnx_fused.py`)
TOLERANCE = 1e-5
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


def load_model(
    model_dir: str | Path, task: str = "auto", attn_implementation: str = DEFAULT_ATTENTION
) -> tuple[nn.Module, str]:
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
    from transformers.utils import logging as transformers_logging

    bar = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # "Loading weights" of a local folder tells the user nothing
    try:
        model = model_class.from_pretrained(
            model_dir, config=config, use_safetensors=True, attn_implementation=attn_implementation
        )
    finally:
        if bar:
            transformers_logging.enable_progress_bar()
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


def export(
    model: nn.Module,
    task: str,
    path: str | Path,
    opset: int = DEFAULT_OPSET,
    portable: bool = False,
    kernel: bool = False,
) -> None:
    """Export with dynamic batch and sequence axes (and choices); the file is written at `path`.

    The model runs in eval mode (its mode is restored after). By default the attention is ONNX Runtime's
    MultiHeadAttention with the position terms as its bias (`modeling/onnx_fused.py`; sdpa's export); with `kernel`, our
    `disentangled::Attention` operator (`ort_operator.py`); with `portable`, standard operators only. A ValueError
    says so if the exporter wrote another graph than the one asked for."""
    if portable and kernel:
        raise ValueError("--portable and --kernel ask for two different graphs: pass one of them")
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
    if kernel and fused_layers(model):
        onnx_attention.refuse_untileable(config)
    # Traced sizes all differ (2, 3, 11), so that no two axes are taken for the same symbol.
    inputs = example_inputs(config, task, batch=2, length=min(11, max_length or 11), choices=3)
    training = model.training
    wrapper = ExportWrapper(model, output_names).eval()
    try:
        kind = "portable" if portable else "kernel" if kernel else "fused"
        with onnx_attention.graph(kind), quiet_exporter():
            program = torch.onnx.export(
                wrapper,
                (),
                kwargs=inputs,
                dynamo=True,
                dynamic_shapes={name: axes for name in inputs},
                input_names=list(inputs),
                output_names=output_names,
                opset_version=opset,
                verbose=False,
            )
    finally:
        model.train(training)
    graph = program.model_proto.graph
    if kernel and fused_layers(model) and not kernel_nodes(graph):
        raise ValueError(
            "the exporter did not write disentangled::Attention for this model (it takes 64 dimensions per head and "
            "a key mask); export without --kernel for ONNX Runtime's own fused attention"
        )
    if not portable and not kernel and fused_layers(model) and not multi_head_attention_nodes(graph):
        raise ValueError(
            "the exporter did not write ONNX Runtime's fused attention for this model; pass --portable for the "
            "standard-operator graph"
        )
    program.save(str(path))


def fused_layers(model: nn.Module) -> bool:
    """Whether the fused graph applies: the sdpa backend, with position terms and no p2p."""
    config = model.config
    terms = config.pos_att_type if config.relative_attention else []
    return (config._attn_implementation or "eager") == "sdpa" and bool(terms) and "p2p" not in terms


def multi_head_attention_nodes(graph) -> int:
    return sum(node.op_type == "MultiHeadAttention" for node in graph.node)


def kernel_nodes(graph) -> int:
    return sum(node.domain == ort_operator.DOMAIN and node.op_type == ort_operator.OPERATOR for node in graph.node)


@contextlib.contextmanager
def quiet_exporter():
    """The exporter's warnings, log lines and prints are not for the user (a "training mode" warning for a model in
    eval mode, torchvision's absence, constant folding): kept, and shown only if the export fails."""
    captured = io.StringIO()
    disabled = logging.root.manager.disable
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            yield
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise
    finally:
        logging.disable(disabled)


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


def lean_graph(path: str | Path, fuse: bool = False) -> int:
    """`einsums_to_matmuls` on the ONNX file at `path`, in place; returns the number of rewritten Einsums. With
    `fuse`, then `fuse_for_onnxruntime` (graphs for ONNX Runtime only)."""
    import onnx

    model = onnx.load(str(path))
    count = einsums_to_matmuls(model.graph)
    if count:
        onnx.save(model, str(path))
    if fuse:
        fuse_for_onnxruntime(path)
    return count


FUSED_OPERATORS = ("Gelu", "BiasGelu")


def fuse_for_onnxruntime(path: str | Path) -> dict[str, int]:
    """Two of ONNX Runtime's transformer-optimizer fusions on the file at `path`, in place: exact GELU (the exporter's
    Div, Erf, Add, Mul, Mul) into `Gelu`, then the feed-forward's bias with it into `BiasGelu`, as in an optimized
    BERT (ONNX Runtime's session fuses residual adds and LayerNorms into SkipLayerNormalization itself). The fusion
    classes only, not `optimize_model`: its attention and embedding fusions are BERT's, and its node sort takes the
    empty name of an absent optional input for a missing one. Returns the count of each fused operator."""
    import onnx
    from onnxruntime.transformers.fusion_biasgelu import FusionBiasGelu
    from onnxruntime.transformers.fusion_gelu import FusionGelu
    from onnxruntime.transformers.onnx_model import OnnxModel

    model = OnnxModel(onnx.load(str(path)))
    with quiet_exporter():
        FusionGelu(model).apply()
        FusionBiasGelu(model, is_fastgelu=False).apply()
    topological_order(model.model.graph)
    onnx.save(model.model, str(path))
    return {name: sum(node.op_type == name for node in model.model.graph.node) for name in FUSED_OPERATORS}


def topological_order(graph) -> None:
    """The graph's nodes put in an order where each comes after the nodes it reads (the fusions append theirs), in
    place; the empty name (an absent optional input) is always ready."""
    ready = {"", *(value.name for value in graph.input), *(tensor.name for tensor in graph.initializer)}
    pending, ordered = list(graph.node), []
    while pending:
        waiting = []
        for node in pending:
            if all(name in ready for name in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                waiting.append(node)
        if len(waiting) == len(pending):
            missing = sorted({name for node in waiting for name in node.input if name not in ready})[:3]
            raise ValueError(f"the ONNX graph reads values that no node makes: {missing}")
        pending = waiting
    copies = [copy.deepcopy(node) for node in ordered]
    del graph.node[:]
    graph.node.extend(copies)


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
        if ort_operator.needs_operator(float_path):  # the kernel graph: the basic optimizations with our library
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
            options.optimized_model_filepath = str(Path(folder) / "basic.onnx")
            ort_operator.register(options)
            onnxruntime.InferenceSession(str(float_path), options, providers=["CPUExecutionProvider"])
            quant_pre_process(
                options.optimized_model_filepath, str(prepared), skip_optimization=True, skip_symbolic_shape=True
            )
        else:
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
    """An onnxruntime CPU session with every graph optimization on (the int8 fusions need them), our operator's
    library loaded where the graph has `disentangled::Attention` (`--kernel`; the library written beside the graph,
    else this package's build). `spinning` False stops idle threads from spinning between calls (fairer when other
    work shares the cores)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if ort_operator.needs_operator(path):
        ort_operator.register(options, graph=path)
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
    """Per (batch, length), on padded random batches: how often the graph at `path` predicts what PyTorch does
    (`compare_predictions`)."""
    figures = {}
    runner = session(path)
    for batch, length in shapes:
        inputs = example_inputs(model.config, task, batch, length, seed=batch * 1000 + length, choices=2)
        figures[(batch, length)] = compare_predictions(model, task, runner, [inputs])
    return figures


def one_score(task: str, model: nn.Module) -> bool:
    """A reranker or regressor: one logit per sequence, whose order and size are the prediction."""
    return task == "sequence-classification" and model.config.num_labels == 1


def compare_predictions(model: nn.Module, task: str, runner, batches: list[dict]) -> dict:
    """The graph's predictions (`runner`, an onnxruntime session) against PyTorch's on `batches`.

    `agreement` is the share of argmax predictions that match over every output's last axis (a label per
    sequence or token, a start / end position, a choice, a word), padded tokens left out of per-token outputs;
    `max_prob_diff` the largest change of a softmax probability. With one logit per sequence (rerankers,
    regressors) argmax says nothing: `agreement` is the share of pairs of sequences ranked in the same order,
    `max_score_diff` the largest change of a score and `max_rank_change` the largest move of one sequence in the
    ranking. For hidden states (task "base"), which predict nothing, `agreement` is the smallest cosine similarity
    of a token's vector to PyTorch's.
    """
    _, output_names = TASKS[task]
    matches, max_prob_diff, scores = [], 0.0, ([], [])
    for inputs in batches:
        with torch.no_grad():
            expected = ExportWrapper(model, output_names).eval()(**inputs)
        actual = runner.run(output_names, {name: value.numpy() for name, value in inputs.items()})
        kept = inputs["attention_mask"].bool()
        for quantized, reference in zip(map(torch.from_numpy, actual), expected):
            if task == "base":
                matches.append(torch.cosine_similarity(quantized, reference, dim=-1)[kept])
                continue
            if one_score(task, model):
                scores[0].append(quantized.flatten())
                scores[1].append(reference.flatten())
                continue
            # per-token outputs ([B, L, C] logits; [B, L] start / end logits over positions) keep real tokens
            per_token = reference.dim() == 3 and reference.shape[:2] == kept.shape
            if reference.shape == kept.shape:  # start / end logits: padded positions are never predicted
                quantized = quantized.masked_fill(~kept, torch.finfo(quantized.dtype).min)
                reference = reference.masked_fill(~kept, torch.finfo(reference.dtype).min)
            same = quantized.argmax(-1) == reference.argmax(-1)
            matches.append((same[kept] if per_token else same.flatten()).float())
            max_prob_diff = max(max_prob_diff, (quantized.softmax(-1) - reference.softmax(-1)).abs().max().item())
    if scores[0]:
        return ranking_agreement(torch.cat(scores[0]), torch.cat(scores[1]))
    matches = torch.cat(matches)
    return {
        "agreement": (matches.min() if task == "base" else matches.mean()).item(),
        "predictions": matches.numel(),
        "max_prob_diff": max_prob_diff,
    }


def ranking_agreement(scores: Tensor, reference: Tensor) -> dict:
    """One score per sequence: the share of pairs ordered alike (pairs tied in `reference` left out), the largest
    change of a score and the largest change of a sequence's rank."""
    above = reference[:, None] > reference[None, :]  # pairs (a, b) with a ranked above b
    concordant = (scores[:, None] > scores[None, :]) & above
    pairs = int(above.sum())
    ranks = [values.argsort(descending=True).argsort() for values in (scores, reference)]
    return {
        "agreement": int(concordant.sum()) / pairs if pairs else 1.0,
        "predictions": pairs,
        "max_score_diff": (scores - reference).abs().max().item(),
        "max_rank_change": int((ranks[0] - ranks[1]).abs().max()),
    }


TEXT_SUFFIXES = {".txt": "text", ".csv": "csv", ".json": "json", ".jsonl": "json"}


def read_check_texts(path: str | Path, text_column: str, limit: int) -> list[str]:
    """Up to `limit` non-empty texts: a .txt file (one per line), or the `text_column` of a .csv / .json(l) file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--check-texts {str(path)!r} is not a file")
    kind = TEXT_SUFFIXES.get(path.suffix.lower(), "text")
    with path.open(encoding="utf-8", newline="") as handle:
        if kind == "text":
            texts = [line.strip() for line in handle]
        elif kind == "csv":
            import csv

            reader = csv.DictReader(handle)
            if text_column not in (reader.fieldnames or []):
                raise ValueError(
                    f"--check-texts {path.name}: no column {text_column!r} (columns: {reader.fieldnames}); "
                    "set --text-column"
                )
            texts = [row[text_column] or "" for row in reader]
        else:
            content = handle.read()
            try:
                rows = json.loads(content) if path.suffix.lower() == ".json" else None
            except json.JSONDecodeError:
                rows = None
            if rows is None:  # JSON lines
                rows = [json.loads(line) for line in content.splitlines() if line.strip()]
            if not all(isinstance(row, dict) and text_column in row for row in rows):
                raise ValueError(
                    f"--check-texts {path.name}: every row needs a {text_column!r} field; set --text-column"
                )
            texts = [str(row[text_column]) for row in rows]
    texts = [text for text in texts if text.strip()][:limit]
    if not texts:
        raise ValueError(f"--check-texts {path.name}: no text in the file")
    return texts


def text_batches(model_dir: str | Path, config: DisentangledConfig, texts: list[str], batch: int = 32) -> list[dict]:
    """The texts tokenized by MODEL_DIR's own tokenizer, in padded batches (longest first: little padding)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"--check-texts needs MODEL_DIR's tokenizer to tokenize the texts, and none loads from {str(model_dir)!r} "
            f"({error}); save the tokenizer into the folder (tokenizer.save_pretrained(MODEL_DIR))"
        ) from error
    longest = config.max_position_embeddings if config.position_biased_input else 512
    texts = sorted(texts, key=len, reverse=True)
    batches = []
    for first in range(0, len(texts), batch):
        encoded = tokenizer(
            texts[first : first + batch], padding=True, truncation=True, max_length=longest, return_tensors="pt"
        )
        inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
        if config.type_vocab_size > 0 and "token_type_ids" in encoded:
            inputs["token_type_ids"] = encoded["token_type_ids"]
        batches.append(inputs)
    return batches


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
    parser.add_argument(
        "model_dir",
        metavar="MODEL_DIR",
        help="local folder with config.json and model.safetensors: ours, or transformers' deberta-v2",
    )
    parser.add_argument("output", metavar="OUT.onnx", help="where to write the ONNX file")
    parser.add_argument(
        "--task", choices=["auto", *TASKS], default="auto", help="head to export (auto: config.json's architectures)"
    )
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    parser.add_argument(
        "--portable",
        action="store_true",
        help="standard ONNX operators only, for runtimes other than ONNX Runtime (slower there)",
    )
    parser.add_argument(
        "--kernel",
        action="store_true",
        help="the attention as our compiled operator disentangled::Attention (fastest in ONNX Runtime on the CPU); "
        "its library for any processor of this machine kind is written beside OUT.onnx, for the session to load "
        "(options.register_custom_ops_library)",
    )
    parser.add_argument(
        "--kernel-for",
        metavar="MACHINE",
        action="append",
        default=[],
        choices=list(ort_operator.UNITS),
        help="with --kernel: also write the operator's library for this machine kind (x86_64, aarch64), built with "
        "its cross compiler (aarch64-linux-gnu-gcc); repeatable",
    )
    parser.add_argument(
        "--attn-implementation",
        default=DEFAULT_ATTENTION,
        help=f"attention backend traced into the graph (default {DEFAULT_ATTENTION}: the fused graph; eager writes "
        "the reference's portable graph)",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=None,
        help="int8: onnxruntime's dynamic quantization of the graph (checked on predictions, not logits)",
    )
    parser.add_argument(
        "--check-texts",
        metavar="FILE",
        default=None,
        help="--quantize check on your texts: a .txt file (one text a line) or a .csv / .json(l) file (--text-column)",
    )
    parser.add_argument("--text-column", default="text", help="the text column of a .csv / .json(l) --check-texts")
    parser.add_argument(
        "--check-max-texts", type=int, default=1024, help="--check-texts: at most this many texts (default 1024)"
    )
    parser.add_argument(
        "--min-agreement",
        type=float,
        default=MIN_AGREEMENT,
        help=f"--quantize check on --check-texts: least share of matching predictions (ranked pairs, for one score) "
        f"(default {MIN_AGREEMENT}); on generated inputs the agreement is reported, never a refusal",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT.onnx if it exists")
    parser.add_argument("--no-check", action="store_true", help="skip the onnxruntime check")
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
    if args.check_texts and not args.quantize:
        raise ValueError("--check-texts checks an int8 graph: add --quantize int8 (float32 is checked at --tolerance)")
    model, task = load_model(args.model_dir, args.task, args.attn_implementation)
    texts = read_check_texts(args.check_texts, args.text_column, args.check_max_texts) if args.check_texts else None
    if args.portable and args.kernel:
        raise ValueError("--portable and --kernel ask for two different graphs: pass one of them")
    if args.kernel_for and not args.kernel:
        raise ValueError("--kernel-for writes the library of the --kernel graph: add --kernel")
    if args.kernel:
        ort_operator.library_path()  # a ValueError now, before the export, where the operator cannot run here
    machines = sorted({ort_operator.machine_kind(), *args.kernel_for}, key=list(ort_operator.UNITS).index)
    for machine in machines if args.kernel else []:  # the same for another machine kind's library
        library, why = ort_operator.build(machine)
        if library is None:
            raise ValueError(f"--kernel-for {machine}: {why}")
    portable = args.portable or not fused_layers(model)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.stem}-") as folder:
        written = Path(folder) / output.name  # beside OUT.onnx, moved there only once complete and checked
        export(model, task, written, opset=args.opset, portable=args.portable, kernel=args.kernel and not portable)
        if args.kernel and not portable:  # the operator's libraries for the serving machines; the check loads ours
            libraries = [ort_operator.write_library(folder, machine) for machine in machines]
        lean_graph(written, fuse=not portable)
        if args.quantize == "int8":
            quantize_int8(written, Path(folder) / "int8.onnx")
            os.replace(Path(folder) / "int8.onnx", written)
        graph = (
            "standard operators"
            if portable
            else "our disentangled::Attention operator"
            if args.kernel
            else "ONNX Runtime's fused attention"
        )
        kind = f"{args.quantize} " if args.quantize else ""
        print(f"exported {task} ({kind}{graph}, opset {args.opset}, dynamic batch and sequence axes)")
        if not args.no_check:
            if args.quantize:
                status = check_predictions(model, task, written, args.min_agreement, args.model_dir, texts)
            else:
                status = check_parity(model, task, written, args.tolerance)
            if status:
                print(f"nothing written to {output}")
                return status
        for file in Path(folder).iterdir():  # OUT.onnx, its external data if any, the operator's library
            if file.is_file():
                os.replace(file, output.parent / file.name)
    print(f"wrote {output}")
    if args.kernel and not portable:
        for library, machine in zip(libraries, machines):
            sets = " or ".join(ort_operator.UNITS[machine])
            print(
                f"  and beside it {library.name}: the operator's library for any {machine} processor with {sets}, "
                "needing the C library alone; a session loads it with options.register_custom_ops_library(path)"
            )
        print(f"  and {ort_operator.SIDECAR}: the operator's version and each library's instruction sets")
    if not portable and not args.kernel:  # a hint only: the library is built when a session first needs it
        print(
            "  (--kernel writes our attention operator instead: faster on the CPU, for sessions that load this "
            "package's library; see the serving page)"
        )
    return 0


def check_parity(model: nn.Module, task: str, path: Path, tolerance: float) -> int:
    """The float32 graph against PyTorch on padded random batches (`parity`)."""
    figures = parity(model, task, path, check_shapes(model.config))
    for (batch, length), figure in figures.items():
        print(
            f"onnxruntime vs PyTorch, batch {batch}, length {length}: max |diff| {figure['max_abs_diff']:.2e} "
            f"(outputs up to {figure['max_abs_reference']:.3g}; relative {relative_error(figure):.2e})"
        )
    worst = max(relative_error(figure) for figure in figures.values())
    if not worst <= tolerance:
        print(f"parity check failed: {worst:.2e} > {tolerance:.0e} (max |diff| / max(1, max |output|))")
        return 1
    return 0


def check_predictions(
    model: nn.Module,
    task: str,
    path: Path,
    min_agreement: float,
    model_dir: str | Path | None = None,
    texts: list[str] | None = None,
) -> int:
    """The quantized graph's check: its predictions against the float32 PyTorch model's (`compare_predictions`), on
    `texts` (tokenized by MODEL_DIR's tokenizer) or else on generated token ids. 1 (refuse) only where the texts
    put agreement below `min_agreement`; generated inputs inform and never refuse."""
    runner = session(path)
    on_texts = texts is not None and task != "multiple-choice"
    if on_texts:
        figures = {"your texts": compare_predictions(model, task, runner, text_batches(model_dir, model.config, texts))}
        source = f"{len(texts)} texts of --check-texts"
    else:
        figures = {
            f"batch {batch}, length {length}": compare_predictions(
                model,
                task,
                runner,
                [example_inputs(model.config, task, batch, length, seed=batch * 1000 + length, choices=2)],
            )
            for batch, length in agreement_shapes(model.config)
        }
        source = "generated inputs (random token ids)" + (
            "; multiple choice takes no --check-texts" if texts is not None else ""
        )
    if task == "base":
        measure = "smallest cosine similarity per token"
    elif one_score(task, model):
        measure = "pairs ranked alike"
    else:
        measure = "argmax agreement"
    for where, figure in figures.items():
        if one_score(task, model):
            detail = (
                f", largest score change {figure['max_score_diff']:.2e}, "
                f"largest rank change {figure['max_rank_change']}"
            )
        elif task != "base":
            detail = f", largest change of a probability {figure['max_prob_diff']:.2e}"
        else:
            detail = ""
        print(
            f"int8 onnxruntime vs float32 PyTorch on {where}: {measure} {figure['agreement']:.4f} "
            f"over {figure['predictions']} predictions{detail}"
        )
    print(f"checked on {source}")
    worst = min(figure["agreement"] for figure in figures.values())
    if not on_texts:
        below = f"{measure} {worst:.4f} is below {min_agreement} there; " if not worst >= min_agreement else ""
        print(
            f"  ({below}generated inputs inform, they do not decide: pass --check-texts FILE to check on texts "
            "like the ones you will serve)"
        )
        return 0
    if not worst >= min_agreement:
        print(
            f"prediction check failed: {measure} {worst:.4f} < {min_agreement} (--min-agreement). Keep the float32 "
            "graph (export without --quantize), or, if this change is acceptable for your use, lower --min-agreement"
        )
        return 1
    return 0
