"""The facts `disentangled env` reports (`report.py` prints them), gathered: the versions (Python, torch and its CUDA,
transformers, triton, onnxruntime, this package and the git commit it runs from when that is a checkout), the
processor (name, the vector extensions that decide which kernels run, AMX, threads), the CPU kernels' library (which
one runs and where it comes from, or why none does), each GPU (name, compute capability, memory, the Triton kernel's
tiles for each precision and head size and whether they come from a tuned profile), the switches, the self-check's
verdicts kept on this machine, and the attention path each kind of call takes (device, dtype, inference or
training), with its reason: the answer of `dispatch.decide`, the function that picks the path of every real call,
for a DeBERTa-v3-base call of 512 tokens. `facts()` gathers it all; `record_fields()` is what
`benchmarks/records.py` writes into every record.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

# /proc/cpuinfo flags, in the order printed: the vector units that decide which kernels run (float, int8, AMX)
EXTENSIONS = [
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sve2",
    "i8mm",
    "bf16",
]
VERSIONS = ["torch", "transformers", "triton", "onnxruntime", "disentangled"]  # distributions, by their metadata
# A DeBERTa-v3-base call as the report describes it: 12 heads of 64, 512 tokens with a key mask, c2p + p2c, 256 log
# buckets reaching 512 tokens (the reach `paths` builds), dropout 0.1 in training.
REPORTED_CALL = dict(head_size=64, length=512, heads=12, mask="keys", terms=("c2p", "p2c"))


def processor() -> tuple[str, list[str]]:
    """The processor's model name and which of `EXTENSIONS` it has (Linux: /proc/cpuinfo; elsewhere platform's)."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), [flag for flag in EXTENSIONS if flag in flags]


def commit(top: Path | None = None) -> str:
    """The commit of the checkout at `top` (by default the one this package runs from), `+dirty` when tracked files
    other than the benchmark records differ from it; "unknown" where it is not a git checkout (an installed wheel)."""
    top = top or Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=top, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/records"],
            cwd=top,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def versions(checkout: Path | None = None) -> dict:
    """Python and each of `VERSIONS` (None where absent), torch's CUDA / ROCm, and the commit of `checkout` (by
    default the one this package runs from)."""
    found = {"python": platform.python_version()}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["torch"] = torch.__version__  # the running one (a local build's metadata may differ)
    found["cuda"] = torch.version.cuda
    found["rocm"] = torch.version.hip
    found["commit"] = commit(checkout)
    return found


def cpu() -> dict:
    name, extensions = processor()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    return {
        "name": name,
        "machine": platform.machine(),
        "extensions": extensions,
        "amx": [flag for flag in extensions if flag.startswith("amx")],
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(),
        "usable_cpus": usable,
        "torch_threads": torch.get_num_threads(),
    }


def native() -> dict:
    """The compiled CPU kernel (`modeling/native.py`), as the dispatcher sees it (`dispatch.native_*`), and its
    library: the file and where it comes from ("built here", DISENTANGLED_KERNELS or "the wheel")."""
    from ..modeling import dispatch
    from ..modeling.native import loaded_library

    built = dispatch.native_built()
    chosen, reason = dispatch.native_instruction_set()
    library, origin = loaded_library() or (None, None)
    return {
        "instruction_set": chosen,
        "instruction_set_reason": reason,
        "forced": "DISENTANGLED_CPU_ISA" in reason,
        "built": built,
        "library": str(library) if library else None,
        "library_from": origin,
        "why_not": None if built else dispatch.native_why_unavailable(),
        "fused_float32": built and dispatch.native_attend(torch.float32),
        "fused_bfloat16": built and dispatch.native_attend(torch.bfloat16),
        "disabled_by_environment": os.environ.get("DISENTANGLED_NATIVE") == "0",
    }


def gpus() -> list[dict]:
    """Each CUDA GPU: name, compute capability, memory, and the Triton kernel's tiles for each precision and head size
    (None: that precision falls back to sdpa there), with where they come from."""
    from ..modeling import triton_attention, triton_tiles

    found = []
    if not torch.cuda.is_available():
        return found
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        capability = (properties.major, properties.minor)
        tiles = {}
        for dtype in (torch.bfloat16, torch.float32):
            for head_size in triton_attention.HEAD_SIZES:
                chosen = triton_tiles.tiles_for(capability, dtype, head_size, properties.name)
                table = triton_tiles.tiles_for(capability, dtype, head_size, None)
                tiles[f"{triton_tiles.precision(dtype)}/{head_size}"] = {
                    "tiles": {kernel: list(tile) for kernel, tile in chosen.items()} if chosen else None,
                    "from": "tuned profile" if chosen != table else "table",
                }
        found.append(
            {
                "index": index,
                "name": properties.name,
                "capability": list(capability),
                "memory_gib": round(properties.total_memory / 2**30, 1),
                "tiles": tiles,
            }
        )
    return found


def devices(found_gpus: list[dict]) -> list[dict]:
    """The devices whose paths are reported: the CPU, then each GPU (name and capability)."""
    return [{"device": "cpu"}] + [
        {"device": "cuda", "gpu": gpu["name"], "capability": tuple(gpu["capability"])} for gpu in found_gpus
    ]


def paths(on: list[dict], **facts) -> list[dict]:
    """The path `dispatch.decide` gives each kind of call (each device of `on`; float32, bfloat16 and, on a GPU,
    float16; inference and training; and on the CPU in float32, an ONNX export of each graph kind, whose mode is
    "onnx KIND") for `REPORTED_CALL` updated with `facts`, with its reason."""
    from ..modeling import dispatch
    from ..modeling.disentangled_attention import RelativePositions
    from ..modeling.native import kernel_columns

    positions = RelativePositions.build(REPORTED_CALL["length"], 256, 256, 512, "cpu")  # DeBERTa-v3's buckets
    reach = dict(width=positions.width, tiled_columns=kernel_columns(positions) is not None)
    rows = []
    for device in on:
        dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device["device"] != "cpu" else [])
        kinds = [(dtype, training, None) for dtype in dtypes for training in (False, True)]
        if device["device"] == "cpu":
            kinds += [(torch.float32, False, graph) for graph in dispatch.ONNX_GRAPHS]
        for dtype, training, graph in kinds:
            call = dispatch.Call(
                **{**REPORTED_CALL, **reach, **facts},
                **device,
                dtype=dtype,
                gradients=training,
                dropout=0.1 if training else 0.0,
                onnx=graph,
            )
            decision = dispatch.decide(call)
            rows.append(
                {
                    "device": device.get("gpu", device["device"]),
                    "dtype": str(dtype).removeprefix("torch."),
                    "mode": f"onnx {graph}" if graph else "training" if training else "inference",
                    "path": decision.path,
                    "reason": decision.reason,
                    "not": [f"{path}: {why}" for path, why in decision.skipped],
                }
            )
    return rows


def switches() -> dict:
    from ..modeling import dispatch

    return {
        "module": dispatch.switches(),
        "environment": {
            name: os.environ.get(name)
            for name in (
                *(variable for variable, _, _ in dispatch.SWITCHES.values()),
                "DISENTANGLED_NATIVE",
                "DISENTANGLED_CACHE",
            )
        },
        "debug_logger": dispatch.logger.name,
    }


def self_checks() -> list[dict]:
    """The verdicts kept on this machine (`kernel_check.saved_verdicts`), each summarised."""
    from ..modeling import kernel_check

    return [
        {
            "kind": verdict["kind"],
            "passed": verdict["passed"],
            "current": verdict["current"],
            "seconds": verdict.get("seconds"),
            "time": verdict.get("time"),
            "figures": verdict["figures"],
            "environment": verdict["environment"],
        }
        for verdict in kernel_check.saved_verdicts()
    ]


def facts(checkout: Path | None = None) -> dict:
    """Everything `disentangled env` reports, as one JSON-ready dict (the commit that of `checkout`, by default the
    one this package runs from)."""
    found_gpus = gpus()
    return {
        "versions": versions(checkout),
        "cpu": cpu(),
        "native": native(),
        "gpus": found_gpus,
        "switches": switches(),
        "self_checks": self_checks(),
        "paths": paths(devices(found_gpus)),
    }


def record_fields(checkout: Path | None = None) -> dict:
    """What every benchmark record says about where it ran (`benchmarks/records.py`): the processor, its extensions,
    torch's CPU capability and threads, the torch and transformers versions and the commit at the top level (as the
    manual's tables read them), and the rest of `facts(checkout)` under "environment"."""
    found = facts(checkout)
    return {
        "processor": found["cpu"]["name"],
        "extensions": found["cpu"]["extensions"],
        "cpu_capability": found["cpu"]["torch_capability"],
        "threads": found["cpu"]["torch_threads"],
        "torch": found["versions"]["torch"],
        "transformers": found["versions"]["transformers"],
        "commit": found["versions"]["commit"],
        "instruction_set": {
            "name": found["native"]["instruction_set"],
            "reason": found["native"]["instruction_set_reason"],
            "forced": found["native"]["forced"],
            "built": found["native"]["built"],
            **({} if found["native"]["built"] else {"why_not": found["native"]["why_not"]}),
        },
        "environment": found,
    }


def describe() -> str:
    """One line: processor, extensions, logical CPUs, torch's threads, torch's CPU capability, and the instruction
    set of our CPU kernels with the reason (`native.instruction_set`)."""
    from ..modeling import dispatch

    name, extensions = processor()
    capability = torch.backends.cpu.get_cpu_capability()
    kernels, reason = dispatch.native_instruction_set()
    built = "" if kernels == "none" or dispatch.native_built() else f", not built: {dispatch.native_why_unavailable()}"
    return (
        f"{name} ({' '.join(extensions) or 'no listed vector extensions'}; torch uses {capability}), "
        f"{os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads; "
        f"our CPU kernels: {kernels} ({reason}{built})"
    )
