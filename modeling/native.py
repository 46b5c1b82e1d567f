"""The CPU kernels of `position_bias.c`, compiled on first use: a block's position bias in one pass, and attention
with the position terms made inside its tiles (bfloat16 on AMX, float32 with any vector set).

`position_bias(...)` writes a block's bias c2p[i, δ(i - j)] + p2c[j, δ(i - j)] from the two tables in one pass,
where PyTorch's operators need a gather or a transposing copy, and an add (`cpu_inference._KernelTables`).
`attend(...)` is the whole attention (`attend_available(dtype)`): T and U made in cache (on the AMX tiles in bfloat16),
the bias added tile by tile, flash attention's online softmax; no bias is written (`cpu_inference._attend_fused`).
`hankel_bias(...)` and `hankel_bias_backward(...)` are CPU training's: a block's bias with the keys in reverse order,
and dS summed into the two tables' gradients (`sdpa_attention.BlockedAttention`).

The kernels are written once over a vector layer with three implementations (`position_bias_avx512.h`,
`position_bias_avx2.h`, `position_bias_neon.h`); `instruction_set()` chooses one and says why: the best the
processor has (AVX-512 F + BW, else AVX2 + FMA on x86-64; NEON on aarch64), or a lower one named by
DISENTANGLED_CPU_ISA=avx512|avx2|neon|none (so that an AVX-512 machine can test and time the AVX2 build; "none" is
the pure-PyTorch path). A set the processor does not run is a ValueError naming those it does.

The C source, its headers and this file ship with the package, not with the Hub bundle (`conversion/bundle.py`),
whose model takes the PyTorch paths and says so once (`dispatch.without_the_package`). On first use they are
compiled with the system's C compiler (`cc -O3 -fopenmp -shared` and the set's flags, `SET_FLAGS`: -march=native for
AVX-512, so that AMX comes with it where the processor has it; about a second) into a cache folder keyed by the
sources, the compiler, the flags, the set and the processor's flags (DISENTANGLED_CACHE, else
~/.cache/disentangled), written under a temporary name and renamed, so that a failed or concurrent build leaves
nothing half-written.

A machine without a compiler loads a library built ahead of time (`disentangled build-kernels DIR` writes one per
machine kind and vector set, with the set's own flags and none of the build machine's, `PORTABLE_FLAGS`): from the
folder DISENTANGLED_KERNELS names (always, where it is set), else from the package's own `prebuilt/` folder, which a
wheel carries. The set is chosen from the processor's flags as above. A library's name carries the version of the
kernels it was built from (`kernels_version`, a digest of the C source and its headers), and a library of another
version is refused with a ValueError naming both, never run. `loaded_library()` says which library runs and where
it came from (`disentangled env` prints it). Where none of this can happen (no source, no compiler and no prebuilt
library, a failed build, no vector set, not Linux, or DISENTANGLED_NATIVE=0) `available()` is False and the callers
take the pure-PyTorch path; the tests compare both against eager.

In `modeling/`'s layering (`__init__.py`): layer 3, the compiled CPU kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .workspace import int32_column, per_forward

SOURCE = Path(__file__).with_name("position_bias.c")
HEADERS = [SOURCE.with_name(f"position_bias{part}.h") for part in ("", "_avx512", "_avx2", "_neon", "_amx")]


class _BiasArgs(ctypes.Structure):
    _fields_ = [
        ("c2p", ctypes.c_void_p),
        ("c2p_plane", ctypes.c_int64),
        ("c2p_head", ctypes.c_int64),
        ("c2p_row", ctypes.c_int64),
        ("p2c", ctypes.c_void_p),
        ("p2c_plane", ctypes.c_int64),
        ("p2c_head", ctypes.c_int64),
        ("p2c_row", ctypes.c_int64),
        ("column", ctypes.c_void_p),
        ("c2p_column", ctypes.c_void_p),
        ("keep", ctypes.c_void_p),
        ("keep_plane", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("heads", ctypes.c_int64),
        ("first_row", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("first_key", ctypes.c_int64),
        ("keys", ctypes.c_int64),
        ("length", ctypes.c_int64),
        ("width", ctypes.c_int64),
    ]


STRIDES = ("sequence", "head", "row")


class _AttendArgs(ctypes.Structure):
    _fields_ = [
        ("query", ctypes.c_void_p),
        ("key", ctypes.c_void_p),
        ("value", ctypes.c_void_p),
        *[(f"{name}_{stride}", ctypes.c_int64) for name in ("query", "key", "value") for stride in STRIDES],
        ("out", ctypes.c_void_p),
        *[(f"out_{stride}", ctypes.c_int64) for stride in STRIDES],
        ("pos_key", ctypes.c_void_p),
        ("pos_query", ctypes.c_void_p),
        ("width", ctypes.c_int64),
        ("column", ctypes.c_void_p),
        ("c2p_column", ctypes.c_void_p),
        ("keep", ctypes.c_void_p),
        ("keep_sequence", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("length", ctypes.c_int64),
        ("first_key", ctypes.c_int64),
        ("keys", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("workspace", ctypes.c_void_p),
    ]


class _HankelArgs(ctypes.Structure):
    _fields_ = [
        ("scores", ctypes.c_void_p),
        ("t", ctypes.c_void_p),
        ("t_sequence", ctypes.c_int64),
        ("t_head", ctypes.c_int64),
        ("t_row", ctypes.c_int64),
        ("u", ctypes.c_void_p),
        ("u_sequence", ctypes.c_int64),
        ("u_head", ctypes.c_int64),
        ("u_row", ctypes.c_int64),
        ("column", ctypes.c_void_p),
        ("heads", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("keys", ctypes.c_int64),
        ("width", ctypes.c_int64),
        ("tiled", ctypes.c_int64),
        ("add_u", ctypes.c_int64),
        ("band_lines", ctypes.c_int64),
        ("t_tile", ctypes.c_int64),
        ("u_tile", ctypes.c_int64),
        ("t_first", ctypes.c_void_p),
        ("u_first", ctypes.c_void_p),
    ]


class _KeepArgs(ctypes.Structure):
    _fields_ = [
        ("out", ctypes.c_void_p),
        ("count", ctypes.c_int64),
        ("seed", ctypes.c_uint64),
        ("threshold", ctypes.c_int64),
    ]


_state: dict = {}
_lock = threading.Lock()


def _cpu_flags() -> str:
    """The processor's feature line of /proc/cpuinfo: x86's `flags`, aarch64's `Features` ("" where unreadable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _aarch64_has_neon() -> bool:
    """Advanced SIMD on aarch64: `asimd` in /proc/cpuinfo's Features, else the kernel's HWCAP bit (HWCAP_ASIMD)."""
    line = _cpu_flags()
    if line:
        return "asimd" in line.partition(":")[2].split()
    try:
        getauxval = ctypes.CDLL(None).getauxval
        getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
        return bool(getauxval(16) & (1 << 1))  # AT_HWCAP; HWCAP_ASIMD
    except (OSError, AttributeError):
        return False


INSTRUCTION_SETS = ("avx512", "avx2", "neon", "none")


def _processor_sets() -> tuple[list[str], str]:
    """The vector sets this processor runs, best first ("none" last), and what they were read from."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        flags = set(_cpu_flags().partition(":")[2].split())
        sets = [
            name for name, needs in (("avx512", {"avx512f", "avx512bw"}), ("avx2", {"avx2", "fma"})) if needs <= flags
        ]
        named = " ".join(flag for flag in ("avx2", "fma", "avx512f", "avx512bw", "amx_bf16") if flag in flags)
        return [*sets, "none"], f"an x86-64 processor with {named or 'none of avx2, fma, avx512f, avx512bw'}"
    if machine in ("aarch64", "arm64"):
        if _aarch64_has_neon():
            return ["neon", "none"], "an aarch64 processor with asimd (NEON)"
        return ["none"], "an aarch64 processor without asimd"
    return ["none"], f"a {machine or 'processor of unknown kind'} processor (kernels for x86-64 and aarch64 only)"


def instruction_set() -> tuple[str, str]:
    """The vector set the CPU kernels are built for here, and why: ("avx512" | "avx2" | "neon" | "none", reason).

    The best the processor has, unless DISENTANGLED_CPU_ISA names another it runs (a lower one, to test or time it);
    "none" (no kernels: the pure-PyTorch path) where it has none, where DISENTANGLED_NATIVE=0 turns them off, or off
    Linux. Nothing is compiled to answer. Raises ValueError where DISENTANGLED_CPU_ISA names an unknown set or one
    this processor does not run."""
    requested = os.environ.get("DISENTANGLED_CPU_ISA", "").strip().lower()
    if requested and requested not in INSTRUCTION_SETS:
        raise ValueError(
            f"DISENTANGLED_CPU_ISA={requested!r} is not an instruction set of the CPU kernels: set one of "
            f"{', '.join(INSTRUCTION_SETS)}, or unset it for the best this processor has"
        )
    sets, processor = _processor_sets()
    if requested and requested not in sets:
        raise ValueError(
            f"DISENTANGLED_CPU_ISA={requested}: this is {processor}, which runs {', '.join(sets)}; set one of those, "
            "or unset it for the best this processor has"
        )
    if os.environ.get("DISENTANGLED_NATIVE", "1") == "0":
        return "none", "turned off by DISENTANGLED_NATIVE=0"
    if sys.platform != "linux":
        return "none", f"the kernels are built on Linux only (this is {sys.platform})"
    if requested:
        return requested, f"DISENTANGLED_CPU_ISA={requested} ({processor}; its best is {sets[0]})"
    if sets[0] == "none":
        return "none", f"no vector set the kernels are written for ({processor})"
    return sets[0], f"the best this processor has ({processor})"


# bfloat16 without bfloat16 arithmetic: PyTorch's CPU operators convert to float32 and back around each product, so
# every model (ours, transformers' DeBERTa, BERT) runs several times slower than in float32. Measured on a 2-core AMD
# EPYC with AVX2 + FMA, no avx512_bf16 or AMX (torch 2.13, DeBERTa-v3-base shape, 2 layers): BFLOAT16_SLOWDOWN, the
# bfloat16 time over the float32 time of ours-sdpa (benchmarks/records/run.jsonl, the two `benchmarks.run` records
# of the note in docs/performance.md's CPU section).
BFLOAT16_SLOWDOWN = "5 to 7 times"
BFLOAT16_WARNING = "DISENTANGLED_BFLOAT16_WARNING"  # 0: no warning
_bfloat16_checked: list[bool] = []


def missing_bfloat16_arithmetic() -> list[str]:
    """The extensions for bfloat16 arithmetic this processor lacks: on x86-64 avx512_bf16 and amx_bf16 (either one
    serves PyTorch's bfloat16 products), on aarch64 bf16; [] where it has one (or on another processor)."""
    machine = platform.machine().lower()
    features = set(_cpu_flags().partition(":")[2].split())
    if machine in ("x86_64", "amd64"):
        wanted = ["avx512_bf16", "amx_bf16"]
    elif machine in ("aarch64", "arm64"):
        wanted = ["bf16"]
    else:
        return []
    return [] if features & set(wanted) or not features else wanted


def warn_if_bfloat16_is_emulated(dtype: torch.dtype) -> None:
    """On the first forward in bfloat16 on the CPU (the model cast, or CPU autocast to bfloat16): one warning where
    the processor has no bfloat16 arithmetic, naming what it lacks, the cost and the remedy. Silenced by
    DISENTANGLED_BFLOAT16_WARNING=0."""
    if _bfloat16_checked:
        return
    try:
        autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    except (AttributeError, TypeError):  # torch before 2.4
        autocast = False
    if dtype != torch.bfloat16 and not autocast:
        return
    _bfloat16_checked.append(True)
    missing = missing_bfloat16_arithmetic()
    if not missing or os.environ.get(BFLOAT16_WARNING, "1") == "0":
        return
    warnings.warn(
        f"bfloat16 on this CPU is emulated: it has no {' or '.join(missing)}, so PyTorch converts to float32 around "
        f"each product, and a forward runs about {BFLOAT16_SLOWDOWN} slower than in float32 (measured on an AVX2 "
        "EPYC; transformers' DeBERTa and BERT alike). Load the model in float32 (the default), or serve it in int8 "
        f"(the manual's Serving page). Set {BFLOAT16_WARNING}=0 to silence this.",
        stacklevel=3,
    )


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


# Every build: an implicit declaration is an error, so that a missing header fails the build, not the call.
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Werror=implicit-function-declaration")
# Each set's own: AVX-512 takes the processor's own extensions (-march=native: AMX and AVX512-BF16 add the bfloat16
# attention where it has them), AVX2 the x86-64-v3 vector units and no AVX-512 even on a processor with it; NEON is
# part of every aarch64 processor.
SET_FLAGS = {"avx512": ("-march=native",), "avx2": ("-mavx2", "-mfma", "-mtune=native"), "neon": ()}


# Each set's flags in a library built for other machines of its kind (`build_prebuilt`, and ONNX Runtime's operator
# library): the set's own vector units, nothing of the build machine's, so no AMX. AVX-512 takes VL with F and BW (its
# 256-bit loads), as every processor with BW has it.
PORTABLE_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"),
    "avx2": ("-mavx2", "-mfma"),
    "neon": (),
}
MACHINE_SETS = {"x86_64": ("avx512", "avx2"), "aarch64": ("neon",)}  # the vector sets of each machine kind
KERNELS = "DISENTANGLED_KERNELS"  # a folder of prebuilt libraries (`disentangled build-kernels DIR`)
PREBUILT = Path(__file__).with_name("prebuilt")  # the package's own prebuilt libraries, where a wheel carries them


def flags_for(name: str) -> tuple[str, ...]:
    """The compiler flags of the build for vector set `name` ("avx512", "avx2" or "neon")."""
    return BASE_FLAGS[:1] + SET_FLAGS[name] + BASE_FLAGS[1:]


def compile_command(compiler: str, flags: tuple[str, ...], source: Path, output: Path) -> list[str]:
    """The command that compiles `source` (position_bias.c, or a file that includes it) with `flags` into `output`."""
    return [compiler, *flags, f"-I{SOURCE.parent}", str(source), "-o", str(output)]


def machine_kind(machine: str | None = None) -> str:
    """The machine kind of `machine` (default: this one) as the libraries are named: x86_64, aarch64 or as given."""
    machine = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def kernels_version() -> str:
    """The version of the kernels: the first 12 hex digits of the SHA-256 of the C source and its headers. A prebuilt
    library's name carries the version it was built from."""
    digest = hashlib.sha256(b"\0".join(path.read_bytes() for path in (SOURCE, *HEADERS)))
    return digest.hexdigest()[:12]


def prebuilt_name(machine: str, name: str, version: str) -> str:
    """The file name of a prebuilt library: position_bias-<machine kind>-<vector set>-<kernels version>.so."""
    return f"{SOURCE.stem}-{machine}-{name}-{version}.so"


def build_prebuilt(folder: Path, machine: str, name: str, compiler: str) -> Path:
    """position_bias.c compiled for vector set `name` of machine kind `machine` with `compiler` and the set's portable
    flags (`PORTABLE_FLAGS`, with OpenMP) into `folder` as `prebuilt_name` says, under a temporary name first. Raises
    subprocess.CalledProcessError where the compiler fails."""
    flags = BASE_FLAGS[:1] + PORTABLE_FLAGS[name] + BASE_FLAGS[1:]
    library = Path(folder) / prebuilt_name(machine, name, kernels_version())
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        partial = Path(scratch) / library.name
        subprocess.run(compile_command(compiler, flags, SOURCE, partial), check=True, capture_output=True)
        os.replace(partial, library)
    return library


def _prebuilt(folder: Path, name: str, where: str) -> tuple[Path | None, str]:
    """The library of vector set `name` for this machine kind in `folder` (`where` names the folder in messages):
    (its path, "") or (None, why there is none). A ValueError where the folder holds that set's library of another
    version of the kernels: such a library would compute with another contract."""
    machine, version = machine_kind(), kernels_version()
    library = folder / prebuilt_name(machine, name, version)
    if library.is_file():
        return library, ""
    others = sorted(folder.glob(prebuilt_name(machine, name, "*")))
    if others:
        found = ", ".join(path.stem.rsplit("-", 1)[1] for path in others)
        raise ValueError(
            f"{where} holds the {machine} {name} kernels of version {found}, but this package's kernels are version "
            f"{version}: build that folder again with this package (disentangled build-kernels {folder}), or unset "
            f"{KERNELS} on a machine with a C compiler"
        )
    held = ", ".join(sorted(path.name for path in folder.glob(f"{SOURCE.stem}-*.so"))) or "no kernel library"
    return None, f"{where} has no library of the {name} kernels for {machine} (it holds {held})"


def compiled(source: Path, flags: tuple[str, ...], name: str, stem: str | None = None) -> tuple[Path | None, str]:
    """`source` (which may include position_bias.c and its headers, found beside it) compiled with `flags` for vector
    set `name` into the cache (DISENTANGLED_CACHE, else ~/.cache/disentangled), or found there: (the library, "") or
    (None, why not). The cache key covers the sources, the compiler, the flags, the set and the processor's flags."""
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    sources = [source.read_bytes(), SOURCE.read_bytes(), *(header.read_bytes() for header in HEADERS)]
    parts = [*sources, compiler.encode(), " ".join(flags).encode(), name.encode(), _cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts))
    cache = Path(os.environ.get("DISENTANGLED_CACHE", Path.home() / ".cache" / "disentangled"))
    library = cache / f"{stem or source.stem}-{name}-{key.hexdigest()[:16]}.so"
    if not library.is_file():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as folder:
                partial = Path(folder) / library.name
                subprocess.run(compile_command(compiler, flags, source, partial), check=True, capture_output=True)
                os.replace(partial, library)
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", b"") or b""
            return None, f"compiling {source.name} failed: {error} {detail.decode(errors='replace')[-300:]}".strip()
    return library, ""


def _build(flags: tuple[str, ...] | None = None, name: str | None = None) -> ctypes.CDLL | None:
    """Load the kernel for vector set `name` (default: `instruction_set()`'s): DISENTANGLED_KERNELS's prebuilt library
    where it is set, the package's prebuilt one where no compiler is found, else compiled with `flags` (default:
    `flags_for(name)`) or found in the cache; `flags` given, always compiled. None, with the reason in
    `_state['why']`, if it cannot; a ValueError where DISENTANGLED_KERNELS's folder lacks the set's library, or a
    prebuilt folder holds another version's (`_prebuilt`)."""
    chosen, reason = instruction_set()
    name = name or chosen
    if name == "none":
        _state["why"] = reason
        return None
    if not SOURCE.is_file() or not all(header.is_file() for header in HEADERS):
        _state["why"] = "no kernel source beside native.py (an install without the package's data files)"
        return None
    folder = os.environ.get(KERNELS)
    if folder and flags is None:
        library, why = _prebuilt(Path(folder), name, f"{KERNELS}={folder}")
        if library is None:
            raise ValueError(f"{why}: build it there with `disentangled build-kernels {folder}`, or unset {KERNELS}")
        origin = KERNELS
    elif _compiler() is None and flags is None and PREBUILT.is_dir():
        library, why = _prebuilt(PREBUILT, name, "the package's prebuilt folder")
        why = f"no C compiler (cc, gcc or clang) on PATH, and {why}"
        origin = "the wheel"
    else:
        flags = flags or flags_for(name)
        library, why = compiled(SOURCE, flags, name)
        origin = "built here"
        if library is None and _compiler() is None:
            why += f", and {KERNELS} names no folder of prebuilt libraries (disentangled build-kernels DIR)"
    if library is None:
        _state["why"] = why
        return None
    _state["loaded"] = (library, origin)
    try:
        loaded = ctypes.CDLL(str(library))
    except OSError as error:
        _state["why"] = f"loading {library} failed: {error}"
        return None
    loaded.position_bias.argtypes = [ctypes.POINTER(_BiasArgs), ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    loaded.position_bias.restype = ctypes.c_int
    loaded.attend.argtypes = [ctypes.POINTER(_AttendArgs), ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    loaded.attend.restype = ctypes.c_int
    for kernel in ("hankel_bias", "hankel_bias_backward"):
        getattr(loaded, kernel).argtypes = [ctypes.POINTER(_HankelArgs), ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        getattr(loaded, kernel).restype = ctypes.c_int
    loaded.keep_mask.argtypes = [ctypes.POINTER(_KeepArgs), ctypes.c_int]
    loaded.keep_mask.restype = ctypes.c_int
    loaded.workspace_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    loaded.workspace_bytes.restype = ctypes.c_int64
    loaded.instruction_set.restype = ctypes.c_char_p
    loaded.column_fault.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64),
    ]
    loaded.mirror_fault.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    loaded.column_rule.restype = ctypes.c_char_p
    built = loaded.instruction_set().decode()
    if built != name:
        _state.pop("loaded")
        _state["why"] = f"{library} was built for {built}, not {name} ({origin})"
        return None
    return loaded


def _library() -> ctypes.CDLL | None:
    if "library" not in _state:
        with _lock:
            if "library" not in _state:
                _state["library"] = _build()
    return _state["library"]


@contextlib.contextmanager
def turned_off():
    """Within the block the kernels are off, as on a processor without them (every caller takes the pure-PyTorch
    path): `benchmarks.run --pytorch-path` times that path beside the kernels' in one process. Not thread-safe."""
    saved = dict(_state)
    _state.clear()
    _state.update(library=None, attend=False, why="turned off for this call (native.turned_off)")
    try:
        yield
    finally:
        _state.clear()
        _state.update(saved)


def available() -> bool:
    """Whether the kernel can run here (compiles or loads it on the first call): built for `instruction_set()`'s set.
    Raises the ValueError of a prebuilt folder that cannot serve (`_build`)."""
    return _library() is not None


def why_unavailable() -> str | None:
    """The reason `available()` is False, or None."""
    return None if available() else _state.get("why")


def loaded_library() -> tuple[Path, str] | None:
    """The kernels' library that runs here and where it comes from ("built here" into the cache, KERNELS, or "the
    wheel": the package's prebuilt folder), or None where none runs."""
    return _state.get("loaded") if available() else None


def position_bias(
    out: Tensor,
    c2p: Tensor | None,
    p2c: Tensor | None,
    column: Tensor,
    c2p_column: Tensor,
    keep: Tensor | None,
    first_row: int,
    first_key: int,
) -> Tensor:
    """out [g, H, rows, keys] (contiguous, float32 or bfloat16) = c2p + p2c of query rows first_row + a and keys
    first_key + b, with the dtype's minimum where `keep` is 0 (`position_bias.c` says how).

    c2p: [g, H, rows, W'] (the block's rows, against the relative rows in reverse order), p2c: [g, H, keys, W'] (the
    block's keys), each with a contiguous last dimension and 15 spare elements after its storage (the kernel loads
    16 columns at a time); `column`: int32 [2L - 1], p2c's column of distance d at d + L - 1; `c2p_column`: int32
    [2L - 1], c2p's column of distance i - j at L - 1 - i + j; keep: uint8 [g | 1, keys] or None. The (sequence,
    head) planes are shared between torch's intra-op threads (its own OpenMP runtime)."""
    library = _library()
    groups, heads, rows, keys = out.shape
    for table in (c2p, p2c):
        if table is not None and (table.dtype != out.dtype or table.stride(-1) != 1):
            raise ValueError("position_bias: tables must have the output's dtype and a contiguous last dimension")
    if not out.is_contiguous() or out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("position_bias: the output must be contiguous float32 or bfloat16")
    _check_columns("position_bias", column, c2p_column)
    for table, lines, label in ((c2p, rows, "c2p's rows"), (p2c, keys, "p2c's keys")):
        if table is not None and (table.dim() != 4 or table.shape[:2] != (groups, heads) or table.shape[2] < lines):
            raise ValueError(f"position_bias: {label} must cover the output's ([g, H, {lines}, W] at least)")
        if table is not None and not _has_spare(table, 15):
            raise ValueError(
                "position_bias: the tables need 15 spare elements after them (the kernel loads 16 columns)"
            )
    _check_keep("position_bias", keep, groups, keys)
    width = min([table.shape[-1] for table in (c2p, p2c) if table is not None], default=0)
    args = _bias_args(out, c2p, p2c, column, c2p_column, keep, first_row, first_key, heads, rows, keys, width)
    failed = library.position_bias(ctypes.byref(args), out.element_size(), groups * heads, torch.get_num_threads())
    if failed == COLUMNS_REFUSED:
        raise ValueError(_refusal("position_bias", args, column, c2p_column, width, tiled=True))
    if failed:
        raise ValueError("position_bias: neither table given")
    return out


def _table_fields(name: str, table: Tensor | None, strides: tuple[str, str, str]) -> dict:
    """A table's address as the field `name` and its first three element strides as `name`_`stride` (None and 0s
    without it)."""
    fields = {name: table.data_ptr() if table is not None else None}
    for dim, stride in enumerate(strides):
        fields[f"{name}_{stride}"] = table.stride(dim) if table is not None else 0
    return fields


def _bias_args(out, c2p, p2c, column, c2p_column, keep, first_row, first_key, heads, rows, keys, width) -> _BiasArgs:
    return _BiasArgs(
        **_table_fields("c2p", c2p, ("plane", "head", "row")),
        **_table_fields("p2c", p2c, ("plane", "head", "row")),
        column=column.data_ptr(),
        c2p_column=c2p_column.data_ptr(),
        keep=keep.data_ptr() if keep is not None else None,
        keep_plane=keep.stride(0) if keep is not None and keep.shape[0] > 1 else 0,
        out=out.data_ptr() if out is not None else None,
        heads=heads,
        first_row=first_row,
        rows=rows,
        first_key=first_key,
        keys=keys,
        length=(column.shape[0] + 1) // 2,
        width=width,
    )


# The kernels' contract (`position_bias.h`, above column_fault): the C refuses what breaks its rules 1 and 2 with
# this code, and `_refusal` names the rule; the wrappers here check what only they can see (dtypes, shapes, memory).
COLUMNS_REFUSED = 4


def _has_spare(table: Tensor, spare: int) -> bool:
    """Whether `table`'s storage holds `spare` elements past its last element."""
    last = table.storage_offset() + sum((size - 1) * stride for size, stride in zip(table.shape, table.stride()))
    return table.untyped_storage().nbytes() >= (last + 1 + spare) * table.element_size()


def _check_columns(name: str, *columns: Tensor) -> None:
    for column in columns:
        if column.dtype != torch.int32 or not column.is_contiguous() or column.device.type != "cpu":
            raise ValueError(f"{name}: the column vectors are contiguous int32 CPU tensors, got {column.dtype}")


def _check_keep(name: str, keep: Tensor | None, groups: int, keys: int) -> None:
    if keep is not None and (
        keep.dtype != torch.uint8
        or keep.dim() != 2
        or keep.shape[0] not in (1, groups)
        or keep.shape[1] < keys
        or keep.stride(1) != 1
    ):
        raise ValueError(f"{name}: keep must be uint8 [g | 1, {keys}] with a contiguous last dimension, or None")


def _refusal(name: str, args, column: Tensor, c2p_column: Tensor | None, width: int, tiled: bool) -> str:
    """The kernel's refusal in words: the rule the columns break and where, or the extents at fault."""
    library, at = _library(), ctypes.c_int64(-1)
    count = column.numel() if c2p_column is not None else args.rows + args.keys - 1
    for label, vector in (("column", column), ("c2p_column", c2p_column)):
        if vector is None:
            continue
        fault = library.column_fault(vector.data_ptr(), count, width, int(tiled), ctypes.byref(at))
        if fault == 0 and label == "c2p_column":
            fault = library.mirror_fault(column.data_ptr(), vector.data_ptr(), count, ctypes.byref(at))
        if fault:
            rule = library.column_rule(fault).decode()
            return f"{name}: {label}[{at.value}] = {int(vector[at.value])} {rule} (W = {width})"
    return (
        f"{name}: the extents break the kernel's contract: heads, W and the length must be at least 1 (W a multiple "
        "of 16 for attend) and the rows and keys must lie inside the length"
    )


@dataclass(frozen=True)
class Band:
    """Banded training tables (`hankel_bias`): lines in tiles of `lines` (a multiple of 16); column 0 of tile k's
    lines stands for table column `c2p_first[k]` of c2p (`p2c_first[k]` of p2c), int32. A banded table is
    [tiles, H, g, lines, width]: tile k holds lines k * lines .. of every sequence and head."""

    lines: int
    c2p_first: Tensor | None
    p2c_first: Tensor | None


def hankel_bias(
    out: Tensor, c2p: Tensor | None, p2c: Tensor | None, column: Tensor, tiled: bool, band: Band | None = None
) -> Tensor:
    """CPU training's block bias with the keys in reverse order (`position_bias.c`, hankel_bias):
    out [g, H, n, L] (contiguous, float32 or bfloat16) = c2p[..., a, column[a + b]] + p2c[..., b, column[a + b]].

    c2p: [g, H, n, W], the block's rows against Kr; p2c: [g, H, L, W], the reversed keys against Qr; each in the
    output's dtype with a contiguous last dimension; either may be None. column: int32, the table column of row a
    and key b at a + b (from the block's first row on; at least n + L - 1 of them). `tiled`: `column` steps by at most
    one column per entry (`tiles_hold`; `kernel_columns` is not None), so that whole
    16 x 16 tiles run with vectors; else element by element. With `band`, both tables are banded (`Band`): each
    line holds only the columns that its tile reads, which the kernel checks (`column` ascends)."""
    return _hankel("hankel_bias", out, c2p, p2c, column, tiled, False, band)


def hankel_bias_backward(
    grad_scores: Tensor,
    grad_c2p: Tensor | None,
    grad_p2c: Tensor | None,
    column: Tensor,
    tiled: bool,
    add_p2c: bool,
    band: Band | None = None,
) -> None:
    """The gradient of `hankel_bias`: dS [g, H, n, L] (contiguous) summed into grad_c2p [g, H, n, W] (written) and
    grad_p2c [g, H, L, W] (added to where `add_p2c`, else written), along the same columns; banded as `band` says."""
    _hankel("hankel_bias_backward", grad_scores, grad_c2p, grad_p2c, column, tiled, add_p2c, band)


def _hankel(name, scores: Tensor, c2p, p2c, column: Tensor, tiled: bool, add_p2c: bool, band: Band | None):
    groups, heads, rows, keys = scores.shape
    tables = [table for table in (c2p, p2c) if table is not None]
    if not scores.is_contiguous() or scores.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: the scores must be contiguous float32 or bfloat16")
    if any(table.dtype != scores.dtype or table.stride(-1) != 1 for table in tables):
        raise ValueError(f"{name}: the tables must have the scores' dtype and a contiguous last dimension")
    if column.dtype != torch.int32 or not column.is_contiguous() or column.numel() < rows + keys - 1:
        raise ValueError(f"{name}: column must be int32, contiguous, with at least rows + keys - 1 entries")
    fields = {}
    if band is None:
        fields.update(_table_fields("t", c2p, STRIDES), **_table_fields("u", p2c, STRIDES))
    else:
        if band.lines <= 0 or band.lines % 16 or len({table.shape[-1] for table in tables}) > 1:
            raise ValueError(f"{name}: a band's lines are a multiple of 16, and both tables are as wide")
        for letter, table, first, lines in (("t", c2p, band.c2p_first, rows), ("u", p2c, band.p2c_first, keys)):
            if table is None:
                fields.update({letter: None, f"{letter}_sequence": 0, f"{letter}_head": 0, f"{letter}_row": 0})
                continue
            tiles = -(-lines // band.lines)
            if table.dim() != 5 or table.shape[0] < tiles or table.shape[1:4] != (heads, groups, band.lines):
                raise ValueError(
                    f"{name}: a banded table is [tiles, H, g, {band.lines}, W] with {tiles} tiles at least"
                )
            if first is None or first.dtype != torch.int32 or not first.is_contiguous() or first.numel() < tiles:
                raise ValueError(f"{name}: a banded table needs int32 first columns, one per tile ({tiles})")
            strides = {"tile": 0, "head": 1, "sequence": 2, "row": 3}  # of [tiles, H, g, lines, W]
            fields.update({f"{letter}_{name}": table.stride(dim) for name, dim in strides.items()})
            fields.update({letter: table.data_ptr(), f"{letter}_first": first.data_ptr()})
        fields["band_lines"] = band.lines
    args = _HankelArgs(
        scores=scores.data_ptr(),
        **fields,
        column=column.data_ptr(),
        heads=heads,
        rows=rows,
        keys=keys,
        width=tables[0].shape[-1] if tables else 0,
        tiled=int(tiled),
        add_u=int(add_p2c),
    )
    failed = getattr(_library(), name)(
        ctypes.byref(args), scores.element_size(), groups * heads, torch.get_num_threads()
    )
    if failed == 2:
        raise MemoryError(f"{name}: no memory for a band of 16 table rows")
    if failed == COLUMNS_REFUSED:
        raise ValueError(_refusal(name, args, column, None, 2**31 - 1 if band else args.width, tiled))
    if failed == 3:
        raise ValueError(f"{name}: a banded table's tile reads columns outside its band (see native.Band)")
    if failed:
        raise ValueError(f"{name}: neither table given")
    return scores


def keep_mask(out: Tensor, seed: int, threshold: int) -> Tensor:
    """Dropout's decisions into `out` (contiguous uint8 on the CPU, 1 = keep): entry n is 1 where the 15 bits
    16 (n % 4) .. 16 (n % 4) + 14 of draw n / 4 are below `threshold` (in [0, 2^15]), draw k being SplitMix64's
    output function of seed + (k + 1) * 0x9e3779b97f4a7c15 (0 <= seed < 2^64; `position_bias.c`, keep_mask). The
    same mask on any number of threads."""
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("keep_mask: out must be a contiguous uint8 CPU tensor")
    if not 0 <= threshold <= 1 << 15 or not 0 <= seed < 1 << 64:
        raise ValueError(f"keep_mask: the threshold ({threshold}) must lie in [0, 2^15] and the seed in [0, 2^64)")
    args = _KeepArgs(out=out.data_ptr(), count=out.numel(), seed=seed, threshold=threshold)
    if _library().keep_mask(ctypes.byref(args), torch.get_num_threads()):
        raise ValueError(f"keep_mask: the kernel refused the threshold {threshold}")
    return out


def attend_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `attend` can run here in `dtype`: bfloat16 needs the kernel built with AMX and AVX512-BF16 (a
    processor that has them) and this process allowed the AMX tiles; float32 needs the kernel (any vector set)."""
    if dtype == torch.float32:
        return available()
    if dtype != torch.bfloat16:
        return False
    if "attend" not in _state:
        library = _library()
        _state["attend"] = bool(library is not None and library.attend_available())
    return _state["attend"]


def as_key_tiles(rows: Tensor) -> Tensor:
    """[H, W, 64] relative rows (W a multiple of 16) in the layout `attend` reads them in. bfloat16: AMX's key tiles,
    for each 16 rows and each half of the dimensions the transpose of the rows read as 32-bit pairs, [H, W / 16, 2,
    16, 16] int32. float32: for each 16 rows their transpose, [H, W / 16, 64, 16]."""
    heads, width, dim = rows.shape
    if rows.dtype == torch.float32:
        return rows.contiguous().view(heads, width // 16, 16, dim).transpose(-1, -2).contiguous()
    pairs = rows.contiguous().view(torch.int32).view(heads, width // 16, 16, 2, dim // 4)
    return pairs.permute(0, 1, 3, 4, 2).contiguous()


def attend(
    out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    pos_key: Tensor | None,
    pos_query: Tensor | None,
    column: Tensor,
    c2p_column: Tensor,
    keep: Tensor | None,
    keys: slice,
    scale: float,
    workspace: Tensor,
) -> Tensor:
    """Attention with the position terms made inside the tile (`position_bias.h`, attend), in bfloat16 on AMX or in
    float32 with the vector set built:
    out [g, L, H, 64] = softmax(scale q kᵀ + c2p + p2c) v over the keys of `keys` that `keep` marks 1, for query,
    key and value [g, H, L, 64] (any strides with a contiguous last dimension), where c2p[i, j] = q_i . Kr[c(i - j)]
    and p2c[i, j] = k_j . Qr[c(i - j)] with the columns `column` and `c2p_column` of `position_bias`; `pos_key` is
    Kr with its rows reversed and `pos_query` Qr, [H, W, 64] with W a multiple of 16, each in `as_key_tiles` layout
    (or None without that term), all tensors of one dtype; keep uint8 [g | 1, keys] or None; `workspace` uint8 of at least
    `workspace_bytes(keys, W)`. A row with no key to attend to comes out 0."""
    library = _library()
    groups, heads, length, dim = query.shape
    tables = [t for t in (pos_key, pos_query) if t is not None]
    dtype = query.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"attend: bfloat16 or float32 tensors, not {dtype}")
    if dim != 64 or any(t.dtype != dtype or t.stride(-1) != 1 for t in (out, query, key, value)):
        raise ValueError("attend: tensors of one dtype, 64 dimensions per head, each with a contiguous last dimension")
    packed = torch.int32 if dtype == torch.bfloat16 else torch.float32
    if not tables or any(t.dtype != packed or not t.is_contiguous() or t.shape[0] != heads for t in tables):
        raise ValueError("attend: give Kr or Qr (or both) in as_key_tiles layout of the tensors' dtype, one per head")
    width, count = tables[0].shape[1] * 16, keys.stop - keys.start
    if any(t.shape != tables[0].shape for t in tables) or width < 16:
        raise ValueError("attend: Kr and Qr must have one shape, with 16 columns at least")
    if key.shape != query.shape or value.shape != query.shape or out.shape != (groups, length, heads, dim):
        raise ValueError("attend: key and value must have the query's shape [g, H, L, 64], and out [g, L, H, 64]")
    if not 0 <= keys.start <= keys.stop <= length:
        raise ValueError(f"attend: the keys {keys} must lie inside the {length} tokens")
    _check_columns("attend", column, c2p_column)
    _check_keep("attend", keep, groups, count)
    if workspace.numel() < workspace_bytes(count, width):
        raise ValueError("attend: the workspace is too small (see workspace_bytes)")
    args = _AttendArgs(
        query=query.data_ptr(),
        key=key.data_ptr(),
        value=value.data_ptr(),
        out=out.data_ptr(),
        pos_key=pos_key.data_ptr() if pos_key is not None else None,
        pos_query=pos_query.data_ptr() if pos_query is not None else None,
        width=width,
        column=column.data_ptr(),
        c2p_column=c2p_column.data_ptr(),
        keep=keep.data_ptr() if keep is not None else None,
        keep_sequence=keep.stride(0) if keep is not None and keep.shape[0] > 1 else 0,
        heads=heads,
        length=length,
        first_key=keys.start,
        keys=count,
        scale=scale,
        workspace=workspace.data_ptr(),
    )
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        for index, stride in enumerate(STRIDES):
            setattr(args, f"{name}_{stride}", tensor.stride(index))
    args.out_sequence, args.out_row, args.out_head = out.stride(0), out.stride(1), out.stride(2)
    threads, planes = torch.get_num_threads(), groups * heads
    chunks = -(-threads // planes) if planes < threads else 1  # each plane's rows in parts where planes are few
    failed = library.attend(ctypes.byref(args), query.element_size(), planes, chunks, threads)
    if failed == COLUMNS_REFUSED:
        raise ValueError(_refusal("attend", args, column, c2p_column, width, tiled=True))
    if failed:
        raise ValueError("attend: not built for this dtype here (bfloat16 needs AMX)")
    return out


def workspace_bytes(keys: int, width: int) -> int:
    """Bytes of `attend`'s workspace for this many keys and table columns (one part per torch thread)."""
    return torch.get_num_threads() * _library().workspace_bytes(keys, width)


def kernel_columns(positions) -> tuple[Tensor, Tensor] | None:
    """The int32 column vectors of the bias kernels (`position_bias`, `attend`; `RelativePositions` `positions`), made
    once per forward: the column of each distance d at d + L - 1, and c2p's column (the table against Kr in reverse
    row order) of i - j at L - 1 - i + j. None where the kernel's tiles cannot take them (`tiles_hold`)."""
    return per_forward(positions, "kernel columns", _kernel_columns)


def _kernel_columns(positions) -> tuple[Tensor, Tensor] | None:
    if not tiles_hold(positions.column):
        return None
    return int32_column(positions), (positions.width - 1) - int32_column(positions).flip(0)


def tiles_hold(column: Tensor) -> bool:
    """Whether the kernel's tiles can read these columns (rule 1 of the contract in `position_bias.h`): one distance more
    reads the same column or the next, so that 16 consecutive distances read 16 consecutive columns or fewer. True of
    clipped distances and of every released bucket setting (the log buckets compress distances there); not where the
    buckets outnumber the distances they cover (8 buckets reaching 7 positions step by two columns)."""
    return column.numel() < 2 or bool((column[1:] - column[:-1]).max() <= 1)
