"""Our attention kernel as an ONNX Runtime custom operator: `disentangled::Attention` (`ort_attention.c`).

`disentangled export-onnx --kernel` writes each layer's attention as that one node (`onnx_attention.py`, the
"kernel" graph): position_bias.c's fused attention, the c2p and p2c terms made inside the tile and never written, on
ONNX Runtime's own threads. ONNX Runtime runs it once a session's options load this library:

    options = onnxruntime.SessionOptions()
    disentangled.serving.ort_operator.register(options)   # compiles it on first use, then from the cache
    session = onnxruntime.InferenceSession("model.onnx", options)

(`onnx_export.session` does this for any graph that needs it.) The export also writes the library beside the graph
(`write_library`: `disentangled_attention_x86_64.so` and the sidecar `disentangled_attention.json`), for a serving
machine with ONNX Runtime alone: `options.register_custom_ops_library(path)`, no package, no compiler.

One library serves every processor of its machine kind: `ort_attention.c` is compiled once per instruction set
(`UNITS`: AVX-512 and AVX2 on x86-64, NEON on aarch64) with portable flags, never the build machine's own, and
`ort_dispatch.c` chooses the unit when ONNX Runtime loads it, from the processor's flags (DISENTANGLED_CPU_ISA names
a lower set, to test or time it); a processor with none of them gets an error, not an illegal instruction. No
OpenMP: the library needs the C library alone. The system's C compiler builds it (CC, else cc, gcc or clang; for
aarch64 on another machine, aarch64-linux-gnu-gcc) into DISENTANGLED_CACHE, keyed by the sources, the compiler and
the flags; the library a `disentangled build-kernels` folder holds is taken instead where DISENTANGLED_KERNELS names
that folder, or where no compiler is found and a wheel carries it (native.PREBUILT). ONNX Runtime 1.17 or later
(its KernelContext_ParallelFor); float32, 64 dimensions per head, CPU only.

Each graph's nodes carry the operator version they were written for (`OPERATOR_VERSION`, the `version` attribute),
and a library of another version refuses the graph when the session is made.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from ..modeling import native
from ..modeling.native import machine_kind

SOURCE = Path(__file__).with_name("ort_attention.c")
DISPATCH = Path(__file__).with_name("ort_dispatch.c")
DOMAIN = "disentangled"
OPERATOR = "Attention"
OPERATOR_VERSION = 1  # ort_attention.c's OPERATOR_VERSION: a change of the operator's inputs or meaning raises both
MIN_ONNXRUNTIME = (1, 17)
# Per machine kind, each unit's instruction set and flags, best first (ort_dispatch.c checks the processor for each
# flag): the portable flags the PyTorch kernels' prebuilt libraries take too.
UNITS = {machine: {name: native.PORTABLE_FLAGS[name] for name in sets} for machine, sets in native.MACHINE_SETS.items()}
FLAGS = ("-O3", "-fPIC", "-std=gnu11", "-Werror=implicit-function-declaration")
CROSS_COMPILERS = {"aarch64": "aarch64-linux-gnu-gcc"}  # for a library of another machine kind than this one
SIDECAR = "disentangled_attention.json"

_state: dict = {}
_lock = threading.Lock()


def _onnxruntime_too_old() -> str | None:
    import onnxruntime

    version = tuple(int(part) for part in onnxruntime.__version__.split(".")[:2] if part.isdigit())
    if version < MIN_ONNXRUNTIME:
        wanted = ".".join(map(str, MIN_ONNXRUNTIME))
        return f"onnxruntime {onnxruntime.__version__} is older than {wanted} (pip install 'onnxruntime>={wanted}')"
    return None


def library_name(machine: str | None = None) -> str:
    """The file name of the library for a machine kind: disentangled_attention_x86_64.so, ..._aarch64.so."""
    return f"disentangled_attention_{machine_kind(machine)}.so"


def compiler_for(machine: str) -> str | None:
    """The C compiler that builds for machine kind `machine` here: the system's for this machine's kind (CC, else cc,
    gcc or clang), else the cross compiler (`CROSS_COMPILERS`); None where there is none."""
    if machine == machine_kind():
        return native._compiler()
    cross = CROSS_COMPILERS.get(machine)
    return shutil.which(cross) if cross else None


def build(machine: str | None = None) -> tuple[Path | None, str]:
    """The library for every processor of `machine` (default: this one's kind), compiled into the cache or found
    there: (its path, "") or (None, why not). Each unit of `UNITS[machine]` is `ort_attention.c` compiled with its
    set's flags and -DORT_UNIT=register_<set>; `ort_dispatch.c`, compiled with none, chooses among them."""
    machine = machine_kind(machine)
    if machine not in UNITS:
        return None, f"the operator library is built for {' and '.join(UNITS)}, not {machine}"
    compiler = compiler_for(machine)
    if compiler is None:
        wanted = "cc, gcc or clang" if machine == machine_kind() else CROSS_COMPILERS[machine]
        return None, f"no C compiler ({wanted}) on PATH"
    if not all(path.is_file() for path in (SOURCE, DISPATCH, native.SOURCE, *native.HEADERS)):
        return None, "no kernel source here"
    sources = [path.read_bytes() for path in (SOURCE, DISPATCH, native.SOURCE, *native.HEADERS)]
    units = UNITS[machine]
    parts = [*sources, compiler.encode(), " ".join(FLAGS).encode(), repr(units).encode(), machine.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    cache = Path(os.environ.get("DISENTANGLED_CACHE", Path.home() / ".cache" / "disentangled"))
    library = cache / f"{Path(library_name(machine)).stem}-{key}.so"
    if library.is_file():
        return library, ""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as folder:
            partial = Path(folder) / library.name
            for command in build_commands(compiler, machine, partial):
                subprocess.run(command, check=True, capture_output=True)
            os.replace(partial, library)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = (getattr(error, "stderr", b"") or b"").decode(errors="replace")[-300:]
        return None, f"compiling the operator library for {machine} failed: {error} {detail}".strip()
    return library, ""


def build_commands(compiler: str, machine: str, library: Path, warnings: tuple[str, ...] = ()) -> list[list[str]]:
    """The commands that build `library` for `machine`: a unit per instruction set (`ort_attention.c` with the set's
    flags, -DORT_UNIT=register_<set>), the dispatcher with no vector flags, then the link (the C library and libm
    only); `warnings` are added to each compile (the tests' -Wall -Wextra -Werror)."""
    objects, commands = [], []
    for name, flags in [*UNITS[machine].items(), ("dispatch", None)]:
        objects.append(str(library.with_name(f"{library.stem}-{name}.o")))
        if flags is None:
            source, defines = DISPATCH, []
        else:
            source, defines = SOURCE, [*flags, f"-DORT_UNIT=register_{name}", f"-I{native.SOURCE.parent}"]
        commands.append([compiler, *FLAGS, *warnings, *defines, "-c", str(source), "-o", objects[-1]])
    return [*commands, [compiler, *FLAGS, "-shared", *objects, "-o", str(library), "-lm"]]


def write_library(folder: str | Path, machine: str | None = None) -> Path:
    """The library for `machine` (default: this one's kind) copied into `folder` as `library_name(machine)`, and
    `folder`'s sidecar (SIDECAR) saying what it is: the operator and its version, the machine kind, the instruction
    sets (best first), what it needs. A ValueError says why where it cannot be built."""
    machine = machine_kind(machine)
    built, why = build(machine)
    if built is None:
        raise ValueError(f"the operator library for {machine} cannot be built here: {why}")
    folder = Path(folder)
    target = folder / library_name(machine)
    shutil.copyfile(built, target)
    sidecar = folder / SIDECAR
    described = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
    libraries = described.get("libraries", {}) if described.get("version") == OPERATOR_VERSION else {}
    libraries[target.name] = {
        "machine": machine,
        "instruction_sets": list(UNITS[machine]),
        "chosen": "when ONNX Runtime loads it, the best set the processor runs (DISENTANGLED_CPU_ISA names another)",
        "needs": f"the C library; onnxruntime >= {'.'.join(map(str, MIN_ONNXRUNTIME))}, CPU provider",
    }
    described = {"operator": f"{DOMAIN}::{OPERATOR}", "version": OPERATOR_VERSION, "libraries": libraries}
    sidecar.write_text(json.dumps(described, indent=2) + "\n")
    return target


def _build() -> tuple[Path | None, str]:
    name, reason = native.instruction_set()
    if name == "none":
        return None, f"no vector set for the kernel: {reason}"
    folder = os.environ.get(native.KERNELS) or (native.PREBUILT if native._compiler() is None else None)
    if folder and (Path(folder) / library_name()).is_file():  # `disentangled build-kernels`' library, or the wheel's
        return Path(folder) / library_name(), ""
    return build()


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


def register(options, graph: str | Path | None = None) -> None:
    """Load the operator library into onnxruntime `SessionOptions`: the one `export-onnx --kernel` wrote beside
    `graph` where there is one (what a serving machine loads), else this package's build."""
    # an absolute path: dlopen reads a bare file name ("classifier.onnx"'s neighbour) as a name to search the system for
    shipped = Path(graph).absolute().parent / library_name() if graph is not None else None
    options.register_custom_ops_library(str(shipped if shipped and shipped.is_file() else library_path()))


def needs_operator(path: str | Path) -> bool:
    """Whether the ONNX file at `path` has a node of our domain (so its session must `register`)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return any(opset.domain == DOMAIN for opset in model.opset_import) or any(
        node.domain == DOMAIN for node in model.graph.node
    )
