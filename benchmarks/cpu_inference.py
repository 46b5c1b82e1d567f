"""CPU inference of ours-sdpa: what each buffer and blocking choice of its by-distance path is worth, in one process.

    python -m benchmarks.cpu_inference                            # 4x512 and 1x2048, 2 layers
    python -m benchmarks.cpu_inference --cases 1x2048 --repeats 15
    python -m benchmarks.cpu_inference --baseline fcb26f5       # also the by-distance path of an earlier commit
    python -m benchmarks.cpu_inference --products               # only the T / U product shapes, alone
    python -m benchmarks.cpu_inference --far-calls 2048 4096    # only the far keys' calls: one causal, or by block
    python -m benchmarks.cpu_inference --bias-cost --dtype bfloat16   # only SDPA with and without a dense bias
    python -m benchmarks.cpu_inference --variants as-is --baseline fcb26f5 --processes 5   # five fresh processes

Times the model as it stands against variants that each undo one choice (module constants of
`disentangled.modeling.cpu_inference` and switches of `.dispatch`), interleaved with a same-size BERT with sdpa; prints medians and
ratios to BERT. Every variant's output is checked equal to the model's (a `--baseline` one to 1e-5). Variants:

- `fresh-buffers`: every call allocates its buffers (KEEP_WORKSPACE=False), as before they were kept;
- `no-kernel`: the pure-PyTorch path where the compiled bias kernel runs (CPU_KERNEL=False; the variants below
  tune that path, so they turn the kernel off too);
- `kernel-split-always`: the bias kernel and SDPA (CPU_FUSED=False), the far keys split off at every length
  (KERNEL_SPLIT_LENGTH=0);
- `whole-row-add`: the add of the c2p and p2c views over whole block rows (ADD_CHUNK_KEYS above any length);
- `band-32-keys`, `band-128-keys`: U's bands of 32 or 128 keys (BAND_TABLE_KEYS), not 64;
- `unpadded-products`: T and U products of their exact widths (PRODUCT_COLUMNS_MULTIPLE=1), not multiples of 16;
- `at-REV` (with `--baseline REV`): `_attend_by_distance` as it was at git revision REV (that commit's
  `modeling/cpu_inference.py`, or `modeling/disentangled_attention.py` before the attention code was split into
  files, loaded beside this one), for a change that is not a module constant.

Then the buffers one call leaves held, per length (what `model.release_workspace()` frees).

Ratios move between processes by more than the repeats within one show (on a 2-core EPYC, ours / BERT at 4x512
went from 1.20 to 1.37 over five processes). `--processes N` runs the comparison in N fresh processes and prints
each ratio's median over them with its range, to BERT and to the model as it stands.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

from benchmarks import machine
from benchmarks.run import V3_BASE, build_models, in_fresh_processes, inputs_for, print_ratio_medians, time_once
from disentangled.modeling import cpu_inference as by_distance
from disentangled.modeling import disentangled_attention, dispatch, native, workspace

PYTORCH = {"CPU_KERNEL": False}  # the path without the compiled kernel, which the variants below it tune
VARIANTS = {
    "as-is": {},
    "fresh-buffers": {"KEEP_WORKSPACE": False},
    "no-kernel": PYTORCH,
    "kernel-split-always": {"CPU_FUSED": False, "KERNEL_SPLIT_LENGTH": 0},
    "whole-row-add": {**PYTORCH, "ADD_CHUNK_KEYS": 1 << 30},
    "band-32-keys": {**PYTORCH, "BAND_TABLE_KEYS": 32},
    "band-128-keys": {**PYTORCH, "BAND_TABLE_KEYS": 128},
    "unpadded-products": {**PYTORCH, "PRODUCT_COLUMNS_MULTIPLE": 1},
}
# the module each setting is read from (the switches: `dispatch`; `_attend_by_distance`: `cpu_inference`, whose
# runner calls it)
HOMES = {
    "KEEP_WORKSPACE": dispatch,
    "ADD_CHUNK_KEYS": by_distance,
    "BAND_TABLE_KEYS": by_distance,
    "PRODUCT_COLUMNS_MULTIPLE": by_distance,
    "CPU_KERNEL": dispatch,
    "KERNEL_SPLIT_LENGTH": by_distance,
    "CPU_FUSED": dispatch,
    "_attend_by_distance": by_distance,
}


def baseline_backends(revision: str, folder: Path, file: str = "cpu_inference.py"):
    """modeling/`file` at git `revision` (modeling/disentangled_attention.py at a revision from before the attention
    code was split into files), imported as a sibling module of the current one (its relative imports resolve to
    today's package)."""
    root = Path(__file__).resolve().parent.parent
    for source in (file, "disentangled_attention.py"):
        shown = subprocess.run(
            ["git", "show", f"{revision}:modeling/{source}"], cwd=root, capture_output=True, text=True
        )
        if shown.returncode == 0:
            break
    if shown.returncode != 0:
        raise SystemExit(
            f"--baseline {revision}: git show failed ({shown.stderr.strip()}); give a commit of this repository"
        )
    path = folder / "baseline_attention.py"
    path.write_text(shown.stdout)
    name = f"{disentangled_attention.__package__}._baseline_attention"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def attend_at(revision: str, folder: Path):
    """`_attend_by_distance` as at `revision`, called as `sdpa_disentangled` calls today's (before the split, its
    caller passed the block size; before `dispatch.decide` chose the path, it chose its own)."""
    attend = baseline_backends(revision, folder)._attend_by_distance
    takes_path = "path" in inspect.signature(attend).parameters

    def attend_by_distance(*arguments, path=None):
        *arguments, block_elements = arguments
        block_elements = block_elements or by_distance.DISTANCE_BLOCK_ELEMENTS
        return attend(*arguments, block_elements, path=path) if takes_path else attend(*arguments, block_elements)

    return attend_by_distance


PRODUCT_SHAPES = [(512, 255), (512, 256), (128, 639), (128, 640), (192, 1017), (192, 1024)]  # (rows, columns)


def product_timings(repeats: int) -> None:
    """The T / U products alone ([12, rows, 64] x [12, 64, columns], the shapes 8x128, 4x512 and 1x2048 run): into
    a contiguous out= and into a column slice of a wider buffer (a strided out=), median milliseconds."""
    print("\n| rows x columns | contiguous out | strided out |\n|---|---|---|")
    for rows, columns in PRODUCT_SHAPES:
        left, right = torch.randn(12, rows, 64), torch.randn(12, columns, 64)
        contiguous, wider = torch.empty(12, rows, columns), torch.empty(12, rows, columns + 16)
        medians = []
        for out in (contiguous, wider[..., 8 : 8 + columns]):
            times = []
            for _ in range(repeats + 2):  # two warm-up calls
                start = time.perf_counter()
                torch.bmm(left, right.mT, out=out)
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times[2:]) * 1e3)
        print(f"| {rows} x {columns} | {medians[0]:.2f} ms | {medians[1]:.2f} ms |")


FAR_BLOCK_ROWS = (192, 256, 384)  # rows per block of the far keys' calls (`_attend_by_distance` uses 192)


def v3_positions(length: int) -> disentangled_attention.RelativePositions:
    """The relative positions of a `length`-token input to the v3-base shape (`V3_BASE`: 256 log buckets over
    max_position_embeddings)."""
    buckets, reach = V3_BASE["position_buckets"], V3_BASE["max_position_embeddings"]
    return disentangled_attention.RelativePositions.build(length, buckets, buckets, reach, "cpu")


def _far_call(query, key, value, bias, shift: int, rows: int | None) -> None:
    """The far-left keys (i - j >= shift): one causal call over rows [shift, L) and keys [0, L - shift) (`rows`
    None), or for each block of `rows` query rows one call without a mask over the keys before its band."""
    flash, length = by_distance.cpu_flash_attention, query.shape[-2]
    if rows is None:
        count = length - shift
        q, k, v = query[:, :, shift:], key[:, :, :count], value[:, :, :count]
        flash(q, k, v, is_causal=True, attn_mask=bias[..., :count], scale=0.125)
        return
    for first in range(0, length, rows):
        keys = first - shift + 1  # keys [0, first - shift + 1) are beyond the reach of every row of the block
        if keys > 0:
            q = query[:, :, first : first + rows]
            flash(q, key[:, :, :keys], value[:, :, :keys], attn_mask=bias[..., :keys], scale=0.125)


def far_call_timings(lengths: list[int], repeats: int) -> None:
    """The far-left keys of one layer alone (v3-base: 12 heads of 64, a key bias), as 8b013cf ran them, one causal
    call over rows [reach, L) against keys [0, L - reach), and as `_attend_by_distance` runs them now: for each
    block of rows, one call without a mask over the keys before its band (the band's call covers the rest of the
    triangle, whose pairs it computed and masked before).

    PyTorch's CPU flash kernel computes the key block (512 keys) that holds a row block's causal edge in full and
    masks it afterwards, so the causal call works on more pairs than the triangle holds. The blocks' parts are not
    merged here (the model merges them with the band's). Median milliseconds."""
    if not by_distance.CPU_FLASH_WITH_LSE:
        raise SystemExit("--far-calls needs PyTorch's CPU flash kernel (torch >= 2.3)")
    heads = V3_BASE["num_attention_heads"]
    dim = V3_BASE["hidden_size"] // heads
    blocks = " | ".join(f"blocks of {rows} rows" for rows in FAR_BLOCK_ROWS)
    print(f"\n| length | causal rows | one causal call | {blocks} |\n|---|---|---|{'---|' * len(FAR_BLOCK_ROWS)}")
    generator = torch.Generator().manual_seed(0)
    for length in lengths:
        near_low, near_high = v3_positions(length).near
        if near_high - near_low + 1 >= length:  # every distance in the band: `_attend_by_distance` does not split
            print(f"| {length} | 0 | no far keys | {' | '.join('-' for _ in FAR_BLOCK_ROWS)} |")
            continue
        query, key, value = (torch.randn(1, heads, length, dim, generator=generator) for _ in range(3))
        bias = torch.randn(1, 1, 1, length, generator=generator)
        times = [[] for _ in range(1 + len(FAR_BLOCK_ROWS))]
        with torch.inference_mode():
            for round_ in range(repeats + 1):  # interleaved; the first round warms up
                for rows, spent in zip((None, *FAR_BLOCK_ROWS), times):
                    start = time.perf_counter()
                    _far_call(query, key, value, bias, near_high, rows)
                    if round_:
                        spent.append(time.perf_counter() - start)
        cells = " | ".join(f"{statistics.median(spent) * 1e3:.1f} ms" for spent in times)
        print(f"| {length} | {length - near_high} | {cells} |")


def bias_cost_timings(cases: list[str], dtype: torch.dtype, repeats: int) -> None:
    """What a dense bias costs one layer of v3-base (12 heads of 64), per BATCHxLENGTH case, alone: one SDPA call
    over every row without a bias, with a key bias ([B, 1, 1, L]) and with a dense one ([B, H, L, L]); the compiled
    kernel making that dense bias from T and U by bucket (`native.position_bias`); and the fused attention that makes
    T, U and the bias inside its tiles (`native.attend`, bfloat16 on AMX or float32 with any vector set: the whole
    attention with both terms, to set beside SDPA without a bias, then with c2p alone and p2c alone, so that each
    term's cost is the difference). Median milliseconds."""

    heads = V3_BASE["num_attention_heads"]
    dim = V3_BASE["hidden_size"] // heads
    kernel = native.available()
    fused = native.attend_available(dtype)
    print(
        "\n| case | SDPA, no bias | key bias | dense bias | the kernel making it | fused attention, both terms |"
        " fused, c2p only | fused, p2c only |\n|---|---|---|---|---|---|---|---|"
    )
    generator = torch.Generator().manual_seed(0)
    for case in cases:
        batch, length = (int(part) for part in case.split("x"))
        positions = v3_positions(length)
        width = positions.width

        def randn(*shape):
            return torch.randn(*shape, generator=generator).to(dtype)

        query, key, value = (randn(batch, heads, length, dim) for _ in range(3))
        biases = {"none": None, "key": randn(batch, 1, 1, length), "dense": randn(batch, heads, length, length)}
        tables = [randn(batch * heads * length * width + 16)[:-16].view(batch, heads, length, width) for _ in range(2)]
        attend = partial(F.scaled_dot_product_attention, query, key, value)
        calls = {name: partial(attend, attn_mask=bias) for name, bias in biases.items()}
        if kernel:  # into the dense bias's tensor (T's columns are not reversed here: the same work)
            arguments = (biases["dense"], *tables, *native.kernel_columns(positions), None, 0, 0)
            calls["kernel"] = partial(native.position_bias, *arguments)
        if fused:  # Kr and Qr of 16-row multiples in the kernel's tile layout
            relative = [native.as_key_tiles(randn(heads, -(-width // 16) * 16, dim) * 0.3) for _ in range(2)]
            out = query.new_empty(batch, length, heads, dim)
            workspace = torch.empty(native.workspace_bytes(length, relative[0].shape[1] * 16), dtype=torch.uint8)
            columns = native.kernel_columns(positions)
            for name, tables in (
                ("fused", relative),
                ("fused-c2p", (relative[0], None)),
                ("fused-p2c", (None, relative[1])),
            ):
                arguments = (out, query, key, value, *tables, *columns, None, slice(0, length))
                calls[name] = partial(native.attend, *arguments, dim**-0.5, workspace)
        times = {name: [] for name in calls}
        with torch.inference_mode():
            for round_ in range(repeats + 1):  # interleaved; the first round warms up
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    if round_:
                        times[name].append(time.perf_counter() - start)
        cells = [
            f"{statistics.median(times[name]) * 1e3:.1f} ms" if name in times else "-"
            for name in ("none", "key", "dense", "kernel", "fused", "fused-c2p", "fused-p2c")
        ]
        print(f"| {case} | {' | '.join(cells)} |")


def held_mib(model) -> float:
    """MiB of the buffers `model` keeps on this thread after its last call."""
    held = workspace.kept_workspace(model.encoder) or {}
    tensors = [value for value in held.values() if isinstance(value, torch.Tensor)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors) / 2**20


def in_processes(args: argparse.Namespace, argv: list[str]) -> None:
    """The comparison in `args.processes` fresh processes, one after another; per case, each time's ratio to BERT's
    and to the model's as it stands, measured in the same process: the median over the processes and the range."""
    # the same arguments; argparse keeps the last of a repeated option, so these override the caller's
    child = [*argv, "--processes", "1", "--held-lengths", "--child-results"]
    runs = in_fresh_processes(
        "benchmarks.cpu_inference", child, args.processes, lambda path: json.loads(path.read_text())
    )
    print(f"\n{args.processes} processes: medians over the processes (lowest-highest) of each ratio, to BERT-sdpa and")
    print("to the model as it stands (measured in the same process)")
    print_ratio_medians(runs, ("bert-sdpa", "as-is"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["4x512", "1x2048"], help="BATCHxLENGTH")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--held-lengths", nargs="*", type=int, default=[512, 2048, 4096])
    parser.add_argument("--baseline", metavar="REV", help="also time `_attend_by_distance` as at this git revision")
    parser.add_argument("--products", action="store_true", help="only time the T / U product shapes, alone")
    parser.add_argument("--far-calls", nargs="+", type=int, metavar="LENGTH", help="only time the far keys' call")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="time only these (as-is always)")
    parser.add_argument(
        "--bias-cost", action="store_true", help="only time SDPA without, with a key, with a dense bias"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="of --bias-cost")
    parser.add_argument("--processes", type=int, default=1, help="run the comparison in this many fresh processes")
    parser.add_argument("--child-results", type=Path, help=argparse.SUPPRESS)  # a child of --processes writes here
    args = parser.parse_args(argv)
    if args.processes < 1:
        raise SystemExit(f"--processes {args.processes}: give 1 or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.products:
        print(f"{machine.describe()}; median of {args.repeats * 5} calls")
        product_timings(args.repeats * 5)
        return
    if args.bias_cost:
        print(f"{machine.describe()}; {args.dtype}; median of {args.repeats} interleaved rounds")
        bias_cost_timings(args.cases, getattr(torch, args.dtype), args.repeats)
        return
    if args.far_calls:
        print(f"{machine.describe()}; median of {args.repeats} interleaved rounds")
        far_call_timings(args.far_calls, args.repeats)
        return
    if args.processes > 1:
        in_processes(args, argv if argv is not None else sys.argv[1:])
        return
    variants = {name: VARIANTS[name] for name in ["as-is", *(args.variants or VARIANTS)]}
    with tempfile.TemporaryDirectory() as folder:
        models = build_models(args.layers, Path(folder), ["sdpa"], False)
        if args.baseline:
            variants[f"at-{args.baseline}"] = {"_attend_by_distance": attend_at(args.baseline, Path(folder))}
    ours, bert = models["ours-sdpa"], models["bert-sdpa"]
    defaults = {name: getattr(HOMES[name], name) for settings in variants.values() for name in settings}

    workspaces = {}  # each variant keeps its own buffers, as a model running only that variant would

    def call(variant: str, inputs) -> float:
        for name, value in {**defaults, **variants[variant]}.items():
            setattr(HOMES[name], name, value)
        if dispatch.KEEP_WORKSPACE:
            workspace.kept_workspace(ours.encoder)  # makes this thread's {module: workspace} map
            workspace._workspaces.by_module[ours.encoder] = workspaces.setdefault(variant, {})
        return time_once(ours, inputs, False)

    print(f"{machine.describe()}; {args.layers} layers; median of {args.repeats} interleaved rounds")
    ratios = {}  # {case: {name: median / BERT's median}}
    try:
        for case in args.cases:
            batch, length = (int(part) for part in case.split("x"))
            inputs = inputs_for(batch, length, padded=True)
            outputs = {}
            for variant in variants:
                call(variant, inputs)
                with torch.inference_mode():
                    outputs[variant] = ours(**inputs).last_hidden_state
                # the variants of one path only regroup the same sums: equal; the other paths (the pure-PyTorch one,
                # the fused attention's), the far keys' merge and an earlier commit sum in another order
                other_paths = ("CPU_KERNEL", "CPU_FUSED", "KERNEL_SPLIT_LENGTH")
                other_sums = variant.startswith("at-") or any(name in variants[variant] for name in other_paths)
                tolerance = 1e-5 if other_sums else 0.0
                if not torch.allclose(outputs[variant], outputs["as-is"], rtol=tolerance, atol=tolerance):
                    raise SystemExit(f"{variant} changes the outputs at {case}")
            times = {name: [] for name in [*variants, "bert-sdpa"]}
            for _ in range(args.repeats):
                for variant in variants:
                    times[variant].append(call(variant, inputs))
                times["bert-sdpa"].append(time_once(bert, inputs, False))
            bert_time = statistics.median(times["bert-sdpa"])
            print(f"\n| {case} | median | / bert-sdpa |\n|---|---|---|")
            for name, values in times.items():
                median = statistics.median(values)
                ratios.setdefault(case, {})[name] = median / bert_time
                print(f"| {name} | {median * 1e3:.1f} ms | {median / bert_time:.2f} |")
    finally:
        for name, value in defaults.items():
            setattr(HOMES[name], name, value)
    if args.child_results:
        args.child_results.write_text(json.dumps(ratios))
    print("\n| length | buffers held after a call |\n|---|---|")
    for length in args.held_lengths:
        ours.release_workspace()
        with torch.inference_mode():
            ours(**inputs_for(1, length, padded=False))
        print(f"| {length} | {held_mib(ours):.0f} MiB |")


if __name__ == "__main__":
    main()
