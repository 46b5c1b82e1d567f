"""Which path serves an attention call, and why: the one function that decides (`decide`), the facts it decides
from (`Call`) and the switches it reads (`SWITCHES`).

The attention layer asks it once per call which implementation (eager, sdpa, flex_attention, or one registered with
transformers) and which path serves the call, and hands the `Decision` to the implementation: `sdpa_disentangled`
runs the path it names from its table of runners (`sdpa_attention.RUNNERS`), and decides only a call that comes
without one (from transformers' attention interface, say). Nothing decides on the way. The decision reads
facts only (device, dtype, head size, length, gradients, dropout, mask, position terms, the GPU, what is installed,
the switches), never tensor data, so `disentangled env` asks the same function what would serve a call it describes,
without running one.

Paths, in the order each device prefers them (`PATHS` says what runs each, and in which file):

    on every device  eager, flex, flex-reference, registered, sdpa-dense
    an ONNX export   onnx-kernel, onnx-fused, onnx-portable (the graph asked for: `onnx_graph`)
    CUDA             triton, then sdpa-blocked
    CPU inference    cpu-fused, cpu-bias-kernel, cpu-by-distance
    CPU training     cpu-training-kernel, cpu-training
    anything else    sdpa-blocked (p2p on the CPU, other accelerators)

A call that does not take its device's first path falls back: `Decision.skipped` names each path passed over and
why, and `log_fallback` writes one debug line for the call to the logger `disentangled.dispatch` (a fixed name, the
same in the package and in the Hub bundle). Where the user asked for an implementation that cannot serve the call
(flex with dropout, say), the attention layer also warns once.

Switches (`SWITCHES`, the one list; docs/reporting.md gives the same): each narrows a call to another path, for a bug
report or a comparison, and none changes what a call computes. Users set the environment variable before Python
starts; tests and benchmarks set this module's attribute, best through `switched(...)`, which checks the names and
restores the values. Every reader asks `switch_value(name)`.

    TRITON           DISENTANGLED_TRITON=0|1|check   the Triton kernel on CUDA off; on; on after a self-check of each
                                                     kind of call on first use (the default; `kernel_check.py`)
    CPU_KERNEL       DISENTANGLED_CPU_KERNEL=0       CPU inference in PyTorch alone (cpu-by-distance)
    CPU_FUSED        DISENTANGLED_CPU_FUSED=0        CPU inference by the bias kernel, not the fused attention
    TRAINING_KERNEL  DISENTANGLED_TRAINING_KERNEL=0  CPU training in PyTorch alone (cpu-training)
    DROPOUT_KERNEL   DISENTANGLED_DROPOUT_KERNEL=0   dropout's decisions on the CPU by PyTorch's generator
    FLEX_COMPILED    DISENTANGLED_FLEX_COMPILED=0    flex_attention's dense reference of the same score_mod
    KEEP_WORKSPACE   DISENTANGLED_KEEP_WORKSPACE=0   the CPU paths' buffers made afresh on every call

Read elsewhere, where what they govern is made: DISENTANGLED_NATIVE=0 (the CPU kernels neither built nor used),
DISENTANGLED_CPU_ISA (the instruction set they are built for) and DISENTANGLED_BFLOAT16_WARNING=0 (no warning on a
processor without bfloat16 arithmetic) in `native.py`; DISENTANGLED_CACHE (where the kernels are built and the
self-check's verdicts kept) in `native.py` and `kernel_check.py`.

The Hub bundle (`conversion/bundle.py`) carries neither `native.py` nor `kernel_check.py`: this file imports them
where they are, and the other modules reach them through it. Without them the CPU kernels' paths and the self-checked
Triton kernel are passed over, each saying so (`NOT_IN_THE_BUNDLE`), and the model logs once what it lacks and how to
get it (`without_the_package`).

In `modeling/`'s layering (`__init__.py`): beside layer 2, the decision every backend asks.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .disentangled_attention import PositionScores
from .flex_attention import FLEX_AVAILABLE
from .triton_attention import (
    DTYPES,
    FAILED_LAUNCHES,
    HEAD_SIZES,
    MAX_DROPOUT_LENGTH,
    TRITON_AVAILABLE,
    _device_facts,
)
from .triton_tiles import precision, tiles_for
from .validation import is_tracing

try:  # the package's own: the compiled CPU kernels and the Triton kernel's self-check (not in the Hub bundle)
    from . import kernel_check, native
except ImportError:  # the Hub bundle
    kernel_check = native = None
NOT_IN_THE_BUNDLE = "not in the Hub bundle (pip install disentangled)"

logger = logging.getLogger("disentangled.dispatch")
_THIS_MODULE = sys.modules[__name__]

# The switches (`SWITCHES`): module attributes, each set from its environment variable when this module is imported
# and read on every decision through `switch_value` (so a test or a benchmark may change them between calls).
SWITCHES = {  # name: (the environment variable, its default, what setting it to 0 changes)
    "TRITON": ("DISENTANGLED_TRITON", "check", "0: the Triton kernel on CUDA off; 1: on without its self-check"),
    "CPU_KERNEL": ("DISENTANGLED_CPU_KERNEL", "1", "CPU inference in PyTorch alone, not by the compiled kernels"),
    "CPU_FUSED": ("DISENTANGLED_CPU_FUSED", "1", "CPU inference by the bias kernel, not the fused attention"),
    "TRAINING_KERNEL": ("DISENTANGLED_TRAINING_KERNEL", "1", "CPU training's bias and its gradient in PyTorch"),
    "DROPOUT_KERNEL": ("DISENTANGLED_DROPOUT_KERNEL", "1", "dropout's decisions on the CPU by PyTorch's generator"),
    "FLEX_COMPILED": ("DISENTANGLED_FLEX_COMPILED", "1", "flex_attention's dense reference, not the compiled one"),
    "KEEP_WORKSPACE": ("DISENTANGLED_KEEP_WORKSPACE", "1", "the CPU paths' buffers made afresh on every call"),
}


def _from_environment(name: str):
    """A switch's value as its environment variable sets it (TRITON: the string; the others: on unless "0")."""
    variable, default, _ = SWITCHES[name]
    value = os.environ.get(variable, default)
    return value if name == "TRITON" else value != "0"


TRITON = _from_environment("TRITON")  # "0", "1" or "check"
CPU_KERNEL = _from_environment("CPU_KERNEL")
CPU_FUSED = _from_environment("CPU_FUSED")
TRAINING_KERNEL = _from_environment("TRAINING_KERNEL")
DROPOUT_KERNEL = _from_environment("DROPOUT_KERNEL")
FLEX_COMPILED = _from_environment("FLEX_COMPILED")
KEEP_WORKSPACE = _from_environment("KEEP_WORKSPACE")
TRITON_VALUES = ("0", "1", "check")
# The fused CPU kernel's workspace, all threads together, at most this (U of one plane per thread, in float32: 150 MiB
# for 32,768 tokens on 2 threads); beyond it, the bias by blocks.
FUSED_WORKSPACE_BYTES = 1 << 30
# The compiled kernel makes the band's bias where a group's p2c table (U by bucket, [g, H, keys, W]) holds at most this
# many elements (128 MiB in float32); longer inputs go by bands of U in PyTorch (`cpu_inference._attend_by_distance`).
KERNEL_TABLE_ELEMENTS = 1 << 25

PATHS = {  # path: what runs it
    "eager": "eager_disentangled: the reference, a dense [B, H, L, L] bias",
    "flex": "flex_disentangled: compiled flex_attention, a score_mod reading the position tables",
    "flex-reference": "flex_disentangled: flex_attention's dense reference of the same score_mod",
    "registered": "an attention function registered with transformers, given one dense bias",
    "sdpa-dense": "scaled_dot_product_attention with one dense bias (no position terms, or a traced graph)",
    "triton": "the fused Triton kernel (triton_attention.py)",
    "cpu-fused": "the compiled fused attention, the bias made inside its tiles (cpu_inference._attend_fused)",
    "cpu-bias-kernel": "CPU inference by distance, each block's bias by the compiled kernel (native.position_bias)",
    "cpu-by-distance": "CPU inference by distance in PyTorch (cpu_inference._attend_by_distance)",
    "cpu-training-kernel": "CPU training's blocked attention, bias and gradient by the compiled kernel",
    "cpu-training": "CPU training's blocked attention (cpu_training.BlockedAttention) in PyTorch",
    "sdpa-blocked": "scaled_dot_product_attention one block of query rows at a time, keys reversed (blocks.py)",
    "onnx-fused": "an ONNX export: ONNX Runtime's MultiHeadAttention with the position terms as its bias (onnx_fused.py)",
    "onnx-kernel": "an ONNX export: our disentangled::Attention operator (disentangled.serving.onnx_attention)",
    "onnx-portable": "an ONNX export in standard operators: one dense bias and plain attention, as sdpa-dense",
}

# Reasons two places give
UNTILED = "the bucket column steps by more than one per distance somewhere (the kernel's tiles read 16 at once)"
FAILED_CHECK = "it failed its self-check for this kind of call on this GPU (kernel_check.py)"


@dataclass(slots=True)
class Call:
    """The facts of one attention call that decide its path (`call_facts` reads them off the tensors)."""

    device: str = "cpu"  # the device type: "cpu", "cuda", ...
    dtype: torch.dtype = torch.float32  # the query's
    head_size: int = 64
    length: int = 512
    heads: int = 12
    gradients: bool = False  # autograd will run a backward through the call (training)
    dropout: float = 0.0
    mask: str = "keys"  # "none", "keys" (bool [B, 1, 1, L]), "pairs" (bool [B, 1, L, L]) or "other"
    terms: tuple[str, ...] = ("c2p", "p2c")  # the position terms; () for none
    width: int = 511  # the relative rows the input reaches (`RelativePositions.width`)
    tiled_columns: bool = True  # one distance more reads the same column or the next (`native.tiles_hold`)
    uniform: bool = True  # q, k, v of one dtype and head size; queries, keys and positions of one length
    implementation: str = "sdpa"  # asked for (`config._attn_implementation`)
    output_attentions: bool = False
    tracing: bool = False  # torch.compile, export or jit is tracing
    onnx: str | None = None  # in an ONNX export: the graph asked for (`onnx_graph`: "fused", "kernel" or "portable")
    torchscript: bool = False  # torch.jit traces (the ONNX export of torch's TorchScript exporter)
    gpu: str | None = None  # CUDA: the GPU's name and compute capability
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class Decision:
    """What serves a call (`decide`'s answer)."""

    implementation: str  # the backend function that runs: "eager", "sdpa", "flex_attention" or a registered name
    path: str  # one of PATHS
    reason: str  # why this path serves the call
    skipped: tuple[tuple[str, str], ...] = ()  # (path, why not) for each path the call's device prefers over it
    tiles: dict | None = None  # triton: the tiles of each kernel
    tiles_from: str | None = None  # triton: "a tuned profile" or "the table (TILES)"
    kind: kernel_check.Kind | None = None  # triton: the kind of call the self-check judges
    check: str | None = None  # triton: "passed", "pending" (runs before the kernel serves) or None (not asked)

    def describe(self) -> str:
        """One line: the path, why, and what it fell back from."""
        line = f"{self.path}: {self.reason}"
        if self.skipped:
            line += "; not " + "; not ".join(f"{path}: {why}" for path, why in self.skipped)
        return line


def switch_value(name: str):
    """A switch's current value, checked (a bad DISENTANGLED_TRITON is a ValueError naming the fix). Read as an
    attribute of this module (not through `globals()`, which torch.compile cannot trace)."""
    value = getattr(_THIS_MODULE, name)
    if name == "TRITON" and value not in TRITON_VALUES:
        raise ValueError(
            f"DISENTANGLED_TRITON (or dispatch.TRITON) is {value!r}; set it to 0 (the Triton kernel off), "
            "1 (on, no self-check) or check (on after a self-check: the default)"
        )
    return value


@contextlib.contextmanager
def switched(**values):
    """Set switches for the duration of a `with` block (tests, A/B timing): `with switched(CPU_KERNEL=False): ...`."""
    unknown = sorted(set(values) - set(SWITCHES))
    if unknown:
        raise ValueError(f"no switch named {', '.join(unknown)}; the switches are {', '.join(SWITCHES)}")
    before = {name: globals()[name] for name in values}
    globals().update(values)
    try:
        for name in values:
            switch_value(name)
        yield
    finally:
        globals().update(before)


def switches() -> dict:
    """Every switch's current value (for `disentangled env`)."""
    return {name: globals()[name] for name in SWITCHES}


# ---- The facts of the compiled CPU kernels (`native.py`): the one place the decision and `disentangled env` read
# them. ----


def native_instruction_set() -> tuple[str, str]:
    """The vector set the CPU kernels are built for here and why (`native.instruction_set`: the processor's best, or
    DISENTANGLED_CPU_ISA's choice; "none" where they are off)."""
    return native.instruction_set() if native is not None else ("none", NOT_IN_THE_BUNDLE)


def native_built() -> bool:
    """Whether the compiled CPU kernels run here (built on the first call; DISENTANGLED_NATIVE=0 says no)."""
    return native is not None and native.available()


def native_why_unavailable() -> str | None:
    return native.why_unavailable() if native is not None else NOT_IN_THE_BUNDLE


def native_attend(dtype: torch.dtype) -> bool:
    """Whether the fused attention is built for `dtype` here (bfloat16 needs AMX)."""
    return native.attend_available(dtype)


def native_workspace_bytes(length: int, width: int) -> int:
    return native.workspace_bytes(length, width)


def without_the_package() -> str | None:
    """In the Hub bundle, the line the model logs once: the paths it lacks without the package and how to get them;
    None in the package."""
    if native is not None:
        return None
    return (
        "This model runs as Hub remote code, without the disentangled package: attention takes PyTorch's paths, as the "
        "package's cpu-fused, cpu-bias-kernel and cpu-training-kernel (compiled CPU kernels) and triton (the Triton "
        "kernel after its self-check; DISENTANGLED_TRITON=1 runs it unchecked) are not in the bundle. For them: pip "
        "install disentangled, and load the model with the package imported, without trust_remote_code."
    )


# ---- The ONNX graph an export writes: a fact of each call made while it runs ----

ONNX_GRAPHS = ("fused", "kernel", "portable")
# The fused graph needs torch.onnx.ops.symbolic (torch 2.8 on)
ONNX_OPS = hasattr(getattr(torch.onnx, "ops", None), "symbolic")


@dataclass(frozen=True)
class OnnxGraph:
    """The attention graph an ONNX export writes (`onnx_graph`): its kind, and for the kernel graph the function that
    writes a layer's node, (query, key, value, attention_mask, scaling, position_scores) -> context [B, L, H, D]."""

    kind: str
    write: Callable | None = None


_ONNX_GRAPH = contextvars.ContextVar("disentangled ONNX graph", default=None)  # None: DEFAULT_ONNX_GRAPH
# Outside an `onnx_graph` block: the fused graph in the package; the portable one in the Hub bundle, as a model loaded
# as remote code wrote before (its user may export for any ONNX runtime, not only ONNX Runtime)
DEFAULT_ONNX_GRAPH = OnnxGraph("fused" if native is not None else "portable")


@contextlib.contextmanager
def onnx_graph(kind: str, write: Callable | None = None):
    """ONNX exports within the block write `kind` attention: "fused" (ONNX Runtime's MultiHeadAttention with the
    position terms as its bias, the default: `onnx_fused.py`), "kernel" (our `disentangled::Attention` operator,
    written by `write`) or "portable" (standard operators only).

    The kind is a fact of every call made in the block (`Call.onnx`), so `decide` answers the path the export writes
    and `disentangled env` and the debug line report it. The kernel graph's writer comes with the context, not from a
    hook: it is the package's (`disentangled.serving.onnx_attention.graph("kernel")` passes it), as it needs the
    operator's library, which modeling/ neither imports nor carries into the Hub bundle."""
    if kind not in ONNX_GRAPHS:
        raise ValueError(f"ONNX attention graph {kind!r} is not one of {list(ONNX_GRAPHS)}")
    if kind == "kernel" and write is None:
        raise ValueError("the kernel graph needs its writer: use disentangled.serving.onnx_attention.graph('kernel')")
    token = _ONNX_GRAPH.set(OnnxGraph(kind, write))
    try:
        yield
    finally:
        _ONNX_GRAPH.reset(token)


def onnx_graph_asked() -> OnnxGraph:
    """The graph ONNX exports write here and now (`onnx_graph`; DEFAULT_ONNX_GRAPH outside any block)."""
    return _ONNX_GRAPH.get() or DEFAULT_ONNX_GRAPH


# ---- The facts of a call ----


def mask_kind(attention_mask: Tensor | None) -> str:
    if attention_mask is None:
        return "none"
    if attention_mask.dtype != torch.bool:
        return "other"
    return "keys" if attention_mask.shape[-2] == 1 else "pairs"


def call_facts(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    position_scores: PositionScores | None,
    dropout: float = 0.0,
    implementation: str = "sdpa",
    output_attentions: bool = False,
) -> Call:
    """The facts of a call of the backends' signature ([B, H, L, D] q, k, v)."""
    _, heads, length, head_size = query.shape
    device, dtype, tracing = query.device, query.dtype, is_tracing()
    tensors = (query, key, value)
    terms, width, tiled, positions_length = (), 0, True, length
    if position_scores is not None:
        pos_key, pos_query, p2p = position_scores.pos_key, position_scores.pos_query, position_scores.p2p
        tensors += (pos_key, pos_query)
        terms = tuple(name for name, table in (("c2p", pos_key), ("p2c", pos_query), ("p2p", p2p)) if table is not None)
        positions = position_scores.positions
        width, positions_length = positions.width, positions.length
        if device.type == "cpu" and not tracing and native is not None:  # the CPU kernels' tiles (once a forward)
            tiled = native.kernel_columns(positions) is not None
    key_shape = key.shape
    uniform = (
        dtype == key.dtype == value.dtype
        and head_size == key_shape[-1] == value.shape[-1]
        and key_shape[-2] == length == positions_length
    )
    gpu = capability = None
    if device.type == "cuda":
        gpu, capability = _device_facts(device)
    return Call(
        device=device.type,
        dtype=dtype,
        head_size=head_size,
        length=length,
        heads=heads,
        gradients=torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors),
        dropout=dropout,
        mask=mask_kind(attention_mask),
        terms=terms,
        width=width,
        tiled_columns=tiled,
        uniform=uniform,
        implementation=implementation,
        output_attentions=output_attentions,
        tracing=tracing,
        onnx=onnx_graph_asked().kind if torch.onnx.is_in_onnx_export() else None,
        torchscript=torch.jit.is_tracing(),
        gpu=gpu,
        capability=capability,
    )


# ---- The decision ----


def decide(call: Call) -> Decision:
    """The path that serves `call`, with the reason, and the paths it fell back from."""
    skipped = []
    implementation = call.implementation
    if call.output_attentions and implementation != "eager":
        skipped.append(
            (implementation, f"{implementation} attention returns no probabilities; output_attentions=True runs eager")
        )
        implementation = "eager"
    if implementation == "flex_attention":
        why = _flex_refusal(call)
        if why is None:
            compiled = switch_value("FLEX_COMPILED")
            path = "flex" if compiled else "flex-reference"
            reason = "asked for" + ("" if compiled else " (FLEX_COMPILED off: the dense reference)")
            return Decision("flex_attention", path, reason, tuple(skipped))
        skipped.append(("flex", why))
        implementation = "sdpa"
    if implementation == "eager":
        reason = "output_attentions=True" if call.output_attentions else "asked for"
        return Decision("eager", "eager", reason, tuple(skipped))
    if implementation != "sdpa":
        return Decision(implementation, "registered", f"{implementation!r} asked for", tuple(skipped))
    return _sdpa_path(call, skipped)


def _flex_refusal(call: Call) -> str | None:
    if not FLEX_AVAILABLE:
        return "flex_attention needs torch >= 2.5; running sdpa"
    if call.dropout > 0:
        return "flex_attention takes no attention dropout; training with dropout runs sdpa"
    if call.gradients and call.device == "cpu":
        return "compiled flex_attention runs inference only on CPU; with gradients, running sdpa"
    return None


def _sdpa_path(call: Call, skipped: list) -> Decision:
    if not call.terms:
        return Decision("sdpa", "sdpa-dense", "no position terms: torch's own fused kernels", tuple(skipped))
    if call.onnx is not None:
        return _onnx_path(call, skipped)
    if call.tracing:
        return Decision("sdpa", "sdpa-dense", "a graph is traced (compile, export): one dense bias", tuple(skipped))
    if call.device != "cpu":
        why, tiles = _triton_refusal(call)
        if why is None:
            return _triton_decision(call, skipped, tiles)
        return blocked_instead(tuple(skipped), why)
    if "p2p" in call.terms:
        skipped.append(("cpu-by-distance" if not call.gradients else "cpu-training", "they take no p2p term"))
        return Decision("sdpa", "sdpa-blocked", "p2p on the CPU", tuple(skipped))
    if call.gradients:
        why = _training_kernel_refusal(call)
        if why is None:
            return Decision("sdpa", "cpu-training-kernel", "CPU training, compiled kernel built", tuple(skipped))
        skipped.append(("cpu-training-kernel", why))
        return Decision("sdpa", "cpu-training", "CPU training in PyTorch", tuple(skipped))
    if call.dropout > 0:
        skipped.append(
            ("cpu-by-distance", "attention dropout without gradients (a training-mode module under no_grad)")
        )
        return Decision("sdpa", "sdpa-blocked", "dropout in CPU inference", tuple(skipped))
    fused = _fused_refusal(call)
    if fused is None:
        return Decision("sdpa", "cpu-fused", f"CPU inference in {_name(call.dtype)}, compiled kernel", tuple(skipped))
    skipped.append(("cpu-fused", fused))
    bias = _bias_kernel_refusal(call)
    if bias is None:
        return Decision("sdpa", "cpu-bias-kernel", "CPU inference, compiled bias kernel", tuple(skipped))
    if bias != fused:
        skipped.append(("cpu-bias-kernel", bias))
    return Decision("sdpa", "cpu-by-distance", "CPU inference in PyTorch", tuple(skipped))


def _onnx_path(call: Call, skipped: list) -> Decision:
    """An ONNX export's attention: the graph asked for (`onnx_graph`), or the next that can serve the call."""
    asked, why = call.onnx, _onnx_refusal(call)
    if asked == "kernel":
        kernel_why = why or _onnx_kernel_refusal(call)
        if kernel_why is None:
            return Decision("sdpa", "onnx-kernel", "an ONNX export, the kernel graph asked for", tuple(skipped))
        skipped.append(("onnx-kernel", kernel_why))
    if asked != "portable":
        if why is None:
            return Decision("sdpa", "onnx-fused", "an ONNX export", tuple(skipped))
        if asked == "fused":
            skipped.append(("onnx-fused", why))
    reason = "the portable graph asked for" if asked == "portable" else "standard operators"
    return Decision("sdpa", "onnx-portable", f"an ONNX export, {reason}", tuple(skipped))


def _onnx_refusal(call: Call) -> str | None:
    """Why an ONNX export cannot write the fused (or the kernel) graph for this call."""
    if "p2p" in call.terms:
        return "ONNX Runtime's attention takes no p2p term"
    if call.torchscript:
        return "torch's TorchScript exporter (dynamo=False) writes standard operators only"
    if not ONNX_OPS:
        return "the fused graph needs torch.onnx.ops (torch 2.8 or later)"
    return None


def _onnx_kernel_refusal(call: Call) -> str | None:
    if call.head_size != 64:
        return f"our operator takes 64 dimensions per head, not {call.head_size}"
    if call.mask not in ("none", "keys"):
        return "our operator takes no mask or a key mask, not a mask of query-key pairs"
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _columns(width: int) -> int:
    """The kernels' tables are padded to a multiple of 16 columns."""
    return -(-width // 16) * 16


def _native_refusal(call: Call) -> str | None:
    """Why the compiled CPU kernels cannot take this call at all."""
    if call.dtype not in (torch.float32, torch.bfloat16):
        return f"the compiled kernels take float32 or bfloat16, not {_name(call.dtype)}"
    if not native_built():
        return f"the compiled kernel does not run here: {native_why_unavailable()}"
    return None


def _bias_kernel_refusal(call: Call) -> str | None:
    if not switch_value("CPU_KERNEL"):
        return "switched off (dispatch.CPU_KERNEL; DISENTANGLED_CPU_KERNEL=0)"
    if call.heads * call.length * _columns(call.width) > KERNEL_TABLE_ELEMENTS:
        return "a sequence's p2c table would exceed dispatch.KERNEL_TABLE_ELEMENTS"
    if (why := _native_refusal(call)) is not None:
        return why
    if not call.tiled_columns:
        return UNTILED
    return None


def _fused_refusal(call: Call) -> str | None:
    if not switch_value("CPU_KERNEL"):
        return "switched off (dispatch.CPU_KERNEL; DISENTANGLED_CPU_KERNEL=0)"
    if not switch_value("CPU_FUSED"):
        return "switched off (dispatch.CPU_FUSED; DISENTANGLED_CPU_FUSED=0)"
    if call.head_size != 64:
        return f"it takes 64 dimensions per head, not {call.head_size}"
    if call.mask not in ("none", "keys"):
        return "it takes no mask or a key mask, not a mask of query-key pairs"
    if (why := _native_refusal(call)) is not None:
        return why
    if not call.tiled_columns:
        return UNTILED
    if not native_attend(call.dtype):
        return "bfloat16 needs a processor with AMX and AVX512-BF16 (and the AMX tiles allowed)"
    if native_workspace_bytes(call.length, _columns(call.width)) > FUSED_WORKSPACE_BYTES:
        return "its workspace would exceed dispatch.FUSED_WORKSPACE_BYTES"
    return None


def _training_kernel_refusal(call: Call) -> str | None:
    if not switch_value("TRAINING_KERNEL"):
        return "switched off (dispatch.TRAINING_KERNEL; DISENTANGLED_TRAINING_KERNEL=0)"
    return _native_refusal(call)


def _triton_refusal(call: Call) -> tuple[str | None, dict | None]:
    """Why the Triton kernel cannot serve the call (None if it can), and its tiles where it can."""
    if switch_value("TRITON") == "0":
        return "switched off (DISENTANGLED_TRITON=0)", None
    if not TRITON_AVAILABLE:
        return "triton is not installed", None
    if call.device != "cuda":
        return f"the Triton kernel runs on CUDA devices, not {call.device}", None
    if torch.version.hip is not None:
        return "the Triton kernel is not tested on ROCm", None
    capability = call.capability
    if capability is not None and (capability < (7, 0) or (call.dtype == torch.bfloat16 and capability < (8, 0))):
        return f"the Triton kernel needs compute capability 7.0 (8.0 for bfloat16), not {capability}", None
    if call.dtype not in DTYPES or not call.uniform:
        return "the Triton kernel takes self-attention with q, k, v of one dtype (float16, bfloat16 or float32)", None
    if call.head_size not in HEAD_SIZES:
        return f"the Triton kernel takes head sizes {HEAD_SIZES}, not {call.head_size}", None
    if call.mask not in ("none", "keys"):
        return "the Triton kernel takes a boolean key-padding mask [B, 1, 1, L], not a pair mask", None
    if call.dropout > 0 and call.length > MAX_DROPOUT_LENGTH:
        return f"the Triton kernel's dropout counts pairs in int32: at most {MAX_DROPOUT_LENGTH} tokens", None
    if capability is None:
        return "the GPU's compute capability is unknown", None
    tiles = tiles_for(capability, call.dtype, call.head_size, call.gpu)
    if tiles is None:
        return (
            f"no {precision(call.dtype)} tiles of head size {call.head_size} fit compute capability "
            f"{capability[0]}.{capability[1]} without spilling (triton_tiles.TILES)"
        ), None
    failed = FAILED_LAUNCHES.get((call.gpu, tuple(capability), call.dtype, call.head_size))
    if failed is not None:
        return f"the Triton kernel failed to launch on this GPU before: {failed}", None
    return None, tiles


def kind_of(call: Call, tiles: dict) -> kernel_check.Kind:
    """The self-check's kind of this call (`kernel_check.Kind`)."""
    return kernel_check.Kind(
        gpu=call.gpu or "unknown GPU",
        capability=tuple(call.capability),
        dtype=_name(call.dtype),
        head_size=call.head_size,
        training=call.gradients,
        mask=call.mask == "keys",
        dropout=call.dropout > 0,
        terms=call.terms,
        aligned=call.length % 16 == 0,
        tiles=tuple(sorted((name, tuple(tile)) for name, tile in tiles.items())),
    )


def _triton_decision(call: Call, skipped: list, tiles: dict) -> Decision:
    tuned = tiles != tiles_for(call.capability, call.dtype, call.head_size, None)
    tiles_from = "a tuned profile (triton_tiles.json)" if tuned else "the table (triton_tiles.TILES)"
    reason = f"CUDA, compute capability {call.capability[0]}.{call.capability[1]}, tiles from {tiles_from}"
    if switch_value("TRITON") == "1":
        return Decision("sdpa", "triton", reason + ", no self-check (DISENTANGLED_TRITON=1)", tuple(skipped), tiles,
                        tiles_from)  # fmt: skip
    if kernel_check is None:
        why = f"its self-check is {NOT_IN_THE_BUNDLE}; DISENTANGLED_TRITON=1 runs it unchecked"
        return blocked_instead(tuple(skipped), why)
    kind = kind_of(call, tiles)
    found = kernel_check.verdict(kind)
    if found is None:
        return Decision("sdpa", "triton", reason + ", self-check on first use", tuple(skipped), tiles, tiles_from,
                        kind, "pending")  # fmt: skip
    if found["passed"]:
        return Decision("sdpa", "triton", reason + ", self-check passed", tuple(skipped), tiles, tiles_from, kind,
                        "passed")  # fmt: skip
    return blocked_instead(tuple(skipped), FAILED_CHECK)


def blocked_instead(skipped: tuple, why: str) -> Decision:
    """sdpa's blocked path for a call on an accelerator that the Triton kernel does not serve (`why`); also what
    `sdpa_attention._run_triton` runs when the kernel's self-check fails or it cannot launch."""
    return Decision("sdpa", "sdpa-blocked", "sdpa's own path on this device", (*skipped, ("triton", why)))


def log_fallback(decision: Decision) -> None:
    """One debug line for a call that fell back, naming each path passed over and why."""
    if decision.skipped and logger.isEnabledFor(logging.DEBUG):
        logger.debug("attention runs %s", decision.describe())
