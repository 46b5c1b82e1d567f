"""What a benchmark ran on: the processor's model name and the vector extensions that decide which kernels run.

Ratios between models depend on the processor (AVX-512 speeds up BERT's fused SDPA more than our bias building;
VNNI and AMX decide how fast int8 products are), so every benchmark prints `describe()` beside its table.
"""

from __future__ import annotations

import os
import platform

import torch

# flags in /proc/cpuinfo, in the order printed: float and int8 vector units
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


def describe() -> str:
    """One line: processor, extensions, logical CPUs, torch's threads, torch's CPU capability, and the instruction
    set of our CPU kernels with the reason (`native.instruction_set`)."""
    from disentangled.modeling import native

    name, extensions = processor()
    capability = torch.backends.cpu.get_cpu_capability()
    kernels, reason = native.instruction_set()
    built = "" if kernels == "none" or native.available() else f", not built: {native.why_unavailable()}"
    return (
        f"{name} ({' '.join(extensions) or 'no listed vector extensions'}; torch uses {capability}), "
        f"{os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads; "
        f"our CPU kernels: {kernels} ({reason}{built})"
    )
