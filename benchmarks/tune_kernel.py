"""Tiles for the Triton kernel, timed on the GPU this runs on; the winners go to the package's tile profile.

    python -m benchmarks.tune_kernel --device cuda --budget-s 240 [--out modeling/triton_tiles.json]

For each precision (bfloat16 and float16 timed together: they share a "half" entry) and head size (64 and 128), and
each of the three kernels (the forward, and the backward's "keys" and "queries" kernels), every candidate tile
(`CANDIDATES`) is compiled for this GPU; one that spills (the loaded kernel's spill count) or does not load (shared
memory, threads) is dropped, and the others are timed with `triton.testing.do_bench` on the launches of a training
step of the benchmark's DeBERTa-v3-base shape (12 heads, log buckets; `kernel_resources.call_launches`, the other
kernels at the table's tiles) at 512, 2,048 and 8,192 tokens (batches of 32, 8 and 2: 16k tokens a call), with a key
mask and c2p + p2c. A tile's score is its time summed over the three lengths; the lowest wins, once it is also seen
to fit (no spill, shared memory within the GPU's) in every other specialisation a real call makes, compiled ahead of
time with this Triton (`kernel_resources.configurations`: dropout or not, padded or not, a length a multiple of 16 or
not; in parallel processes, no GPU time). The table's own tiles (`triton_tiles.tiles_for`) are always among the
candidates, so a profile is never slower than the table on the lengths timed. The winners are written as this GPU's
profile (its name, compute capability and Triton) into --out, replacing an older profile of the same GPU and Triton
release and keeping the others; `tiles_for` reads it from there under the same Triton release. No candidate starts
after --budget-s seconds: what was tuned by then is written, the rest keeps the table's tiles.

On a device machine: the wheels and install command of `benchmarks.device_check` (`--prepare-wheels`), then
`python -m benchmarks.tune_kernel --device cuda --out $OUT/triton_tiles.json`, and copy that file to
`modeling/triton_tiles.json` here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from disentangled.modeling import triton_attention, triton_tiles

from . import kernel_resources
from .kernel_resources import KERNELS, call_launches

CANDIDATES = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    "forward": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2),
                (32, 64, 4, 2), (32, 32, 4, 2)],
    "keys": [(64, 64, 8, 2), (64, 32, 8, 2), (32, 64, 8, 2), (64, 32, 4, 1), (32, 32, 8, 1), (32, 32, 4, 1),
             (16, 64, 4, 1), (16, 32, 4, 1), (16, 16, 4, 1)],
    "queries": [(128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2), (32, 32, 4, 1),
                (16, 32, 4, 1)],
}  # fmt: skip
LENGTHS = {512: 32, 2048: 8, 8192: 2}  # tokens: batch
HEADS = 12
PRECISIONS = {"half": (torch.bfloat16, torch.float16)}
HEAD_SIZES = (64, 128)
FLAGS = dict(mask=True, dropout=False, p2p=False)


def candidates(kernel: str, default: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    """The candidates of a kernel, the table's own tile first (so it is timed even on a short budget)."""
    return [default] + [tile for tile in CANDIDATES[kernel] if tile != default]


def usable(launch) -> bool:
    """Compiles and loads on this GPU without spilling."""
    try:
        compiled = launch.prepare()
    except Exception as error:  # out of resources, or the compiler refused
        print(f"    skipped {launch.options['BLOCK_M']}x{launch.options['BLOCK_N']}: {type(error).__name__}")
        return False
    return compiled.n_spills == 0


def time_tile(kernel: str, tile: tuple, dtypes: tuple, head_size: int, timer, tiles: dict) -> float | None:
    """Milliseconds summed over the lengths and dtypes, or None where the tile is not usable here. `tiles`: the
    other kernels' (the forward runs once per launch made, so that the backward reads real row statistics)."""
    total = 0.0
    for dtype in dtypes:
        for length, batch in LENGTHS.items():
            shape = dict(batch=batch, heads=HEADS)
            try:
                launch = call_launches(dtype, head_size, FLAGS, {**tiles, kernel: tile}, length, shape, "cuda")[kernel]
            except triton_attention.KernelLaunchError as error:  # the forward at this tile does not load here
                print(f"    skipped {'x'.join(map(str, tile))}: {error}")
                return None
            if not usable(launch):
                return None
            total += timer(launch)
    return total


def fits_everywhere(
    kernel: str, tile: tuple, dtypes: tuple, head_size: int, capability: tuple[int, int], tiles: dict
) -> bool:
    """`tile` compiled ahead of time for `capability` with this Triton in every specialisation of the report
    (`kernel_resources.variants`: dropout or not, padded or not, both lengths) neither spills nor asks for more shared
    memory than this GPU gives a block."""
    shared_limit = torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin
    target = f"sm_{capability[0]}{capability[1]}"
    configs = [
        {**config, "tiles": {**tiles, kernel: tile}, "shared_limit": shared_limit}
        for dtype in dtypes
        for config in kernel_resources.variants(target, str(dtype).removeprefix("torch."), head_size)
    ]
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        rows = [row for rows in pool.map(_measure_one, configs, [kernel] * len(configs)) for row in rows]
    return all(kernel_resources.fits(row) for row in rows)


def _measure_one(config: dict, kernel: str) -> list[dict]:
    return kernel_resources.measure(config, (kernel,))


def do_bench(launch) -> float:
    import triton

    return triton.testing.do_bench(launch, warmup=5, rep=20)


def tune(
    capability: tuple[int, int],
    gpu: str,
    budget_s: float,
    timer=do_bench,
    clock=time.perf_counter,
    check=fits_everywhere,
) -> dict:
    """{"half/64": {kernel: tile}} for what was tuned within the budget, and each candidate's time. A kernel keeps its
    fastest candidate that `check` finds fitting in every specialisation (else the table's tile)."""
    started, tiles, times = clock(), {}, {}
    for precision, dtypes in PRECISIONS.items():
        for head_size in HEAD_SIZES:
            default = triton_tiles.tiles_for(capability, dtypes[0], head_size, gpu)
            key = f"{precision}/{head_size}"
            for kernel in KERNELS:
                measured = {}
                for tile in candidates(kernel, tuple(default[kernel])):
                    if clock() - started > budget_s:
                        break
                    milliseconds = time_tile(kernel, tile, dtypes, head_size, timer, default)
                    if milliseconds is not None:
                        measured[tile] = milliseconds
                        print(f"  {key} {kernel:8} {'x'.join(map(str, tile)):14} {milliseconds:8.3f} ms", flush=True)
                fastest = next(
                    (t for t in sorted(measured, key=measured.get)
                     if check(kernel, t, dtypes, head_size, capability, default)),
                    None,
                )  # fmt: skip
                if fastest is not None:
                    tiles.setdefault(key, dict(default))[kernel] = fastest
                    times.setdefault(key, {})[kernel] = {
                        "x".join(map(str, t)): round(ms, 4) for t, ms in measured.items()
                    }
    return {"tiles": {key: {k: list(t) for k, t in entry.items()} for key, entry in tiles.items()}, "times": times}


def merge(path: Path, profile: dict) -> list[dict]:
    """The profiles in `path` with this GPU's under this Triton release replaced by `profile` (or added)."""
    profiles = triton_tiles.load_profiles(path)

    def same(p: dict) -> tuple:
        return p["gpu"], list(p["capability"]), triton_tiles._release(p.get("triton"))

    return [p for p in profiles if same(p) != same(profile)] + [profile]


def write(path: Path, profiles: list[dict]) -> None:
    """Written whole to a temporary file and renamed: a failed run leaves the old file as it was."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"profiles": profiles}, indent=1) + "\n")
    temporary.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no candidate after this (seconds)")
    parser.add_argument("--out", type=Path, default=triton_tiles.PROFILE_FILE)
    args = parser.parse_args(argv)
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        raise ValueError(f"tune_kernel times the Triton kernel on a CUDA GPU; --device {args.device} has none here")
    if not triton_attention.TRITON_AVAILABLE:
        raise ValueError("tune_kernel needs triton: pip install triton")
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    gpu, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    print(f"tuning on {gpu} (compute capability {capability[0]}.{capability[1]}), budget {args.budget_s:.0f} s")
    tuned = tune(capability, gpu, args.budget_s)
    import triton

    profile = {"gpu": gpu, "capability": list(capability), "triton": triton.__version__, "torch": torch.__version__,
               "lengths": LENGTHS, **tuned}  # fmt: skip
    write(args.out, merge(args.out, profile))
    print(f"wrote {gpu}'s profile to {args.out}: {json.dumps(tuned['tiles'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
