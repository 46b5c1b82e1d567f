"""What the backends keep: the buffers the blocked sdpa paths reuse (per thread and module), and what a backend
derives from a forward's relative positions once for all its layers.

A tensor above glibc's mmap threshold is fresh memory on every allocation, whose pages fault on first touch, so
the blocks, layers and later calls of a module take their scratch tensors from one workspace that only grows
(`RelativePositions.workspace`; the encoder passes `kept_workspace(encoder)` unless `dispatch.KEEP_WORKSPACE` is off).

A compiled kernel reads the column vector in a form of its own (int32, with prefix counts, ...): `per_forward` makes
each such form on first use and keeps it in the forward's `RelativePositions`, so the reference file holds only the
column itself and each form lives with the backend that reads it (`native.kernel_columns`,
`triton_attention.column_runs`).

In `modeling/`'s layering (`__init__.py`): layer 3, the buffers of the blocked CPU paths.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from .disentangled_attention import RelativePositions

_workspaces = threading.local()  # per thread: {module: workspace}, weakly keyed (freed with the module)


def kept_workspace(module: torch.nn.Module) -> dict | None:
    """The buffers `module`'s forwards share on this thread (see `RelativePositions.workspace`).

    Kept between calls, as a caching allocator would keep them, so that a forward does not fault in fresh pages
    each time: in inference three block buffers, T, U's bands and the bias; in training a block's c2p table and a
    group's p2c table, which the backward reuses for their gradients; each as large as the largest block has
    needed (`benchmarks.cpu_inference` times fresh ones and prints what is held after a call). Every use is
    within one call of a forward or a backward, never across them. Per thread, so that threads serving one model
    never share a buffer; `release_workspace(model)` frees them."""
    held = getattr(_workspaces, "by_module", None)
    if held is None:
        held = _workspaces.by_module = weakref.WeakKeyDictionary()
    return held.setdefault(module, {})


def release_workspace(model: torch.nn.Module) -> None:
    """Free the buffers that `model` (or any of its modules) keeps on this thread."""
    held = getattr(_workspaces, "by_module", None)
    for module in model.modules() if held is not None else ():
        held.pop(module, None)


def _scratch(workspace: dict, kind: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A contiguous tensor of `shape` from the buffer `kind` of `workspace` (`kept_workspace`'s, or a forward's own),
    which only grows (a fresh allocation above glibc's mmap threshold costs page faults on every call; blocks, layers
    and later calls reuse this one)."""
    count = math.prod(shape)
    buffer = workspace.get(kind)
    if (
        buffer is None
        or buffer.numel() < count
        or (buffer.dtype, buffer.device) != (like.dtype, like.device)
        or (buffer.is_inference() and not torch.is_inference_mode_enabled())  # no in-place writes outside it
    ):
        buffer = workspace[kind] = like.new_empty(count)
        workspace.pop(f"{kind} layout", None)  # what was written into the old buffer is not in this one
    return buffer[:count].view(shape)


def per_forward(positions: RelativePositions, name: str, make: Callable[[RelativePositions], object]):
    """`make(positions)`, made on the first call for this forward's positions and kept with them (every layer of the
    forward reads the same one; a cut of them, one packed sequence, makes its own)."""
    derived = positions.derived
    if name not in derived:
        derived[name] = make(positions)
    return derived[name]


def int32_column(positions: RelativePositions) -> Tensor:
    """The column vector as int32, as the compiled kernels (`native.py`, `triton_attention.py`) read it."""
    return per_forward(positions, "int32 column", lambda positions: positions.column.to(torch.int32))
