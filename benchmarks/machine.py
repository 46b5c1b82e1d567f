"""What a benchmark ran on: the processor's model name and the vector extensions that decide which kernels run.

Ratios between models depend on the processor (AVX-512 speeds up BERT's fused SDPA more than our bias building;
VNNI and AMX decide how fast int8 products are), so every benchmark prints `describe()` beside its table. The facts
come from the package's `disentangled env` (`disentangled.environment`), which also fills every record.
"""

from __future__ import annotations

import re

from disentangled.environment import EXTENSIONS, describe, processor

__all__ = ["EXTENSIONS", "SET_NAMES", "describe", "label", "processor", "short_name", "vector_units"]


def short_name(name: str) -> str:
    """'Intel(R) Xeon(R) Processor' -> 'Intel Xeon': the model name without trademarks and filler words."""
    name = re.sub(r"\((R|TM)\)| Processor| CPU\b", "", name)
    return re.sub(r"\s+", " ", name).strip()


def vector_units(extensions: list[str]) -> str:
    """The widest vector units of a processor, as they decide which kernels run: 'AVX-512, AMX', 'AVX2', 'SVE'."""
    found = set(extensions)
    if "avx512f" in found:
        return "AVX-512, AMX" if "amx_bf16" in found else "AVX-512"
    if "avx2" in found:
        return "AVX2"
    if "asimd" in found:
        return "SVE" if "sve" in found else "NEON"
    return "no listed vector units"


SET_NAMES = {"avx512": "AVX-512", "avx2": "AVX2", "neon": "NEON", "none": "no kernels"}  # native.instruction_set's


def label(record: dict) -> str:
    """'AMD EPYC (AVX2)': a record's processor as the manual names it. Two machines that report the same model name
    (cloud processors often do) but have different vector units are different machines to a benchmark, and so is one
    whose CPU kernels DISENTANGLED_CPU_ISA forced to a lower set ('AMD EPYC (AVX-512; AVX2 kernels forced)')."""
    units = vector_units(record["extensions"])
    kernels = record.get("instruction_set") or {}
    if kernels.get("forced"):
        units += f"; {SET_NAMES[kernels['name']]} kernels forced"
    return f"{short_name(record['processor'])} ({units})"
