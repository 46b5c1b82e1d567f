"""What the compiler makes of the Triton kernels, on a CPU: registers, spills and shared memory per GPU, in every
specialisation a real call gets, under each Triton a supported torch pins.

Triton compiles one kernel per specialisation of its arguments: an integer equal to 1 becomes a constant, and an
integer or pointer divisible by 16 carries that fact into the compiler, which changes vectorisation, pipelining and
so registers. A kernel that fits in one specialisation can spill in another. So every launch here is made the way a
training step makes it (`call_launches`): one layer of DeBERTa-v3's shape (log buckets 256, reach 512) is built on
the meta device, its own code projects q, k, v and the position tables, the model's mask code turns a padded batch
into the key mask (an unpadded one into none), `triton_disentangled` draws the dropout seed as in training and the
autograd function builds the forward's launch, and a backward through the layer's output builds the backward's two;
the launches are captured instead of run. Each is compiled ahead of time (`triton.compile` with a `GPUTarget`, the
ptxas inside triton's wheel) for each target GPU at the tiles the dispatcher picks there (`triton_tiles.tiles_for`).

The matrix: sm_75 (float16, float32), sm_80, sm_86, sm_89, sm_90 (float16, bfloat16, float32) x head size 32, 64,
128 x dropout or not x padded (key mask) or not x a length that is a multiple of 16 and one that is not (`LENGTHS`:
the length, the key mask's batch stride and the tables' strides follow it); on sm_80 and sm_90 at head size 64 also
p2p. Per compile: registers and STACK bytes per thread (spilled registers live there) from the wheel's `cuobjdump
-res-usage`, and the shared memory the launch asks for (the compiled metadata) against what the GPU gives one block.

    python -m benchmarks.kernel_resources [--json FILE] [--targets sm_80 sm_90] [--processes N] [--no-record]
                                          [--python OTHER_PYTHON ...]

prints the table, writes the rows as JSON lines to --json, and appends a record to
`benchmarks/records/kernel_resources.jsonl` (the performance page's table comes from it). `--python` runs the same
matrix again in another interpreter, with the Triton installed there (torch 2.14 pins Triton 3.8, torch 2.13 Triton
3.9); each row names its Triton. Compiles run in parallel processes; Triton caches what it compiled, so a second
run takes a fraction of the first.
"""

from __future__ import annotations

import argparse
import contextlib
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
from disentangled.modeling.triton_tiles import SHARED_MEMORY, TILES, tiles_for

from .records import append_record

TARGETS = {"sm_75": (7, 5), "sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90": (9, 0)}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
KERNELS = ("forward", "keys", "queries")
KERNEL_NAMES = {"forward": "_forward_kernel", "keys": "_backward_keys_kernel", "queries": "_backward_queries_kernel"}
SHAPE = dict(batch=2, heads=12)  # DeBERTa-v3-base's heads
# A length that is a multiple of 16 and one that is not: Triton compiles the two apart (the length, the key mask's
# batch stride, the tables' strides), and users run both (a tokenizer pads to the longest text, or to a multiple of 8)
LENGTHS = (512, 509)


def configurations(targets: list[str], lengths: tuple[int, ...] = LENGTHS) -> list[dict]:
    """One dict per (target, dtype, head size, flags, length): the report's matrix."""
    rows = []
    for target in targets:
        dtypes = ["float16", "float32"] if capability_of(target) < (8, 0) else list(DTYPES)  # no bfloat16 before 8.0
        for dtype in dtypes:
            for head_size in (32, 64, 128):
                rows += variants(target, dtype, head_size, lengths)
            if target in ("sm_80", "sm_90"):  # p2p (no released checkpoint uses it): one more term's code
                for length in lengths:
                    flags = dict(mask=True, dropout=False, p2p=True)
                    rows.append(dict(target=target, dtype=dtype, head_size=64, flags=flags, length=length))
    return rows


def variants(target: str, dtype: str, head_size: int, lengths: tuple[int, ...] = LENGTHS) -> list[dict]:
    """The specialisations a kernel of this precision and head size gets from real calls without p2p: dropout or not
    x padded or not x each length."""
    return [
        dict(target=target, dtype=dtype, head_size=head_size, flags=dict(mask=mask, dropout=dropout, p2p=False),
             length=length)
        for dropout in (False, True) for mask in (True, False) for length in lengths
    ]  # fmt: skip


def capability_of(target: str) -> tuple[int, int]:
    """(8, 6) of "sm_86"."""
    return TARGETS.get(target) or (int(target[3:-1]), int(target[-1]))


@contextlib.contextmanager
def _captured_launches(run_forward: bool):
    """Within it, the kernels' launches are recorded instead of run (and the backward's pre-launch check skipped);
    with `run_forward` the forward also runs, so that a backward timed afterwards reads real row statistics."""
    launch_class = triton_attention.Launch
    call, prepare, captured = launch_class.__call__, launch_class.prepare, []

    def record(launch):
        captured.append(launch)
        if run_forward and launch.kernel is triton_attention._forward_kernel:
            return call(launch)
        return None

    launch_class.__call__, launch_class.prepare = record, lambda launch: None
    try:
        yield captured
    finally:
        launch_class.__call__, launch_class.prepare = call, prepare


def call_launches(
    dtype: torch.dtype,
    head_size: int,
    flags: dict,
    tiles: dict,
    length: int = LENGTHS[0],
    shape: dict = SHAPE,
    device="meta",
) -> dict:
    """The three kernels' launches of one training step through a layer of DeBERTa-v3's shape (see the module
    docstring): on the meta device to compile (nothing runs), or on a GPU to time (`benchmarks.tune_kernel`; the
    forward then runs once). flags: mask (a padded batch: its last sequence ends at 3/4 of `length`; else every
    token real, and the model passes no mask), dropout (0.1, a seed drawn as in training), p2p."""
    from disentangled.configuration.configuration_disentangled import DisentangledConfig
    from disentangled.modeling.modeling_disentangled import DisentangledEncoder, DisentangledModel
    from disentangled.pretraining.memory import V3_SHAPE

    batch, heads = shape["batch"], shape["heads"]
    hidden_size = heads * head_size
    config = DisentangledConfig(
        **{**V3_SHAPE, "pos_att_type": "p2c|c2p|p2p" if flags["p2p"] else "p2c|c2p"},
        hidden_size=hidden_size, num_attention_heads=heads, intermediate_size=4 * hidden_size, num_hidden_layers=1,
        attention_probs_dropout_prob=0.1 if flags["dropout"] else 0.0, hidden_dropout_prob=0.0,
    )  # fmt: skip
    with torch.device(device):
        encoder = DisentangledEncoder(config).to(dtype).train()
        hidden = torch.randn(batch, length, hidden_size, dtype=dtype, requires_grad=True)
    tokens = torch.ones(batch, length, dtype=torch.long)
    if flags["mask"]:
        tokens[-1, 3 * length // 4 :] = 0
    _, key_mask = DisentangledModel._masks(tokens, tokens.shape)  # [B, 1, 1, L] bool, or None; read on the CPU
    key_mask = key_mask.to(device) if key_mask is not None else None  # (same strides: a meta tensor has no values)
    positions = encoder.get_rel_index(length, device)
    rel_embeddings = encoder.get_rel_embedding(positions.rows)
    attention = encoder.layer[0].attention
    query, key, value = attention.self.project(hidden, None)  # [B, H, L, D]
    scores = attention.self.position_scores(query, key, rel_embeddings, positions)
    with _captured_launches(run_forward=device != "meta") as captured:
        context, _ = triton_attention.triton_disentangled(
            attention.self, query, key, value, key_mask, attention.self.scaling, attention.self.dropout_p, scores,
            blocks=tiles,
        )  # fmt: skip
        attention.output(context.flatten(-2), hidden).sum().backward()  # dO as the layer's own backward makes it
    if [launch.kernel.__name__ for launch in captured] != [KERNEL_NAMES[name] for name in KERNELS]:
        raise RuntimeError(f"expected the forward and the backward's two launches, captured {captured}")
    return dict(zip(KERNELS, captured))


def _binding(launch, capability: tuple[int, int]):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    backend = make_backend(target)
    binder = create_function_from_signature(launch.kernel.signature, launch.kernel.params, backend)
    return target, backend, binder(*launch.args, **launch.options)


def specialisation(launch, capability: tuple[int, int] = (9, 0)) -> dict[str, tuple]:
    """How the JIT specialises `launch`'s arguments (Triton's own binder): name -> (type, "D" where divisible by 16,
    "" where not, None where not specialised), ("constexpr", value) for an integer equal to 1 or a constexpr."""
    _, _, (_, specialization, _) = _binding(launch, capability)
    names = [param.name for param in launch.kernel.params]
    return {name: tuple(value) for name, value in zip(names, specialization)}


def _source(launch, capability: tuple[int, int]):
    """What the compiler is handed for `launch` on `capability`: the target, the kernel specialised, the options."""
    from triton.compiler import ASTSource

    target, backend, (bound, specialization, options) = _binding(launch, capability)
    kernel = launch.kernel
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.options, bound, specialization, options)
    attrs = {path: attr for path, attr in attrs.items() if attr}  # an integer with no fact (1 annotated int32) has []
    return target, ASTSource(kernel, signature, constexprs, attrs), options


def compile_key(launch, capability: tuple[int, int] = (9, 0)) -> str:
    """Equal for two launches exactly where the compiler makes the same kernel of them (Triton's own cache key)."""
    _, source, options = _source(launch, capability)
    return source.hash() + options.hash()


def compile_launch(launch, capability: tuple[int, int]):
    """`launch`'s kernel compiled for `capability` as the JIT would specialise these arguments, without a GPU."""
    from triton.compiler import compile as triton_compile

    target, source, options = _source(launch, capability)
    return triton_compile(source, target=target, options=options.__dict__)


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


def triton_version() -> str:
    import triton

    return triton.__version__


def measure(configuration: dict, kernels: tuple[str, ...] | None = None) -> list[dict]:
    """The rows of one configuration: one per kernel (`kernels`, else `configuration["kernels"]`, else all three).
    Its tiles are `configuration["tiles"]` where given (a candidate), else the dispatcher's for that GPU and this
    Triton."""
    kernels = kernels or tuple(configuration.get("kernels", KERNELS))
    capability = capability_of(configuration["target"])
    dtype = DTYPES[configuration["dtype"]]
    version = triton_version()
    tiles = configuration.get("tiles", "table")
    if tiles == "table":
        tiles = tiles_for(capability, dtype, configuration["head_size"], triton_version=version)
    elif tiles is not None:  # a candidate, perhaps from JSON: tuples, as the table's
        tiles = {kernel: tuple(tile) for kernel, tile in tiles.items()}
    length = configuration.get("length", LENGTHS[0])
    made = call_launches(dtype, configuration["head_size"], configuration["flags"], tiles, length) if tiles else {}
    rows = []
    for name in kernels:
        row = {
            "kernel": name,
            **{key: value for key, value in configuration.items() if key not in ("tiles", "kernels")},
            "length": length,
            "triton": version,
            "tiles": list(tiles[name]) if tiles is not None else None,
            "registers": None,
            "stack": None,
            "shared": None,
            "shared_limit": configuration.get("shared_limit") or SHARED_MEMORY[capability],
            "falls_back": tiles is None,
        }
        if tiles is not None:
            compiled = compile_launch(made[name], capability)
            row.update(resource_usage(compiled.asm["cubin"]), shared=compiled.metadata.shared)
        rows.append(row)
    return rows


def fits(row: dict) -> bool:
    """A row is fine where its config falls back (on purpose) or the kernel neither spills nor asks for too much."""
    return row["falls_back"] or (row["stack"] == 0 and row["shared"] <= row["shared_limit"])


def variant(row: dict) -> str:
    """A row's flags and length in words: "mask+dropout, 509"."""
    flags = row["flags"]
    named = "+".join(name for name in ("mask", "dropout", "p2p") if flags[name]) or "no mask"
    return f"{named}, {row.get('length', 512)}"


def table(rows: list[dict]) -> list[str]:
    """Markdown lines: one row per (Triton, target, dtype, head size), the three kernels side by side, each figure
    the largest over that group's specialisations (flags x length), which the `compiles` column counts."""
    lines = [
        "| Triton | GPU | dtype | D | tiles fwd / keys / queries | compiles | registers (max) | stack (bytes, max) |"
        " shared (KB, max) / limit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row.get("triton", "?"), row["target"], row["dtype"], row["head_size"]), []).append(row)
    for (version, target, dtype, head_size), group in groups.items():
        if all(row["falls_back"] for row in group):
            lines.append(f"| {version} | {target} | {dtype} | {head_size} | falls back to sdpa's path | | | | |")
            continue
        group = [row for row in group if not row["falls_back"]]
        by_kernel = {name: [row for row in group if row["kernel"] == name] for name in KERNELS}

        def column(value, by_kernel=by_kernel) -> str:  # "-" for a kernel this group lacks (a test's misfits)
            return " / ".join(value(by_kernel[k]) if by_kernel[k] else "-" for k in KERNELS)

        tiles = column(lambda rows: " or ".join(sorted({"x".join(str(n) for n in row["tiles"]) for row in rows})))
        registers = column(lambda rows: str(max(row["registers"] for row in rows)))
        stack = column(lambda rows: str(max(row["stack"] for row in rows)))
        shared = column(lambda rows: f"{max(row['shared'] for row in rows) / 1024:.0f}")
        limit = group[0]["shared_limit"] / 1024
        lines.append(
            f"| {version} | {target} | {dtype} | {head_size} | {tiles} | {len(group)} | {registers} | {stack} | "
            f"{shared} / {limit:.0f} |"
        )
    return lines


def misfit_lines(rows: list[dict]) -> list[str]:
    """One line per compile that spills or asks for too much shared memory."""
    return [
        f"Triton {row.get('triton', '?')} {row['target']} {row['dtype']} D={row['head_size']} {row['kernel']} "
        f"({variant(row)}) at {'x'.join(map(str, row['tiles']))}: stack {row['stack']} B, "
        f"shared {row['shared'] / 1024:.0f} of {row['shared_limit'] / 1024:.0f} KB"
        for row in rows
        if not fits(row)
    ]


def counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Per Triton and target: compiles, spills, shared-memory overruns (the before/after figures)."""
    found: dict[str, dict[str, int]] = {}
    for row in rows:
        if row["falls_back"]:
            continue
        entry = found.setdefault(f"{row.get('triton', '?')} {row['target']}", dict(compiles=0, spill=0, shared=0))
        entry["compiles"] += 1
        entry["spill"] += row["stack"] > 0
        entry["shared"] += row["shared"] > row["shared_limit"]
    return found


def section(records: list[dict]) -> str:
    """The performance page's table: the newest record's rows, with where and how it was made."""
    if not records:
        return "No record yet: `python -m benchmarks.kernel_resources` makes one (on a CPU, in minutes)."
    record = records[-1]
    figures = record["figures"]
    rows = figures["rows"]
    misfits = sum(not fits(row) for row in rows)
    versions = sorted({row.get("triton", figures["triton"]) for row in rows})
    return "\n".join(
        [
            f"Triton {' and '.join(versions)}, torch {record['torch']}, commit {record['commit']}, "
            f"{record['time'][:10]}; {len(rows)} compiles (lengths {', '.join(map(str, figures.get('lengths', [512])))}"
            f", padded and not, with and without dropout), {misfits} that spill or exceed shared memory. "
            f"Command: `{record['command']}`",
            "",
            *table(rows),
            *(["", *misfit_lines(rows)] if misfits else []),
        ]
    )


def candidates(largest: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    """Tiles no larger than `largest` (BLOCK_M x BLOCK_N), largest first; of one size, `largest`'s shape and warps
    first, then more pipeline stages."""
    block_m, block_n, warps, stages = largest
    tiles = [
        (m, n, w, s)
        for m in (128, 64, 32, 16) for n in (128, 64, 32, 16) for w in (8, 4) for s in (2, 1)
        if m * n <= block_m * block_n and max(m, n) <= 4 * min(m, n) and (m, n, w, s) != largest
    ]  # fmt: skip
    return [largest] + sorted(tiles, key=lambda t: (-t[0] * t[1], (t[0], t[1]) != (block_m, block_n), t[2] != warps,
                                                    -t[3]))  # fmt: skip


def search(group: dict, kernel: str, start: tuple, pythons: list[str], processes: int) -> tuple | None:
    """The largest tile (`candidates` of `start`) at which `kernel` fits in every specialisation of `group` (target,
    precision's dtypes, head size: `variants`, and p2p where the report has it) under this Triton and each of
    `pythons`'; None where none does down to 16 x 16. The other kernels keep `group["tiles"]`. A candidate is tried
    first in the specialisation that spilled most in the report (`group["worst"]`), then in all."""
    configs = [
        config for config in configurations([group["target"]])
        if config["dtype"] in group["dtypes"] and config["head_size"] == group["head_size"]
    ]  # fmt: skip
    worst = [config for config in configs if variant(config) == group["worst"]]
    for tile in candidates(start):
        for phase in (worst, configs):
            tiles = {**group["tiles"], kernel: list(tile)}
            jobs = [{**config, "tiles": tiles, "kernels": [kernel]} for config in phase]
            rows = run(jobs, processes)
            if all(fits(row) for row in rows):
                for python in pythons:
                    rows += run_elsewhere(python, jobs, processes)
            if not all(fits(row) for row in rows):
                print(f"  {group['target']} {'/'.join(group['dtypes'])} D={group['head_size']} {kernel}: "
                      f"{'x'.join(map(str, tile))} misfits: {misfit_lines(rows)[0]}", flush=True)  # fmt: skip
                break
        else:
            return tile
    return None


def search_misfits(rows: list[dict], pythons: list[str], processes: int) -> dict[tuple, tuple | None]:
    """For each (target, precision, head size, kernel) with a misfit among `rows`: the tile `search` finds."""
    found = {}
    for row in rows:
        if fits(row):
            continue
        precision = "float32" if row["dtype"] == "float32" else "half"
        key = (row["target"], precision, row["head_size"], row["kernel"])
        worst = found.get(key)
        if worst is None or row["stack"] > worst["stack"]:
            found[key] = row
    proposals = {}
    for (target, precision, head_size, kernel), worst in sorted(found.items()):
        dtypes = ["float32"] if precision == "float32" else ["float16", "bfloat16"][: 1 if target == "sm_75" else 2]
        tiles = tiles_for(TARGETS[target], DTYPES[dtypes[0]], head_size)
        group = dict(target=target, dtypes=dtypes, head_size=head_size, tiles=tiles, worst=variant(worst))
        proposals[(target, precision, head_size, kernel)] = search(group, kernel, tuple(worst["tiles"]), pythons,
                                                                   processes)  # fmt: skip
        print(
            f"{target} {precision}/{head_size} {kernel}: {'x'.join(map(str, worst['tiles']))} -> "
            f"{'x'.join(map(str, proposals[(target, precision, head_size, kernel)] or ['none']))}",
            flush=True,
        )
    return proposals


def run(configs: list[dict], processes: int) -> list[dict]:
    """The rows of `configs`, compiled here (this interpreter's Triton) in `processes` processes."""
    with ProcessPoolExecutor(max_workers=processes) as pool:
        return [row for rows in pool.map(measure, configs) for row in rows]


def run_elsewhere(python: str, configs: list[dict], processes: int) -> list[dict]:
    """The rows of `configs` compiled by another interpreter (its own Triton), which must import this checkout."""
    with tempfile.TemporaryDirectory() as folder:
        jobs, out = Path(folder) / "jobs.json", Path(folder) / "rows.jsonl"
        jobs.write_text(json.dumps(configs))
        command = [python, "-m", "benchmarks.kernel_resources", "--jobs", str(jobs), "--json", str(out),
                   "--processes", str(processes), "--no-record"]  # fmt: skip
        subprocess.run(command, cwd=Path(__file__).resolve().parents[1], check=True, stdout=subprocess.DEVNULL)
        return [json.loads(line) for line in out.read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows as JSON lines here")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/records/")
    parser.add_argument("--python", action="append", default=[], help="also compile with this interpreter's Triton")
    parser.add_argument("--jobs", type=Path, help=argparse.SUPPRESS)  # a parent's configurations (run_elsewhere)
    parser.add_argument(
        "--search",
        type=Path,
        metavar="ROWS",
        help="propose tiles where the rows of a --json file misfit: the largest that fit everywhere",
    )
    args = parser.parse_args(argv)
    if args.search:
        rows = [json.loads(line) for line in args.search.read_text().splitlines()]
        search_misfits([row for row in rows if row["target"] in args.targets], args.python, args.processes)
        return 0
    configs = json.loads(args.jobs.read_text()) if args.jobs else configurations(args.targets)
    started = time.perf_counter()
    rows = run(configs, args.processes)
    for python in args.python:
        rows += run_elsewhere(python, configs, args.processes)
    seconds = time.perf_counter() - started
    if args.json:
        args.json.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if args.jobs:
        return 0
    print("\n".join(table(rows)))
    bad = misfit_lines(rows)
    print("\n".join(bad))
    print(f"{len(rows)} compiles in {seconds:.0f} s; {len(bad)} spill or exceed shared memory")
    if not args.no_record:
        figures = {"triton": sorted({row["triton"] for row in rows}), "shape": SHAPE, "lengths": list(LENGTHS),
                   "seconds": round(seconds, 1), "rows": rows,
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
