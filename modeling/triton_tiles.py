"""The tiles of the Triton kernel (`triton_attention.py`) on each GPU: one table keyed by compute capability, the
tuned profiles a GPU run writes (`triton_tiles.json`), and `tiles_for`, the lookup that the dispatcher, the compile
report (`benchmarks.kernel_resources`) and the tuner (`benchmarks.tune_kernel`) all read.

A tile is (BLOCK_M query rows, BLOCK_N keys, num_warps, num_stages) for each of the three kernels: "forward", and
the backward's "keys" (dk, dv) and "queries" (dq) kernels. Larger tiles reuse more of what they load, but hold more in
registers and shared memory; a tile that spills registers (stack) or asks for more shared memory than the GPU gives a
block is never in the table.

Beside the kernels in `modeling/`'s layering (`__init__.py`): layer 4's tile table, with no import of triton, so the
Hub bundle and `disentangled env` read it on any machine.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import torch

# Tiles: (BLOCK_M query rows, BLOCK_N keys, num_warps, num_stages) of each kernel ("forward", and the backward's
# "keys" and "queries" kernels), by compute capability, then by (precision, head size); precision is "half"
# (float16 and bfloat16) or "float32". An entry None: that precision falls back to sdpa's path on that GPU (no tile
# of a useful size fits its registers and shared memory). Each is the largest tile (BLOCK_M x BLOCK_N; of one size,
# the former shape and warps first, then more stages) that compiles without spilling (0 bytes of stack) and within
# the GPU's shared memory in every specialisation a real call gets (dropout or not, padded or not, a length a
# multiple of 16 or not) under Triton 3.8 and 3.9, both dtypes of "half": found by `python -m
# benchmarks.kernel_resources --search`, checked by the report, which reads this table. One table serves both
# Tritons (none of their largest fitting tiles had to differ). A tuning run on a GPU (`python -m
# benchmarks.tune_kernel`) writes faster ones to `triton_tiles.json`, which wins where it has the GPU and its Triton.
_AMPERE = {  # sm_80: 163 KB of shared memory
    ("half", 32): {"forward": (64, 64, 8, 2), "keys": (64, 32, 8, 2), "queries": (128, 32, 8, 2)},
    ("half", 64): {"forward": (64, 64, 8, 2), "keys": (64, 32, 8, 1), "queries": (64, 32, 8, 2)},
    ("half", 128): {"forward": (64, 64, 8, 2), "keys": (16, 64, 8, 2), "queries": (32, 128, 8, 2)},
    ("float32", 32): {"forward": (32, 32, 4, 2), "keys": (64, 16, 8, 1), "queries": (64, 32, 8, 2)},
    ("float32", 64): {"forward": (32, 32, 4, 2), "keys": (64, 16, 8, 1), "queries": (64, 32, 8, 2)},
    ("float32", 128): None,  # the keys kernel spills down to 16 x 16 (no released DeBERTa has head size 128)
}
_SM86 = {  # sm_86, sm_89: 99 KB of shared memory, and a ptxas that spills at some of sm_80's tiles
    ("half", 32): {"forward": (128, 32, 8, 2), "keys": (64, 32, 8, 1), "queries": (128, 32, 8, 2)},
    ("half", 64): {"forward": (64, 64, 8, 1), "keys": (32, 32, 8, 2), "queries": (64, 32, 8, 1)},
    ("half", 128): {"forward": (64, 32, 8, 1), "keys": (64, 32, 8, 1), "queries": (64, 32, 8, 1)},
    ("float32", 32): {"forward": (32, 32, 4, 2), "keys": (32, 32, 8, 1), "queries": (64, 32, 8, 2)},
    ("float32", 64): {"forward": (32, 32, 8, 2), "keys": (32, 16, 8, 1), "queries": (64, 16, 8, 2)},
    ("float32", 128): None,
}
TILES: dict[tuple[int, int], dict[tuple[str, int], dict[str, tuple[int, int, int, int]] | None]] = {
    (7, 5): {  # Turing (T4): float16 and float32; 64 KB of shared memory
        ("half", 32): {"forward": (128, 32, 8, 2), "keys": (64, 32, 8, 2), "queries": (64, 32, 8, 2)},
        ("half", 64): {"forward": (32, 32, 4, 2), "keys": (32, 32, 8, 1), "queries": (16, 32, 4, 1)},
        ("half", 128): {"forward": (16, 32, 4, 1), "keys": (32, 16, 8, 1), "queries": (16, 16, 8, 1)},
        ("float32", 32): {"forward": (64, 64, 8, 2), "keys": (64, 16, 8, 2), "queries": (64, 64, 8, 2)},
        ("float32", 64): {"forward": (32, 32, 4, 2), "keys": (32, 32, 8, 1), "queries": (64, 32, 8, 2)},
        ("float32", 128): None,
    },
    (8, 0): _AMPERE,  # A100, A800, A30
    (8, 6): _SM86,  # A10, A40, RTX 30
    (8, 9): _SM86,  # L4, L40S, RTX 40
    (9, 0): {  # H100, H200, H20: 227 KB of shared memory
        ("half", 32): {"forward": (128, 32, 8, 2), "keys": (32, 64, 8, 2), "queries": (128, 32, 8, 2)},
        ("half", 64): {"forward": (64, 64, 8, 2), "keys": (32, 64, 8, 2), "queries": (64, 32, 8, 2)},
        ("half", 128): {"forward": (128, 32, 8, 2), "keys": (16, 32, 4, 2), "queries": (32, 64, 8, 2)},
        ("float32", 32): {"forward": (64, 64, 8, 2), "keys": (32, 16, 8, 2), "queries": (64, 32, 8, 2)},
        ("float32", 64): {"forward": (32, 32, 4, 1), "keys": (16, 16, 8, 1), "queries": (32, 64, 8, 2)},
        ("float32", 128): None,
    },
}
# Shared memory one block may ask for (bytes, opt-in maximum), by compute capability: the report's limit.
SHARED_MEMORY = {(7, 0): 98_304, (7, 5): 65_536, (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376,
                 (9, 0): 232_448}  # fmt: skip
PROFILE_FILE = Path(__file__).with_name("triton_tiles.json")  # tuned tiles per GPU: benchmarks.tune_kernel


def precision(dtype: torch.dtype) -> str:
    return "float32" if dtype == torch.float32 else "half"


def _tables_capability(capability: tuple[int, int]) -> tuple[int, int]:
    """The TILES row for a GPU: its own, else the nearest listed one below it of the same major (8.7 takes 8.6's),
    else the smallest-memory one (7.0 takes 7.5's; Blackwell and later 8.9's, until a tuning run lists them)."""
    if capability in TILES:
        return capability
    below = [listed for listed in TILES if listed[0] == capability[0] and listed < capability]
    if below:
        return max(below)
    return (7, 5) if capability < (7, 5) else (8, 9)


def installed_triton() -> str | None:
    """The installed Triton's version ("3.9.0"), read from its package metadata without importing it; None where
    it is not installed."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str | None) -> str | None:
    """The release, "3.8" of "3.8.0": Triton's releases change the compiler, its patch releases do not."""
    return ".".join(version.split(".")[:2]) if version else None


def load_profiles(path: Path = PROFILE_FILE) -> list[dict]:
    """The tuned tile profiles (benchmarks.tune_kernel): [{"gpu", "capability", "triton", "tiles": {"half/64":
    {phase: tiles}}}]; none where the file is absent."""
    if not path.is_file():
        return []
    return json.loads(path.read_text())["profiles"]


_PROFILES: list[dict] | None = None


def tiles_for(
    capability: tuple[int, int],
    dtype: torch.dtype,
    head_size: int,
    gpu: str | None = None,
    triton_version: str | None = None,
) -> dict[str, tuple[int, int, int, int]] | None:
    """The tiles of each kernel on this GPU for `dtype` and `head_size` under `triton_version` (default: the
    installed Triton): a tuned profile for this GPU's name and capability made with the same Triton release where
    `triton_tiles.json` has one (its tiles were checked with that compiler), else TILES; None where this precision
    falls back on it."""
    global _PROFILES
    if _PROFILES is None:
        _PROFILES = load_profiles()
    release = _release(triton_version or installed_triton())
    key = f"{precision(dtype)}/{head_size}"
    for profile in _PROFILES:
        same_gpu = profile["gpu"] == gpu and tuple(profile["capability"]) == tuple(capability)
        same_triton = "triton" not in profile or _release(profile["triton"]) == release
        if same_gpu and same_triton and key in profile["tiles"]:
            return {phase: tuple(tiles) for phase, tiles in profile["tiles"][key].items()}
    return TILES[_tables_capability(capability)].get((precision(dtype), head_size))
