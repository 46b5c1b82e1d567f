"""What the compiler makes of the Triton kernels, on a CPU: registers, spills and shared memory per GPU.

Every kernel of `modeling/triton_attention.py` is compiled ahead of time (`triton.compile` with a `GPUTarget`, the
ptxas inside triton's wheel) for each target GPU at the tiles the dispatcher picks there (`triton_attention.tiles_for`,
which reads `TILES`), over dtype x head size x dropout, with a key mask and c2p + p2c; on sm_80 and sm_90 at head
size 64 also without a mask and with p2p. The arguments are built the way the autograd function builds them
(`forward_launch`, `backward_launches`), on CPU tensors of the benchmark's shape, so the compiler specialises them as
on a GPU. Per compile: registers and STACK bytes per thread (spilled registers live there) from the wheel's
`cuobjdump -res-usage`, and the shared memory the launch asks for (the compiled metadata) against what the GPU
gives one block.

    python -m benchmarks.kernel_resources [--json FILE] [--targets sm_80 sm_90] [--processes N] [--no-record]

prints the table, writes the rows as JSON lines to --json, and appends a record to
`benchmarks/records/kernel_resources.jsonl` (the performance page's table comes from it). Compiles run in parallel
processes; Triton caches what it compiled, so a second run takes seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from disentangled.modeling import triton_attention
from disentangled.modeling.triton_attention import SHARED_MEMORY, TILES, tiles_for

from .records import append_record

TARGETS = {"sm_75": (7, 5), "sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90": (9, 0)}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
KERNELS = ("forward", "keys", "queries")
KERNEL_NAMES = {"forward": "_forward_kernel", "keys": "_backward_keys_kernel", "queries": "_backward_queries_kernel"}
SHAPE = dict(batch=2, heads=12, length=512)  # DeBERTa-v3-base's heads, at 512 tokens


def configurations(targets: list[str]) -> list[dict]:
    """One dict per (target, dtype, head size, flags): the report's matrix."""
    rows = []
    for target in targets:
        capability = TARGETS[target]
        dtypes = ["float16", "float32"] if capability < (8, 0) else list(DTYPES)  # no bfloat16 before Ampere
        for dtype in dtypes:
            for head_size in (32, 64, 128):
                for dropout in (False, True):
                    rows.append(dict(target=target, dtype=dtype, head_size=head_size,
                                     flags=dict(mask=True, dropout=dropout, p2p=False)))  # fmt: skip
            if target in ("sm_80", "sm_90"):
                rows.append(
                    dict(target=target, dtype=dtype, head_size=64, flags=dict(mask=False, dropout=False, p2p=False))
                )
                rows.append(
                    dict(target=target, dtype=dtype, head_size=64, flags=dict(mask=True, dropout=False, p2p=True))
                )
    return rows


def launches(dtype: torch.dtype, head_size: int, flags: dict, tiles: dict, shape: dict = SHAPE, device="cpu") -> dict:
    """The three kernels' launches for a call of `shape`: on CPU tensors to compile (never run), or filled on a GPU
    to time (`benchmarks.tune_kernel`), with DeBERTa-v3's log buckets (256 per side, reach 512)."""
    from disentangled.modeling.disentangled_attention import RelativePositions
    from disentangled.modeling.workspace import int32_column

    batch, heads, length = shape["batch"], shape["heads"], shape["length"]
    positions = RelativePositions.build(length, 256, 256, 512, device)
    width = positions.width  # the reachable relative rows: 511 at 512 tokens

    def tensor(*size, dtype=dtype):
        return torch.randn(*size, dtype=dtype, device=device) if device != "cpu" else torch.empty(*size, dtype=dtype)

    query, key, value = (tensor(batch, length, heads, head_size).transpose(1, 2) for _ in range(3))
    c2p, p2c = (tensor(batch, heads, length, width) for _ in range(2))
    p2p = tensor(heads, 2 * length - 1) if flags["p2p"] else None
    column, runs = int32_column(positions), triton_attention.column_runs(positions)
    keep = torch.ones(batch, length, dtype=torch.bool, device=device) if flags["mask"] else None
    inputs = (query, key, value, c2p, p2c, p2p, column, runs, keep)
    dropout, seed, scaling = (0.1 if flags["dropout"] else 0.0), 1, head_size**-0.5 / 3**0.5
    context = tensor(batch, length, heads, head_size)
    row_max, log_sum, delta = (tensor(batch, heads, length, dtype=torch.float32) for _ in range(3))
    grads = (
        torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
        torch.zeros_like(c2p, dtype=torch.float32), torch.zeros_like(p2c, dtype=torch.float32),
        torch.zeros_like(p2p, dtype=torch.float32) if p2p is not None else None,
    )  # fmt: skip
    forward = triton_attention.forward_launch(inputs, (context, row_max, log_sum), scaling, dropout, seed, tiles)
    keys, queries = triton_attention.backward_launches(
        inputs, (context, row_max, log_sum, delta), grads, scaling, dropout, seed, tiles
    )
    return {"forward": forward, "keys": keys, "queries": queries}


def compile_launch(launch, capability: tuple[int, int]):
    """`launch`'s kernel compiled for `capability` as the JIT would specialise these arguments, without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    backend = make_backend(target)
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.options)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.options, bound, specialization, options)
    return triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def cuobjdump() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def resource_usage(cubin: bytes) -> dict:
    """REG and STACK of the cubin's kernel, from `cuobjdump -res-usage`."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run(
            [str(cuobjdump()), "-res-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if usage is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {text[-500:]}")
    return {"registers": int(usage.group(1)), "stack": int(usage.group(2))}


def measure(configuration: dict) -> list[dict]:
    """The rows of one configuration: one per kernel."""
    capability = TARGETS[configuration["target"]]
    dtype = DTYPES[configuration["dtype"]]
    tiles = tiles_for(capability, dtype, configuration["head_size"])
    rows = []
    for name in KERNELS:
        row = {
            "kernel": name,
            **configuration,
            "tiles": list(tiles[name]) if tiles is not None else None,
            "registers": None,
            "stack": None,
            "shared": None,
            "shared_limit": SHARED_MEMORY[capability],
            "falls_back": tiles is None,
        }
        if tiles is not None:
            compiled = compile_launch(
                launches(dtype, configuration["head_size"], configuration["flags"], tiles)[name], capability
            )
            row.update(resource_usage(compiled.asm["cubin"]), shared=compiled.metadata.shared)
        rows.append(row)
    return rows


def fits(row: dict) -> bool:
    """A row is fine where its config falls back (on purpose) or the kernel neither spills nor asks for too much."""
    return row["falls_back"] or (row["stack"] == 0 and row["shared"] <= row["shared_limit"])


def table(rows: list[dict]) -> list[str]:
    """Markdown lines: one row per (target, dtype, head size, flags), the three kernels side by side."""
    lines = [
        "| GPU | dtype | D | flags | tiles fwd / keys / queries | registers | stack (bytes) | shared (KB) / limit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["target"], row["dtype"], row["head_size"], json.dumps(row["flags"], sort_keys=True))
        groups.setdefault(key, []).append(row)
    for (target, dtype, head_size, _), group in groups.items():
        flags = group[0]["flags"]
        named = "+".join(name for name in ("mask", "dropout", "p2p") if flags[name]) or "none"
        if group[0]["falls_back"]:
            lines.append(f"| {target} | {dtype} | {head_size} | {named} | falls back to sdpa's path | | | |")
            continue
        by_kernel = {row["kernel"]: row for row in group}  # all three, or those a caller picked (misfits)

        def column(value, by_kernel=by_kernel) -> str:
            return " / ".join(value(by_kernel[k]) if k in by_kernel else "-" for k in KERNELS)

        tiles = column(lambda row: "x".join(str(n) for n in row["tiles"]))
        registers = column(lambda row: str(row["registers"]))
        stack = column(lambda row: str(row["stack"]))
        shared = column(lambda row: f"{row['shared'] / 1024:.0f}")
        limit = group[0]["shared_limit"] / 1024
        lines.append(
            f"| {target} | {dtype} | {head_size} | {named} | {tiles} | {registers} | {stack} | {shared} / {limit:.0f} |"
        )
    return lines


def section(records: list[dict]) -> str:
    """The performance page's table: the newest record's rows, with where and how it was made."""
    if not records:
        return "No record yet: `python -m benchmarks.kernel_resources` makes one (on a CPU, in minutes)."
    record = records[-1]
    figures = record["figures"]
    rows = figures["rows"]
    misfits = sum(not fits(row) for row in rows)
    return "\n".join(
        [
            f"Triton {figures['triton']}, torch {record['torch']}, commit {record['commit']}, {record['time'][:10]}; "
            f"{len(rows)} compiles, {misfits} that spill or exceed shared memory. Command: `{record['command']}`",
            "",
            *table(rows),
        ]
    )


def run(targets: list[str], processes: int) -> list[dict]:
    configs = configurations(targets)
    with ProcessPoolExecutor(max_workers=processes) as pool:
        return [row for rows in pool.map(measure, configs) for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows as JSON lines here")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/records/")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = run(args.targets, args.processes)
    seconds = time.perf_counter() - started
    print("\n".join(table(rows)))
    bad = [row for row in rows if not fits(row)]
    print(f"{len(rows)} compiles in {seconds:.0f} s; {len(bad)} spill or exceed shared memory")
    if args.json:
        args.json.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if not args.no_record:
        import triton

        figures = {"triton": triton.__version__, "shape": SHAPE, "seconds": round(seconds, 1), "rows": rows,
                   "tiles": {f"{major}.{minor}": {f"{p}/{d}": t for (p, d), t in entries.items()}
                             for (major, minor), entries in TILES.items()}}  # fmt: skip
        append_record(
            "kernel_resources",
            figures,
            command=["python", "-m", "benchmarks.kernel_resources"] + (argv if argv is not None else sys.argv[1:]),
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
