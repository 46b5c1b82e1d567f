"""Our attention kernel as an ONNX Runtime custom operator: `disentangled::Attention` (`ort_attention.c`).

`disentangled export-onnx --kernel` writes each layer's attention as that one node (`onnx_attention.py`, the
"kernel" graph): position_bias.c's fused attention, the c2p and p2c terms made inside the tile and never written, on
ONNX Runtime's own threads. ONNX Runtime runs it once a session's options load this library:

    options = onnxruntime.SessionOptions()
    disentangled.serving.ort_operator.register(options)   # compiles it on first use, then from the cache
    session = onnxruntime.InferenceSession("model.onnx", options)

(`onnx_export.session` does this for any graph that needs it.) The library is compiled like the PyTorch kernels
(`native.py`: the system's C compiler, the processor's vector set, kept in DISENTANGLED_CACHE) and needs ONNX Runtime
1.17 or later (its KernelContext_ParallelFor); float32, 64 dimensions per head, CPU only.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..modeling import native

SOURCE = Path(__file__).with_name("ort_attention.c")
DOMAIN = "disentangled"
OPERATOR = "Attention"
MIN_ONNXRUNTIME = (1, 17)

_state: dict = {}
_lock = threading.Lock()


def _onnxruntime_too_old() -> str | None:
    import onnxruntime

    version = tuple(int(part) for part in onnxruntime.__version__.split(".")[:2] if part.isdigit())
    if version < MIN_ONNXRUNTIME:
        wanted = ".".join(map(str, MIN_ONNXRUNTIME))
        return f"onnxruntime {onnxruntime.__version__} is older than {wanted} (pip install 'onnxruntime>={wanted}')"
    return None


def _build() -> tuple[Path | None, str]:
    name, reason = native.instruction_set()
    if name == "none":
        return None, f"no vector set for the kernel: {reason}"
    if not SOURCE.is_file() or not native.SOURCE.is_file():
        return None, "no kernel source here"
    return native.compiled(SOURCE, native.flags_for(name), name, stem="ort_attention")


def why_unavailable() -> str | None:
    """Why this process cannot run `disentangled::Attention` (None: it can)."""
    too_old = _onnxruntime_too_old()
    if too_old:
        return too_old
    if "built" not in _state:
        with _lock:
            if "built" not in _state:
                _state["built"] = _build()
    library, why = _state["built"]
    return None if library is not None else why


def library_path() -> Path:
    """The compiled operator library (built on first use); a ValueError says why where it cannot be."""
    why = why_unavailable()
    if why is not None:
        raise ValueError(
            f"ONNX Runtime cannot run disentangled::Attention here: {why}. Export without --kernel for ONNX Runtime's "
            "own attention (MultiHeadAttention), which needs no library"
        )
    return _state["built"][0]


def register(options) -> None:
    """Load the operator library into onnxruntime `SessionOptions`."""
    options.register_custom_ops_library(str(library_path()))


def needs_operator(path: str | Path) -> bool:
    """Whether the ONNX file at `path` has a node of our domain (so its session must `register`)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return any(opset.domain == DOMAIN for opset in model.opset_import) or any(
        node.domain == DOMAIN for node in model.graph.node
    )
