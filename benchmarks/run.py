"""Speed and memory of our backends against transformers' DeBERTa-v2 and a same-size BERT with sdpa.

    python -m benchmarks.run            # the full run behind README.md's Performance tables (about 25 min on 2 cores)
    python -m benchmarks.run --quick    # about a minute: small shapes, one repeat, no memory sweep
    python -m benchmarks.run --device cuda --dtype bfloat16   # on a GPU (memory: allocated, capped per process)
    python -m benchmarks.run --no-eager --layers 2 --cases train-4x128 train-2x512 --processes 5   # 5 processes
    python -m benchmarks.run --no-eager --layers 2 --no-memory --threads 2 --processes 3 --dtype bfloat16

Everything is DeBERTa-v3-base-shaped (hidden 768, 12 heads, 3072 intermediate, 256 position buckets, random
weights, float32 unless --dtype). Our model is loaded from transformers' `DebertaV2Model` checkpoint folder, so both run the
same weights. Models run interleaved (one call of each, repeated), and the table reports medians and the
ratio of each to BERT-sdpa and to transformers' DeBERTa, measured in the same run. Peak memory is measured in a
fresh subprocess per (model, length) under an address-space cap, forward only, 1 layer, batch 1
(flex_attention: compile included).
Writes benchmarks/results/benchmark.json and benchmarks/results/memory.png.

On a shared 2-core host a ratio moves from one process to the next by more than the gaps to the targets do.
`--processes N` runs the timings in N fresh processes, one after another, and prints each ratio's median over them
with its range, against the targets (`targets_for`: float32's, or in bfloat16 on a processor with AMX issue 30's),
with the number of processes at or under each (benchmarks/results/processes.json keeps every process's report).
`--dtype bfloat16` casts the models for inference and runs training steps under CPU autocast (float32 weights).
Every run appends one record to benchmarks/records/run.jsonl (processor and extensions, versions, commit, command,
each process's times, the ratios and their targets), from which the manual's tables and figures are generated.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

import disentangled
from benchmarks import machine
from benchmarks.records import RECORDS, append_record

RESULTS = Path(__file__).parent / "results"
V3_BASE = dict(
    vocab_size=32000,  # the embedding lookup costs nothing; a smaller table keeps four models in memory
    hidden_size=768,
    num_attention_heads=12,
    intermediate_size=3072,
    relative_attention=True,
    max_relative_positions=-1,
    position_buckets=256,
    norm_rel_ebd="layer_norm",
    share_att_key=True,
    pos_att_type="p2c|c2p",
    position_biased_input=False,
    type_vocab_size=0,
    layer_norm_eps=1e-7,
    max_position_embeddings=512,
    hidden_act="gelu",
    pad_token_id=0,
)


def build_bert(layers: int) -> transformers.BertModel:
    """A BERT of the same size, plain attention through sdpa, positions for 32k tokens."""
    config = transformers.BertConfig(
        vocab_size=V3_BASE["vocab_size"],
        hidden_size=768,
        num_hidden_layers=layers,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=4096 * 8 + 2,
    )
    config._attn_implementation = "sdpa"
    bert = transformers.BertModel(config, add_pooling_layer=False)
    assert bert.config._attn_implementation == "sdpa"
    return bert


def build_models(
    layers: int, folder: Path, backends: list[str], training: bool, device="cpu", dtype=torch.float32
) -> dict[str, torch.nn.Module]:
    """transformers' DebertaV2Model, ours on its weights (one per backend), and a same-size BertModel with sdpa.

    For inference the models are cast to `dtype`; for training in a lower precision they keep float32 weights and
    `time_once` runs the step under autocast to `dtype`, as mixed-precision training does."""
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(**V3_BASE, num_hidden_layers=layers)
    reference = transformers.DebertaV2Model(config)
    reference.save_pretrained(folder)
    transformers.logging.set_verbosity_error()  # "a model of type deberta-v2 to instantiate ... disentangled" is expected
    ours = disentangled.DisentangledModel.from_pretrained(folder, attn_implementation="eager")
    bert = build_bert(layers)
    models = {}
    for backend in backends:
        model = ours if backend == backends[-1] else copy.deepcopy(ours)
        model.set_attn_implementation(backend)
        models[f"ours-{backend}"] = model
    models["transformers-deberta"] = reference
    models["bert-sdpa"] = bert
    for model in models.values():
        model.train(training).to(device=device, dtype=torch.float32 if training else dtype)
    return models


def inputs_for(batch: int, length: int, padded: bool, device="cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    input_ids = torch.randint(1, V3_BASE["vocab_size"], (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    if padded and batch > 1:  # the last row is 3/4 long, so masks are exercised
        attention_mask[-1, (3 * length) // 4 :] = 0
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(model, inputs, training: bool, dtype: torch.dtype = torch.float32) -> float:
    """Seconds of one call: a forward in inference mode, or a training step (under autocast to `dtype` when that is
    not float32; the model's weights are float32 then)."""
    device = inputs["input_ids"].device
    synchronize(device)
    start = time.perf_counter()
    if training:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**inputs).last_hidden_state.float().square().mean()
        loss.backward()
    else:
        with torch.inference_mode():
            model(**inputs)
    synchronize(device)
    return time.perf_counter() - start


def timing_case(
    models, batch: int, length: int, training: bool, repeats: int, warmup: int, device="cpu", dtype=torch.float32
) -> dict[str, float]:
    """Median seconds per call for every model, interleaved: warm-up calls, then `repeats` rounds of one call each."""
    inputs = inputs_for(batch, length, padded=True, device=device)
    times = {name: [] for name in models}
    for _ in range(warmup):
        for model in models.values():
            time_once(model, inputs, training, dtype)
    for _ in range(repeats):
        for name, model in models.items():
            times[name].append(time_once(model, inputs, training, dtype))
        gc.collect()
    return {name: statistics.median(values) for name, values in times.items()}


def current_rss_gib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def memory_child(model_name: str, length: int, folder: str, device: str, dtype: torch.dtype, cap_gib: float) -> None:
    """Subprocess: load one 1-layer model, run one forward, print JSON with the peak memory: resident memory on
    the CPU, allocated accelerator memory on CUDA (capped there with the per-process memory fraction)."""
    transformers.logging.set_verbosity_error()
    if model_name == "transformers-deberta":
        model = transformers.DebertaV2Model.from_pretrained(folder)
    elif model_name == "bert-sdpa":
        model = build_bert(1)
    else:
        backend = model_name.removeprefix("ours-")
        model = disentangled.DisentangledModel.from_pretrained(folder, attn_implementation=backend)
    device = torch.device(device)
    model.eval().to(device=device, dtype=dtype)
    gc.collect()
    inputs = inputs_for(1, length, padded=False, device=device)
    cuda = device.type == "cuda"
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)
        torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device) / 2**30 if cuda else current_rss_gib()
    start = time.perf_counter()
    with torch.inference_mode():
        model(**inputs)
    synchronize(device)
    seconds = time.perf_counter() - start
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB
    print(json.dumps({"peak_gib": peak, "baseline_gib": baseline, "seconds": seconds}))


def memory_case(
    model_name: str, length: int, cap_gib: float, folder: Path, timeout: float, device: str, dtype: str
) -> dict:
    command = [sys.executable, "-m", "benchmarks.run", "--memory-child", model_name, str(length), str(folder)]
    command += ["--device", device, "--dtype", dtype, "--memory-cap-gib", str(cap_gib)]

    def cap():  # on the CPU, an address-space cap; CUDA reserves address space, and is capped in the child
        if not device.startswith("cuda"):
            limit = int(cap_gib * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    try:
        done = subprocess.run(command, capture_output=True, text=True, preexec_fn=cap, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"over {timeout:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"ok": False, "why": tail[:160]}
    return {"ok": True, **json.loads(done.stdout.strip().splitlines()[-1])}


def markdown_timing_table(rows: list[dict], names: list[str]) -> str:
    lines = [
        "| case | " + " | ".join(names) + " | ours-sdpa / bert | transformers / ours-sdpa |",
        "|---" * (len(names) + 3) + "|",
    ]
    for row in rows:
        cells = [f"{row['times'][n]:.3f} s" if n in row["times"] else "-" for n in names]
        ours, bert, theirs = row["times"]["ours-sdpa"], row["times"]["bert-sdpa"], row["times"]["transformers-deberta"]
        lines.append(f"| {row['case']} | " + " | ".join(cells) + f" | {ours / bert:.2f} | {theirs / ours:.2f}x |")
    return "\n".join(lines)


def markdown_memory_table(memory: dict[str, dict[int, dict]], lengths: list[int]) -> str:
    lines = ["| model | " + " | ".join(f"{n:,}" for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for name, by_length in memory.items():
        cells = []
        for n in lengths:
            result = by_length.get(n)
            if result is None:
                cells.append("-")
            elif result["ok"]:
                cells.append(f"{result['peak_gib'] - result['baseline_gib']:.2f} GiB ({result['seconds']:.1f} s)")
            else:
                cells.append("fails")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(memory: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for name, by_length in memory.items():
        points = sorted((n, r["peak_gib"] - r["baseline_gib"]) for n, r in by_length.items() if r["ok"])
        if points:
            axis.plot(*zip(*points), marker="o", label=name)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("tokens (batch 1, 1 layer)")
    axis.set_ylabel("peak memory over the loaded model (GiB)")
    axis.legend()
    axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# Ours-sdpa / BERT-sdpa at most (issue 14), by (mode, batch, length), for the DeBERTa-v3-base shape in float32
TARGETS = {
    ("infer", 8, 128): 1.10,
    ("infer", 4, 512): 1.20,
    ("infer", 1, 2048): 1.40,
    ("infer", 1, 4096): 1.60,
    ("train", 4, 128): 1.10,
    ("train", 2, 512): 1.15,
}
# In bfloat16 on a processor with AMX (issue 30): inference on the model cast, training under CPU autocast
BFLOAT16_AMX_TARGETS = {
    ("infer", 8, 128): 1.25,
    ("infer", 4, 512): 1.35,
    ("infer", 1, 2048): 1.60,
    ("train", 4, 128): 1.10,
    ("train", 2, 512): 1.10,
}


def targets_for(device: str, dtype: str) -> dict:
    """The targets of a run: float32's on any CPU, and for bfloat16 where the CPU has no AMX; bfloat16's with AMX;
    none on an accelerator or in float16."""
    if device != "cpu" or dtype == "float16":
        return {}
    if dtype == "bfloat16" and "amx_bf16" in machine.processor()[1]:
        return BFLOAT16_AMX_TARGETS
    return TARGETS


def ratio_summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def record_figures(args: argparse.Namespace, rows: list[dict], repeats: int, memory: dict | None = None) -> dict:
    """The figures of a `run` record: per case, each process's median times and the ratios' median and range.
    `rows` is [{"case", "times": [one {model: seconds} per process]}] in case order."""
    targets = targets_for(args.device, args.dtype)
    cases = []
    for row in rows:
        mode, shape = row["case"].split()[:2]
        batch, length = (int(part) for part in shape.split("x"))
        times = row["times"]
        cases.append(
            {
                "case": f"{mode} {shape}",
                "mode": mode,
                "batch": batch,
                "length": length,
                "layers": row["layers"],
                "times": times,
                "ours_over_bert": ratio_summary([t["ours-sdpa"] / t["bert-sdpa"] for t in times]),
                "transformers_over_ours": ratio_summary([t["transformers-deberta"] / t["ours-sdpa"] for t in times]),
                "target": targets.get((mode, batch, length)),
            }
        )
    figures = {
        "device": args.device,
        "dtype": args.dtype,
        "layers": args.layers or 12,
        "repeats": repeats,
        "processes": args.processes,
        "cases": cases,
    }
    if memory:
        figures["memory"] = {
            name: {str(length): result for length, result in by_length.items()} for name, by_length in memory.items()
        }
    return figures


def case_name(training: bool, batch: int, length: int) -> str:
    """The `--cases` name of a case: infer-8x128, train-2x512."""
    return f"{'train' if training else 'infer'}-{batch}x{length}"


def in_fresh_processes(module: str, arguments: list[str], count: int, read) -> list:
    """`python -m module *arguments PATH` in `count` fresh processes, one after another, from the repository root,
    each with a path of its own as the value of the option `arguments` ends with; returns `read(PATH)` of each."""
    root = Path(__file__).resolve().parent.parent
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for number in range(count):
            path = Path(folder) / f"process-{number}"
            done = subprocess.run([sys.executable, "-m", module, *arguments, str(path)], cwd=root)
            if done.returncode != 0:
                raise SystemExit(f"process {number + 1} of {count} failed (exit {done.returncode})")
            results.append(read(path))
    return results


def print_ratio_medians(runs: list[dict], references: tuple[str, str], case_label: str = "") -> None:
    """Per case, a table of each name's ratio to each of `references` in `runs` ([{case: {name: value}}], one per
    process, ratios taken within a process): the median over the processes and the range."""
    for case in runs[0]:
        heading = " | ".join(f"/ {reference} | range" for reference in references)
        print(f"\n| {case_label}{case} | {heading} |\n|---|---|---|---|---|")
        for name in runs[0][case]:
            cells = []
            for reference in references:
                values = [run[case][name] / run[case][reference] for run in runs]
                cells.append(f"{statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f}")
            print(f"| {name} | {' | '.join(cells)} |")


def _only_report(folder: Path) -> dict:
    (written,) = folder.glob("*.json")
    return json.loads(written.read_text())


def in_processes(args: argparse.Namespace, argv: list[str]) -> None:
    """The timings in `args.processes` fresh processes, one after another; per case, the median over the processes
    of ours-sdpa / BERT-sdpa and of transformers / ours-sdpa, each with its range, and the target where there is
    one (on the CPU in float32), with how many processes measured at or under it."""
    # the same arguments; argparse keeps the last of a repeated option, so these override the caller's
    child = [*argv, "--processes", "1", "--no-memory", "--no-record", "--out"]
    reports = in_fresh_processes("benchmarks.run", child, args.processes, _only_report)
    lines = [
        f"`python -m benchmarks.run {' '.join(argv)}`: {args.processes} processes, one after another, on "
        f"{reports[0]['machine']}.",
        f"Processor: {reports[0]['processor']}",
        "",
        "Median over the processes (lowest-highest):",
        "",
        "| case | ours-sdpa / bert | transformers / ours-sdpa | target | at or under it |",
        "|---|---|---|---|---|",
    ]
    for index, row in enumerate(reports[0]["inference"] + reports[0]["training"]):
        rows = [(report["inference"] + report["training"])[index]["times"] for report in reports]
        ours = [times["ours-sdpa"] / times["bert-sdpa"] for times in rows]
        theirs = [times["transformers-deberta"] / times["ours-sdpa"] for times in rows]
        mode, shape = row["case"].split()[:2]
        batch, length = (int(part) for part in shape.split("x"))
        target = targets_for(args.device, args.dtype).get((mode, batch, length))
        met = f"{sum(ratio <= target for ratio in ours)} of {len(ours)}" if target else "-"
        lines.append(
            f"| {row['case']} | {statistics.median(ours):.2f} ({min(ours):.2f}-{max(ours):.2f}) "
            f"| {statistics.median(theirs):.2f}x ({min(theirs):.2f}-{max(theirs):.2f}) "
            f"| {f'{target:.2f}' if target else '-'} | {met} |"
        )
    markdown = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "processes.json").write_text(json.dumps({"markdown": markdown, "processes": reports}, indent=2))
    print(markdown)
    if not args.no_record:
        rows = []
        for index, row in enumerate(reports[0]["inference"] + reports[0]["training"]):
            times = [(report["inference"] + report["training"])[index]["times"] for report in reports]
            rows.append({"case": row["case"], "layers": row["layers"], "times": times})
        append_record("run", record_figures(args, rows, reports[0]["repeats"]), folder=args.records)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a one-minute version: small shapes, no memory sweep")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--flex", action="store_true", help="also time compiled flex_attention (compiles per shape)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-eager", action="store_true", help="leave our eager reference out of the timings")
    parser.add_argument("--layers", type=int, default=None, help="layers for every timing case (default 12; 2 at 4096)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--memory-cap-gib", type=float, default=16.0)
    parser.add_argument("--memory-lengths", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--memory-models", nargs="*", default=None)
    parser.add_argument("--memory-timeout", type=float, default=900.0)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda where a GPU is available")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cases", nargs="+", metavar="CASE", help="time only these: infer-8x128, train-2x512, ...")
    parser.add_argument("--processes", type=int, default=1, help="time in this many fresh processes (see above)")
    parser.add_argument("--no-record", action="store_true", help="append no record to benchmarks/records/run.jsonl")
    parser.add_argument("--records", type=Path, default=RECORDS, help=argparse.SUPPRESS)  # the tests' own folder
    args = parser.parse_args(argv)
    if args.processes < 1:
        raise SystemExit(f"--processes {args.processes}: give 1 or more")
    if args.threads:  # before the processes are started: the record says how many threads they ran with
        torch.set_num_threads(args.threads)
    if args.processes > 1:
        if args.no_timing:
            raise SystemExit("--processes repeats the timings: drop --no-timing")
        in_processes(args, argv if argv is not None else sys.argv[1:])
        return
    dtype = getattr(torch, args.dtype)
    if args.memory_child:
        name, length, folder = args.memory_child
        memory_child(name, int(length), folder, args.device, dtype, args.memory_cap_gib)
        return

    torch.manual_seed(0)
    repeats = args.repeats or (1 if args.quick else 5)
    if args.quick:
        inference_cases = [(12, 8, 128), (12, 2, 512)]
        training_cases = [(12, 2, 128)]
    else:
        inference_cases = [(12, 8, 128), (12, 4, 512), (12, 1, 2048), (2, 1, 4096)]
        training_cases = [(12, 4, 128), (12, 2, 512)]
    if args.layers:
        inference_cases = [(args.layers, b, n) for _, b, n in inference_cases]
        training_cases = [(args.layers, b, n) for _, b, n in training_cases]
    if args.cases:
        known = [case_name(False, b, n) for _, b, n in inference_cases]
        known += [case_name(True, b, n) for _, b, n in training_cases]
        unknown = sorted(set(args.cases) - set(known))
        if unknown:
            raise SystemExit(f"--cases {' '.join(unknown)}: not among this run's cases ({', '.join(known)})")
        inference_cases = [case for case in inference_cases if case_name(False, *case[1:]) in args.cases]
        training_cases = [case for case in training_cases if case_name(True, *case[1:]) in args.cases]
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "processor": machine.describe(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
        f" ({torch.get_num_threads()} threads), transformers {transformers.__version__}, {args.dtype}"
        + (f", {torch.cuda.get_device_name(args.device)}" if args.device.startswith("cuda") else ""),
        "repeats": repeats,
        "inference": [],
        "training": [],
        "memory": {},
    }
    print(f"Processor: {report['processor']}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        if not args.no_timing:
            backends = ([] if args.no_eager else ["eager"]) + (["flex_attention"] if args.flex else []) + ["sdpa"]
            for training, cases in ((False, inference_cases), (True, training_cases)):
                for layers, batch, length in cases:
                    names = [f"ours-{b}" for b in backends if not (training and b == "flex_attention")]
                    backends_here = [n.removeprefix("ours-") for n in names]
                    models = build_models(layers, folder / f"l{layers}", backends_here, training, args.device, dtype)
                    times = timing_case(models, batch, length, training, repeats, 1, args.device, dtype)
                    row = {
                        "case": f"{'train' if training else 'infer'} {batch}x{length} ({layers} layers)",
                        "layers": layers,
                        "times": times,
                    }
                    report["training" if training else "inference"].append(row)
                    print(row, flush=True)
                    del models
                    gc.collect()
        if not args.quick and not args.no_memory:
            model_names = args.memory_models or [
                "ours-sdpa",
                "ours-flex_attention",
                "transformers-deberta",
                "bert-sdpa",
            ]
            build_models(1, folder / "memory", [], False)  # the checkpoint folder the children load
            for name in model_names:
                report["memory"][name] = {}
                for length in args.memory_lengths:
                    result = memory_case(
                        name,
                        length,
                        args.memory_cap_gib,
                        folder / "memory",
                        args.memory_timeout,
                        args.device,
                        args.dtype,
                    )
                    report["memory"][name][length] = result
                    print(name, length, result, flush=True)
                    if not result["ok"]:
                        break  # longer inputs fail too
    names = (
        ([] if args.no_eager else ["ours-eager"])
        + (["ours-flex_attention"] if args.flex else [])
        + ["ours-sdpa", "transformers-deberta", "bert-sdpa"]
    )
    text = [
        f"`{report['command']}` on {report['machine']}; median of {repeats} interleaved runs.",
        f"Processor: {report['processor']}",
        "",
    ]
    if report["inference"] or report["training"]:
        text += [markdown_timing_table(report["inference"] + report["training"], names), ""]
    if report["memory"]:
        text += [
            f"Peak memory over the loaded model, 1 layer, batch 1, forward, cap {args.memory_cap_gib:g} GiB "
            "(seconds for the forward in brackets):",
            "",
            markdown_memory_table(report["memory"], args.memory_lengths),
            "",
        ]
        plot(report["memory"], args.out / "memory.png")
    report["markdown"] = "\n".join(text)
    name = (
        "benchmark-quick" if args.quick else "memory" if args.no_timing else "timing" if args.no_memory else "benchmark"
    )
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2))
    print(report["markdown"])
    if not args.no_record and (report["inference"] or report["training"] or report["memory"]):
        rows = [{**row, "times": [row["times"]]} for row in report["inference"] + report["training"]]
        append_record("run", record_figures(args, rows, repeats, report["memory"]), folder=args.records)


if __name__ == "__main__":
    main()
