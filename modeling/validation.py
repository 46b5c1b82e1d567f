"""Checks on what the models' forward receives: a ValueError naming the argument, what was given and what is allowed.

Without them, bad input fails late and badly: an out-of-range token id is an IndexError deep in `nn.Embedding` on
CPU and a device-side assert on CUDA; a mask of the wrong shape may broadcast silently; an additive mask
(0 / -10000, the convention of some other libraries) would invert the padding; a sequence longer than the
absolute position table indexes past it.

Cost: the shape and dtype checks read metadata only. The range checks (token ids, token types, position ids,
mask values, labels) are a min/max reduction each, gathered into one host sync per call, so they can stay on.

Under tracing (`torch.compile`, `torch.export` and the ONNX exporter, all of which set
`torch.compiler.is_compiling()`, and `torch.jit.trace`) every check is skipped: data-dependent Python branches
would break the graph or bake one input's values into it. Compiled and exported models therefore do not
validate their input; validate it before calling them, e.g. by one eager call on a representative batch.

In `modeling/`'s layering (`__init__.py`): beside the layers, the checks the model runs before any of them.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100  # CrossEntropyLoss's default: labels equal to it are not scored


def is_tracing() -> bool:
    """True while torch.compile, torch.export, the ONNX exporter or torch.jit.trace runs the model."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _shape(x: Tensor | torch.Size | tuple) -> list[int]:
    return list(x.shape if isinstance(x, Tensor) else x)


def _is_integer(x: Tensor) -> bool:
    return not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _require_integer(name: str, value: Tensor) -> None:
    if not _is_integer(value):
        raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")


def _layout(batch_dims: int) -> str:
    return "[batch, choices, length]" if batch_dims == 2 else "[batch, length]"


def input_shape(input_ids: Tensor | None, inputs_embeds: Tensor | None, batch_dims: int = 1) -> list[int]:
    """The token shape ([batch, length], or [batch, choices, length]) of the one input given."""
    if input_ids is not None and inputs_embeds is not None:
        raise ValueError("pass exactly one of input_ids or inputs_embeds, got both")
    if input_ids is None and inputs_embeds is None:
        raise ValueError("pass exactly one of input_ids or inputs_embeds, got neither")
    name, value = ("input_ids", input_ids) if input_ids is not None else ("inputs_embeds", inputs_embeds)
    _require_tensor(name, value)
    token_dims = value.dim() if input_ids is not None else value.dim() - 1
    if token_dims != batch_dims + 1:
        layout = _layout(batch_dims) if input_ids is not None else _layout(batch_dims)[:-1] + ", embedding_size]"
        raise ValueError(f"{name} must have shape {layout}, got shape {_shape(value)}")
    return _shape(value)[: batch_dims + 1]


class _ValueChecks:
    """Checks on tensor values whose statistics are read back together, in one host sync."""

    def __init__(self):
        self.stats: list[Tensor] = []  # int64 scalars
        self.judges: list = []  # (number of stats, function of them -> an error message or None), per check

    def add_range(
        self, name: str, value: Tensor, low: int | None, high: int, allowed: str, ignore: int | None = None
    ) -> None:
        """Require low <= value < high (no lower bound if low is None), or value == ignore; `allowed` says so in
        the error message."""
        if not value.numel():
            return
        value = value.long()
        if ignore is not None:  # ignored entries stand in as an allowed value
            value = value.masked_fill(value == ignore, low if low is not None else high - 1)
        self.stats += [value.min(), value.max()]

        def judge(smallest: int, largest: int) -> str | None:
            bad = smallest if low is not None and smallest < low else largest if largest >= high else None
            return None if bad is None else f"{name} contains {bad}, outside the allowed range: {allowed}"

        self.judges.append((2, judge))

    def add_mask(self, name: str, mask: Tensor) -> None:
        """Require 0 (padding) or 1 (token) in a non-bool mask; an additive 0 / -10000 mask would read inverted."""
        if mask.dtype == torch.bool or not mask.numel():
            return
        outside = (mask != 0) & (mask != 1)
        self.stats.append(outside.any().long())

        def judge(any_outside: int) -> str | None:
            if not any_outside:
                return None
            example = mask[outside][0].item()  # an error path: a second sync is fine here
            return (
                f"{name} contains {example}; it must hold 1 for tokens and 0 for padding (or be bool), "
                "not an additive mask"
            )

        self.judges.append((1, judge))

    def run(self) -> None:
        if not self.stats:
            return
        values = torch.stack(self.stats).tolist()  # the one sync
        for count, judge in self.judges:
            message, values = judge(*values[:count]), values[count:]
            if message is not None:
                raise ValueError(message)


def validate_inputs(
    config,
    input_ids: Tensor | None,
    attention_mask: Tensor | None = None,
    token_type_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
    inputs_embeds: Tensor | None = None,
    batch_dims: int = 1,
) -> None:
    """Raise a ValueError for inputs the model would fail on or silently misread.

    `batch_dims` is 2 for multiple choice ([batch, choices, length]). Checked: exactly one of `input_ids` /
    `inputs_embeds`, their shape and dtype; a length of at least 1; token ids in [0, vocab_size); the shape of
    `attention_mask` ([..., L] or pairwise [..., L, L]) and its values (0 or 1, or bool); the shape of
    `token_type_ids` and its values in [0, type_vocab_size) (with type_vocab_size=0 they are ignored, as
    DeBERTa-v3 tokenizers still emit them); the shape of `position_ids` (broadcastable to the tokens) and, when
    absolute positions are used, its values in [0, max_position_embeddings), or else a length of at most
    max_position_embeddings. Relative-only models (`position_biased_input=False`) accept any length.
    """
    if is_tracing():
        return
    shape = input_shape(input_ids, inputs_embeds, batch_dims)
    name = "input_ids" if input_ids is not None else "inputs_embeds"
    length = shape[-1]
    if length == 0:
        raise ValueError(f"{name} has a zero-length sequence (shape {_shape(shape)}); pass at least one token")
    values = _ValueChecks()
    if input_ids is not None:
        _require_integer("input_ids", input_ids)
        values.add_range(
            "input_ids", input_ids, 0, config.vocab_size, f"token ids in [0, vocab_size={config.vocab_size})"
        )
    else:
        if not inputs_embeds.dtype.is_floating_point:
            raise ValueError(f"inputs_embeds must be floating point, got dtype {inputs_embeds.dtype}")
        if inputs_embeds.shape[-1] != config.word_embedding_size:
            raise ValueError(
                f"inputs_embeds has size {inputs_embeds.shape[-1]} in its last dimension; the model's word "
                f"embeddings have size {config.word_embedding_size}"
            )

    if attention_mask is not None:
        _require_tensor("attention_mask", attention_mask)
        if _shape(attention_mask) not in (shape, shape + [length]):
            raise ValueError(
                f"attention_mask has shape {_shape(attention_mask)}; expected {shape} (one value per token) or "
                f"{shape + [length]} (pairwise) to match {name}"
            )
        values.add_mask("attention_mask", attention_mask)

    if token_type_ids is not None:
        _require_tensor("token_type_ids", token_type_ids)
        if _shape(token_type_ids) != shape:
            raise ValueError(f"token_type_ids has shape {_shape(token_type_ids)}; expected {shape} to match {name}")
        _require_integer("token_type_ids", token_type_ids)
        if config.type_vocab_size > 0:
            allowed = f"token types in [0, type_vocab_size={config.type_vocab_size})"
            values.add_range("token_type_ids", token_type_ids, 0, config.type_vocab_size, allowed)

    limit = config.max_position_embeddings
    if position_ids is not None:
        _require_tensor("position_ids", position_ids)
        shared = [1] * (len(shape) - 1) + [length]  # the same positions for every sequence
        if _shape(position_ids) not in (shape, shared):
            raise ValueError(
                f"position_ids has shape {_shape(position_ids)}; expected {shape} or {shared} to match {name}"
            )
        _require_integer("position_ids", position_ids)
        if config.position_biased_input:
            values.add_range(
                "position_ids", position_ids, 0, limit, f"positions in [0, max_position_embeddings={limit})"
            )
    elif config.position_biased_input and length > limit:
        raise ValueError(
            f"{name} has length {length}, longer than max_position_embeddings={limit} of this model's absolute "
            f"position embeddings; truncate the input to at most {limit} tokens"
        )
    values.run()


def validate_labels(
    name: str,
    labels: Tensor | None,
    shapes: list[list[int]],
    low: int | None = None,
    high: int | None = None,
    ignore_index: int | None = None,
) -> None:
    """Raise a ValueError unless `labels` has one of `shapes` and, when a bound is given, integer values with
    low <= value < high (or equal to `ignore_index`)."""
    if labels is None or is_tracing():
        return
    _require_tensor(name, labels)
    if _shape(labels) not in shapes:
        expected = " or ".join(str(shape) for shape in shapes)
        raise ValueError(f"{name} has shape {_shape(labels)}; expected {expected}")
    if low is None and high is None:
        return
    _require_integer(name, labels)
    if high is None:
        allowed = f">= {low}"
    else:
        allowed = f"[{low}, {high})" if low is not None else f"below {high} (negative labels are ignored)"
    allowed += f", or {ignore_index} to ignore" if ignore_index is not None else ""
    values = _ValueChecks()
    values.add_range(
        name, labels, low, high if high is not None else torch.iinfo(torch.long).max, allowed, ignore_index
    )
    values.run()


def validate_classification_labels(config, labels: Tensor | None, batch: int) -> None:
    """Labels of the sequence classification head, by `problem_type` (see `_loss_for_classification`)."""
    if labels is None or is_tracing():
        return
    _require_tensor("labels", labels)
    num_labels = config.num_labels
    problem = config.problem_type
    if problem is None:  # what the loss infers from the labels
        if num_labels == 1:
            problem = "regression"
        elif labels.dim() == 1 or labels.shape[-1] == 1:
            problem = "integer"
        else:
            problem = "soft"
    if problem == "regression":
        shapes = [[batch], [batch, 1]] if num_labels == 1 else [[batch, num_labels]]
        validate_labels("labels", labels, shapes)
    elif problem == "single_label_classification":
        validate_labels("labels", labels, [[batch], [batch, 1]], low=0, high=num_labels, ignore_index=IGNORE_INDEX)
    elif problem == "integer":  # DeBERTa's own convention: negative labels are ignored
        validate_labels("labels", labels.long(), [[batch], [batch, 1]], high=num_labels)
    else:  # multi_label_classification, or soft targets
        validate_labels("labels", labels, [[batch, num_labels]])
        if not labels.dtype.is_floating_point and problem == "soft":
            raise ValueError(f"labels of shape {_shape(labels)} are read as soft targets and must be floating point")


def validate_span_positions(start_positions: Tensor | None, end_positions: Tensor | None, batch: int) -> None:
    """Question answering targets: both or neither, [batch] (or [batch, 1]) integers >= 0. Positions past the
    sequence are allowed: the loss ignores them, as transformers' heads do."""
    if (start_positions is None) != (end_positions is None):
        given, missing = ("start", "end") if end_positions is None else ("end", "start")
        raise ValueError(f"{given}_positions was given without {missing}_positions; pass both for a loss, or neither")
    for name, positions in (("start_positions", start_positions), ("end_positions", end_positions)):
        validate_labels(name, positions, [[batch], [batch, 1]], low=0)
