"""ONNX Runtime on the CPU: our `export-onnx` graph against BERT of the same size, exported and optimized as users do.

    python -m benchmarks.onnx_runtime                       # 2 layers, 8x128, 4x512, 1x2048; memory at 2,048 / 4,096
    python -m benchmarks.onnx_runtime --quick               # a smoke test: 1 layer, 8x128, one round, no memory
    python -m benchmarks.onnx_runtime --per-request         # serving latency: 12 layers, 1x128, 1x512, 8x128

DeBERTa-v3-base's shape (random weights, `--layers` layers), float32, `--threads` threads for torch and onnxruntime
(thread spinning off: the sessions take turns). Per case, the minimum of `--repeats` interleaved rounds, one call of
each per round (padded batches: the last row is 3/4 long), of

- `ours-pytorch`: our model in PyTorch (sdpa);
- `ours-onnx-before`: `export-onnx --attn-implementation eager --portable`, the graph export-onnx wrote before the
  fused attention (eager attention: a dense bias gathered with an [L, L] index);
- `ours-onnx`: `export-onnx` as it is now (ONNX Runtime's MultiHeadAttention, the position terms made by products by
  distance and relative shifts);
- `ours-onnx-kernel`: `export-onnx --kernel`, each layer's attention our compiled `disentangled::Attention` operator
  (`serving/ort_operator.py`: the position terms made inside the tile), its library loaded into the session;
- `deberta-onnx`: transformers' DebertaV2Model on the same weights, exported by torch.onnx.export (torch's current
  exporter; its older TorchScript one where that fails);
- `bert-onnx`: a same-size BertModel (sdpa) exported by both of torch's exporters, the faster of the two;
- `bert-onnx-optimized`: both of those after onnxruntime's transformer optimizer (`optimize_model`, model type
  "bert"), the faster.

Every ONNX graph is checked against its PyTorch model on the first case before timing. Peak memory: a fresh process
per graph and length (1x2048, 1x4096) builds the session, runs one call and reads its peak resident set (VmHWM),
under an address-space cap; `rss_after_load` is the resident set before the call. Writes
benchmarks/results/onnx_runtime.json and appends a record to benchmarks/records/onnx_runtime.jsonl (not with --quick).

`--per-request` times what one request costs a server instead (`--layers` 12 by default: a v3-base classifier's
encoder; its head adds one 768x768 product per row): batch 1 at 128 and at 512 tokens and batch 8 at 128 (padded),
on 1 thread and on all the cores this process may use (`--thread-counts`), of `ours-onnx-kernel`, `bert-onnx-optimized`
and `ours-pytorch` as above, and of the int8 graphs `ours-onnx-kernel-int8` and `bert-onnx-int8`, both made by
`export-onnx --quantize int8`'s quantization (`onnx_export.quantize_int8`: dynamic, every product against a weight),
BERT's from its optimized graphs (from its plain graph where the quantizer takes neither). Where a column has several
candidate graphs, the fastest of 3 calls at the first case keeps its place. Per case and thread count, the minimum and
the median of `--repeats` interleaved rounds (one call of each per round, after a warm-up call). The float32 graphs
are checked against PyTorch first (max |diff| recorded; the int8 graphs' difference is recorded too, not checked).
Writes benchmarks/results/onnx_runtime_latency.json and appends a record to
benchmarks/records/onnx_runtime_latency.jsonl (not with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers

from benchmarks import machine, records
from benchmarks.run import build_models, inputs_for
from disentangled.serving import onnx_export, ort_operator

RESULTS = Path(__file__).parent / "results"
CASES = [(8, 128), (4, 512), (1, 2048)]
LATENCY_CASES = [(1, 128), (1, 512), (8, 128)]
LATENCY_COLUMNS = ["ours-onnx-kernel", "bert-onnx-optimized", "ours-pytorch", "ours-onnx-kernel-int8", "bert-onnx-int8"]
MEMORY_LENGTHS = [2048, 4096]
MEMORY_CAP_GIB = 16
CHECK_TOLERANCE = 1e-3  # float32 graphs of 2 layers: 1e-6 to 1e-5 expected
COLUMNS = [
    "ours-pytorch",
    "ours-onnx-before",
    "ours-onnx",
    "ours-onnx-kernel",
    "deberta-onnx",
    "bert-onnx",
    "bert-onnx-optimized",
]


class Hidden(torch.nn.Module):
    """A model with named inputs and its last hidden state as the one output, for torch.onnx.export."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def export_torch(model: torch.nn.Module, path: Path, dynamo: bool) -> None:
    """torch.onnx.export as a user calls it: dynamic batch and sequence axes, opset 18 (17 for TorchScript)."""
    ids = torch.ones(2, 16, dtype=torch.long)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0  # a padded row: an all-ones example lets the exporter drop the mask from the graph
    names = ["input_ids", "attention_mask"]
    with warnings.catch_warnings(), onnx_export.quiet_exporter():
        warnings.simplefilter("ignore")
        if dynamo:
            axes = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
            program = torch.onnx.export(
                Hidden(model).eval(),
                (ids, mask),
                dynamo=True,
                input_names=names,
                output_names=["last_hidden_state"],
                dynamic_shapes={"input_ids": axes, "attention_mask": axes},
                opset_version=18,
            )
            program.save(str(path))
        else:
            torch.onnx.export(
                Hidden(model).eval(),
                (ids, mask),
                str(path),
                dynamo=False,
                input_names=names,
                output_names=["last_hidden_state"],
                dynamic_axes={name: {0: "batch", 1: "sequence"} for name in names},
                opset_version=17,
            )


def optimize(path: Path, output: Path, hidden_size: int, heads: int) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    with onnx_export.quiet_exporter():
        optimize_model(str(path), model_type="bert", num_heads=heads, hidden_size=hidden_size).save_model_to_file(
            str(output)
        )


def prepare(layers: int, folder: Path) -> tuple[dict, dict[str, list[Path]]]:
    """The PyTorch models and, per column, the candidate ONNX files (the column keeps its fastest)."""
    models = build_models(layers, folder / "checkpoint", ["sdpa"], training=False)
    ours, deberta, bert = models["ours-sdpa"], models["transformers-deberta"].eval(), models["bert-sdpa"].eval()
    graphs: dict[str, list[Path]] = {name: [] for name in COLUMNS[1:]}
    before, now = folder / "ours-before.onnx", folder / "ours.onnx"
    ours.set_attn_implementation("eager")
    onnx_export.export(ours, "base", before, portable=True)
    ours.set_attn_implementation("sdpa")
    onnx_export.lean_graph(before)
    onnx_export.export(ours, "base", now)
    onnx_export.lean_graph(now, fuse=True)  # as export-onnx writes it
    graphs["ours-onnx-before"], graphs["ours-onnx"] = [before], [now]
    if ort_operator.why_unavailable() is None:
        kernel = folder / "ours-kernel.onnx"
        onnx_export.export(ours, "base", kernel, kernel=True)
        onnx_export.lean_graph(kernel, fuse=True)
        graphs["ours-onnx-kernel"] = [kernel]
    else:
        print(f"ours-onnx-kernel: not timed ({ort_operator.why_unavailable()})")
        del graphs["ours-onnx-kernel"]
    for dynamo in (True, False):
        path = folder / f"deberta-{'dynamo' if dynamo else 'torchscript'}.onnx"
        try:
            export_torch(deberta, path, dynamo)
        except Exception as error:  # noqa: BLE001  (an exporter that cannot take the model is a result too)
            print(f"transformers' DeBERTa, {'dynamo' if dynamo else 'TorchScript'} exporter: failed ({error})")
            continue
        graphs["deberta-onnx"].append(path)
        break
    for dynamo in (True, False):
        kind = "dynamo" if dynamo else "torchscript"
        path, optimized = folder / f"bert-{kind}.onnx", folder / f"bert-{kind}-optimized.onnx"
        export_torch(bert, path, dynamo)
        graphs["bert-onnx"].append(path)
        optimize(path, optimized, bert.config.hidden_size, bert.config.num_attention_heads)
        graphs["bert-onnx-optimized"].append(optimized)
    pytorch = {"ours-pytorch": ours, "ours-onnx-before": ours, "ours-onnx": ours, "deberta-onnx": deberta}
    pytorch["ours-onnx-kernel"] = ours
    pytorch.update({"bert-onnx": bert, "bert-onnx-optimized": bert})
    return pytorch, graphs


def check(graph: Path, model: torch.nn.Module, inputs: dict, threads: int) -> float:
    """Largest |onnxruntime - PyTorch| over the real tokens."""
    session = onnx_export.session(graph, threads, spinning=False)
    (actual,) = session.run(None, {name: value.numpy() for name, value in inputs.items()})
    with torch.inference_mode():
        expected = model(**inputs).last_hidden_state
    kept = inputs["attention_mask"].bool()
    return (torch.from_numpy(actual) - expected)[kept].abs().max().item()


def timing(pytorch: dict, graphs: dict, repeats: int, threads: int, cases: list) -> tuple[list[dict], dict]:
    runners = {"ours-pytorch": None}
    sessions = {path: onnx_export.session(path, threads, spinning=False) for paths in graphs.values() for path in paths}
    ours = pytorch["ours-pytorch"]

    def call(path, feeds, inputs):
        if path is None:
            with torch.inference_mode():
                return ours(**inputs)
        return sessions[path].run(None, feeds)

    candidates = [None] + list(sessions)
    differences = {}
    rows = []
    for batch, length in cases:
        inputs = inputs_for(batch, length, padded=True)
        feeds = {name: value.numpy() for name, value in inputs.items()}
        if not differences:
            differences = {
                str(path.name): check(path, pytorch[name], inputs, threads)
                for name, paths in graphs.items()
                for path in paths
            }
            print("max |onnxruntime - PyTorch| at real tokens:", differences, flush=True)
            wrong = [path for path in candidates[1:] if not differences[path.name] <= CHECK_TOLERANCE]
            for name in graphs:  # a graph that does not compute its model is not timed
                graphs[name] = [path for path in graphs[name] if path not in wrong] or graphs[name]
            candidates = [None] + [path for paths in graphs.values() for path in paths]
        for path in candidates:  # warm-up
            call(path, feeds, inputs)
        times = {path: [] for path in candidates}
        for _ in range(repeats):
            for path in candidates:
                start = time.perf_counter()
                call(path, feeds, inputs)
                times[path].append(time.perf_counter() - start)
        best = {path: min(values) for path, values in times.items()}
        row = {"case": f"{batch}x{length}", "times": {"ours-pytorch": best[None]}, "graphs": {}}
        for name, paths in graphs.items():
            fastest = min(paths, key=lambda path: best[path])
            row["times"][name], row["graphs"][name] = best[fastest], fastest.name
        bert = min(row["times"]["bert-onnx"], row["times"]["bert-onnx-optimized"])
        row["ratio_ours_onnx_to_bert"] = row["times"]["ours-onnx"] / bert
        row["ratio_before_to_bert"] = row["times"]["ours-onnx-before"] / bert
        if "ours-onnx-kernel" in row["times"]:
            row["ratio_kernel_to_bert"] = row["times"]["ours-onnx-kernel"] / bert
        print(row, flush=True)
        rows.append(row)
    del runners
    return rows, differences


def prepare_latency(layers: int, folder: Path) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, list[Path]]]:
    """Our model and BERT in PyTorch, and per ONNX column of `LATENCY_COLUMNS` its candidate graphs."""
    why = ort_operator.why_unavailable()
    if why is not None:
        raise SystemExit(f"--per-request times the --kernel graph, which cannot run here: {why}")
    models = build_models(layers, folder / "checkpoint", ["sdpa"], training=False)
    ours, bert = models["ours-sdpa"], models["bert-sdpa"].eval()
    kernel, kernel_int8 = folder / "ours-kernel.onnx", folder / "ours-kernel-int8.onnx"
    onnx_export.export(ours, "base", kernel, kernel=True)
    onnx_export.lean_graph(kernel, fuse=True)  # as export-onnx --kernel writes it
    onnx_export.quantize_int8(kernel, kernel_int8)  # as export-onnx --kernel --quantize int8 writes it
    graphs = {"ours-onnx-kernel": [kernel], "bert-onnx-optimized": [], "ours-onnx-kernel-int8": [kernel_int8]}
    graphs["bert-onnx-int8"] = []
    for dynamo in (True, False):
        kind = "dynamo" if dynamo else "torchscript"
        path, optimized = folder / f"bert-{kind}.onnx", folder / f"bert-{kind}-optimized.onnx"
        export_torch(bert, path, dynamo)
        optimize(path, optimized, bert.config.hidden_size, bert.config.num_attention_heads)
        graphs["bert-onnx-optimized"].append(optimized)
        quantized = optimized.with_name(f"{optimized.stem}-int8.onnx")
        try:
            onnx_export.quantize_int8(optimized, quantized)
            graphs["bert-onnx-int8"].append(quantized)
        except RuntimeError as error:  # the quantizer's shape inference can stop at the optimizer's fused operators
            print(f"{optimized.name}: not quantized ({str(error)[:120]})")
    if not graphs["bert-onnx-int8"]:  # no optimized graph quantizes: BERT's plain graph, quantized the same way
        quantized = folder / "bert-dynamo-int8.onnx"
        onnx_export.quantize_int8(folder / "bert-dynamo.onnx", quantized)
        graphs["bert-onnx-int8"].append(quantized)
    return ours, bert, graphs


def latency(ours, bert, graphs: dict, cases: list, thread_counts: list[int], repeats: int) -> tuple[list, dict]:
    """Per thread count and case, the minimum and median seconds of each column over `repeats` interleaved rounds;
    and each graph's max |onnxruntime - PyTorch| at the real tokens of the first case."""
    rows, differences = [], {}
    for threads in thread_counts:
        torch.set_num_threads(threads)
        sessions = {
            path: onnx_export.session(path, threads, spinning=False) for paths in graphs.values() for path in paths
        }

        def call(column: str | Path, inputs: dict, feeds: dict, sessions: dict = sessions) -> None:
            if column == "ours-pytorch":
                with torch.inference_mode():
                    ours(**inputs)
            else:
                sessions[column].run(None, feeds)

        inputs = inputs_for(*cases[0], padded=True)
        feeds = {name: value.numpy() for name, value in inputs.items()}
        chosen = {}
        for name, paths in graphs.items():  # a column with several candidates keeps the fastest of 3 calls
            best = {path: min(timed(call, path, inputs, feeds) for _ in range(3)) for path in paths}
            chosen[name] = min(paths, key=best.get)
        if not differences:
            for name, path in chosen.items():
                differences[path.name] = check(path, bert if name.startswith("bert") else ours, inputs, threads)
            print("max |onnxruntime - PyTorch| at real tokens:", differences, flush=True)
            wrong = [path.name for name, path in chosen.items() if not name.endswith("int8")]
            wrong = [name for name in wrong if not differences[name] <= CHECK_TOLERANCE]
            if wrong:
                raise SystemExit(f"{', '.join(wrong)}: not the model's outputs (tolerance {CHECK_TOLERANCE})")
        columns = {name: chosen.get(name, name) for name in LATENCY_COLUMNS}  # ours-pytorch: its own name
        for batch, length in cases:
            inputs = inputs_for(batch, length, padded=True)
            feeds = {name: value.numpy() for name, value in inputs.items()}
            for column in columns.values():  # warm-up
                call(column, inputs, feeds)
            times = {name: [] for name in columns}
            for _ in range(repeats):
                for name, column in columns.items():
                    times[name].append(timed(call, column, inputs, feeds))
            row = {
                "case": f"{batch}x{length}",
                "threads": threads,
                "min": {name: min(values) for name, values in times.items()},
                "median": {name: statistics.median(values) for name, values in times.items()},
                "graphs": {name: path.name for name, path in chosen.items()},
            }
            print(row, flush=True)
            rows.append(row)
    return rows, differences


def timed(call, *arguments) -> float:
    start = time.perf_counter()
    call(*arguments)
    return time.perf_counter() - start


LATENCY_SHOWN = {
    "ours-onnx-kernel": "ours, --kernel graph",
    "bert-onnx-optimized": "BERT-base, optimized",
    "ours-pytorch": "ours in PyTorch",
    "ours-onnx-kernel-int8": "ours, --kernel graph",
    "bert-onnx-int8": "BERT-base",
}
LATENCY_RATIOS = {  # what the serving page divides: (numerator, denominator)
    "--kernel / BERT": ("ours-onnx-kernel", "bert-onnx-optimized"),
    "PyTorch / BERT": ("ours-pytorch", "bert-onnx-optimized"),
    "int8: --kernel / BERT": ("ours-onnx-kernel-int8", "bert-onnx-int8"),
}


def latency_markdown(figures: dict) -> str:
    """The serving page's latency tables, narrow enough for the page: float32 milliseconds, int8 milliseconds, and
    the ratios of the medians."""

    def table(columns: dict, cell) -> list[str]:
        """`columns`: header -> what `cell(row, what)` shows."""
        lines = ["| request | threads | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
        for row in figures["cases"]:
            cells = " | ".join(cell(row, what) for what in columns.values())
            lines.append(f"| {row['case']} | {row['threads']} | {cells} |")
        return lines

    def milliseconds(row: dict, name: str) -> str:
        return f"{row['median'][name] * 1000:,.1f} ({row['min'][name] * 1000:,.1f})"

    def ratio(row: dict, pair: tuple[str, str]) -> str:
        return f"{row['median'][pair[0]] / row['median'][pair[1]]:.2f}"

    float32 = {LATENCY_SHOWN[name]: name for name in LATENCY_COLUMNS[:3]}
    int8 = {LATENCY_SHOWN[name]: name for name in LATENCY_COLUMNS[3:]}
    of = f"median (fastest) of {figures['repeats']} calls"
    return "\n".join(
        [f"float32, ms per request, {of}:", "", *table(float32, milliseconds), "",
         f"int8, ms per request, {of}:", "", *table(int8, milliseconds), "",
         "Time over BERT-base's in ONNX Runtime, of the medians (below 1.00: ours is faster):", "",
         *table(LATENCY_RATIOS, ratio)]
    )  # fmt: skip


MEMORY_CHILD = """
import resource, sys, numpy
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[3]) << 30, int(sys.argv[3]) << 30))
import onnxruntime
def rss(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) / 2**20
options = onnxruntime.SessionOptions()
options.intra_op_num_threads = int(sys.argv[4])
if len(sys.argv) > 5:  # our operator's library (the kernel graph)
    options.register_custom_ops_library(sys.argv[5])
session = onnxruntime.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
length = int(sys.argv[2])
ids = numpy.random.default_rng(0).integers(1, 32000, (1, length)).astype(numpy.int64)
loaded = rss("VmRSS:")
session.run(None, {"input_ids": ids, "attention_mask": numpy.ones_like(ids)})
print(loaded, rss("VmHWM:"))
"""


def memory(graphs: dict, lengths: list[int], threads: int) -> dict:
    """Peak resident set (GiB) of a fresh process per graph and length: after loading, and over one call."""
    result = {}
    for name in ("ours-onnx-before", "ours-onnx", "ours-onnx-kernel", "deberta-onnx", "bert-onnx-optimized"):
        for path in graphs.get(name, [])[:1] if name != "bert-onnx-optimized" else graphs[name]:
            label = name if name != "bert-onnx-optimized" else f"{name} ({path.stem})"
            result[label] = {}
            for length in lengths:
                run = [sys.executable, "-c", MEMORY_CHILD, str(path), str(length), str(MEMORY_CAP_GIB), str(threads)]
                if name == "ours-onnx-kernel":
                    run.append(str(ort_operator.library_path()))
                done = subprocess.run(run, capture_output=True, text=True)
                if done.returncode == 0:
                    loaded, peak = map(float, done.stdout.split()[-2:])
                    result[label][length] = {"rss_after_load": loaded, "peak": peak}
                else:
                    result[label][length] = {"failed": done.stderr.strip().splitlines()[-1][:200]}
                print(label, length, result[label][length], flush=True)
    return result


# What the serving page calls each model: a reader's words, not the benchmark's keys
SHOWN = {
    "ours-pytorch": "ours in PyTorch",
    "ours-onnx-before": "ours, portable graph",
    "ours-onnx": "ours, default graph",
    "ours-onnx-kernel": "ours, --kernel graph",
    "deberta-onnx": "transformers' DeBERTa",
    "bert-onnx": "BERT",
    "bert-onnx-optimized": "BERT, optimized",
}
EXPORTERS = {"bert-dynamo-optimized": "torch's dynamo exporter", "bert-torchscript-optimized": "TorchScript exporter"}


def shown_label(label: str) -> str:
    """A memory row's label as the page shows it: 'bert-onnx-optimized (bert-dynamo-optimized)' -> 'BERT, optimized
    (torch's dynamo exporter)'."""
    name, _, stem = label.partition(" (")
    stem = stem.rstrip(")")
    return SHOWN.get(name, name) + (f" ({EXPORTERS.get(stem, stem)})" if stem else "")


def markdown(rows: list[dict], memory_figures: dict, layers: int) -> str:
    """The serving page's tables, narrow enough for the page: a row per model (ms per call, one column per case), a
    row per graph of ours (its time over the faster BERT's), and peak memory."""
    columns = [name for name in COLUMNS if any(name in row["times"] for row in rows)]
    ratios = {"default graph": "ratio_ours_onnx_to_bert", "--kernel graph": "ratio_kernel_to_bert"}
    ratios["portable graph"] = "ratio_before_to_bert"
    ratios = {label: key for label, key in ratios.items() if all(key in row for row in rows)}
    header = " | ".join(row["case"] for row in rows)
    lines = [f"| {layers} layers, ms per call | {header} |", "|---" * (len(rows) + 1) + "|"]
    for name in columns:
        cells = [f"{row['times'][name] * 1000:,.0f}" if name in row["times"] else "-" for row in rows]
        lines.append(f"| {SHOWN[name]} | " + " | ".join(cells) + " |")
    lines += ["", f"| ours over the faster BERT | {header} |", "|---" * (len(rows) + 1) + "|"]
    for label, key in ratios.items():
        lines.append(f"| {label} | " + " | ".join(f"{row[key]:.2f}" for row in rows) + " |")
    if memory_figures:
        lengths = sorted({length for figures in memory_figures.values() for length in figures})
        lines += ["", "| graph | " + " | ".join(f"peak GiB at 1x{n} (after load)" for n in lengths) + " |"]
        lines.append("|---" * (len(lengths) + 1) + "|")
        for label, figures in memory_figures.items():
            cells = []
            for length in lengths:
                figure = figures[length]
                cells.append(f"{figure['peak']:.2f} ({figure['rss_after_load']:.2f})" if "peak" in figure else "failed")
            lines.append(f"| {shown_label(label)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 layer, 8x128, one round, no memory")
    parser.add_argument(
        "--per-request",
        action="store_true",
        help="serving latency: 1x128, 1x512, 8x128 on 1 thread and all cores, --kernel graph, BERT, PyTorch, int8",
    )
    parser.add_argument(
        "--thread-counts",
        type=int,
        nargs="+",
        default=None,
        help="--per-request: thread counts (default 1 and the cores this process may use; 1 with --quick)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers of every model (default 2, 12 with --per-request; 1 with --quick)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; 1 with --quick)")
    parser.add_argument("--threads", type=int, default=2, help="threads for torch and onnxruntime (default 2)")
    parser.add_argument("--no-memory", action="store_true", help="timing only")
    parser.add_argument("--folder", type=Path, default=None, help="where the ONNX files go (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--records", type=Path, default=records.RECORDS, help="where onnx_runtime.jsonl gets a record")
    args = parser.parse_args(argv)
    if args.per_request:
        return main_per_request(args, argv)
    torch.set_num_threads(args.threads)
    layers = args.layers or (1 if args.quick else 2)
    repeats = args.repeats or (1 if args.quick else 5)
    cases = CASES[:1] if args.quick else CASES
    report = start_report(argv)
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.folder or Path(temporary)
        folder.mkdir(parents=True, exist_ok=True)
        pytorch, graphs = prepare(layers, folder)
        report["timing"], report["max_abs_diff"] = timing(pytorch, graphs, repeats, args.threads, cases)
        del pytorch
        no_memory = args.quick or args.no_memory
        report["memory_gib"] = {} if no_memory else memory(graphs, MEMORY_LENGTHS, args.threads)
    report["markdown"] = (
        f"`{report['command']}` on {report['machine']}, {report['versions']}; minimum of {repeats} interleaved "
        f"rounds, float32, {args.threads} threads.\n\n" + markdown(report["timing"], report["memory_gib"], layers)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ("onnx_runtime-quick.json" if args.quick else "onnx_runtime.json")).write_text(
        json.dumps(report, indent=2, default=str)
    )
    print(report["markdown"])
    if not args.quick:
        figures = {
            "layers": layers,
            "repeats": repeats,
            "onnx_threads": args.threads,
            "dtype": "float32",
            "versions": report["versions"],
            "timing": report["timing"],
            "max_abs_diff": report["max_abs_diff"],
            "memory_gib": report["memory_gib"],
        }
        record = records.append_record("onnx_runtime", figures, command=report["command"].split(), folder=args.records)
        print(f"appended a record to {args.records / 'onnx_runtime.jsonl'} (commit {record['commit']})")
    return report


def start_report(argv: list[str] | None) -> dict:
    """The command, the machine (printed) and the versions, which every report of this benchmark starts with."""
    transformers.logging.set_verbosity_error()
    import onnxruntime

    report = {
        "command": "python -m benchmarks.onnx_runtime " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine.describe(),
        "versions": f"onnxruntime {onnxruntime.__version__}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
    }
    print(report["machine"], flush=True)
    return report


def main_per_request(args: argparse.Namespace, argv: list[str] | None) -> dict:
    """`--per-request`: the serving latency of `latency`, its tables, and its record."""
    cores = len(os.sched_getaffinity(0))
    thread_counts = args.thread_counts or ([1] if args.quick else sorted({1, cores}))
    layers = args.layers or (1 if args.quick else 12)
    repeats = args.repeats or (1 if args.quick else 5)
    cases = LATENCY_CASES[:1] if args.quick else LATENCY_CASES
    report = start_report(argv)
    load = {"start": os.getloadavg()[0]}  # other work on the machine: it slows every path, unevenly
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.folder or Path(temporary)
        folder.mkdir(parents=True, exist_ok=True)
        ours, bert, graphs = prepare_latency(layers, folder)
        rows, differences = latency(ours, bert, graphs, cases, thread_counts, repeats)
    load["end"] = os.getloadavg()[0]
    torch.set_num_threads(max(thread_counts))  # the record's threads: the most this run used
    figures = {
        "per_request": True,
        "layers": layers,
        "repeats": repeats,
        "thread_counts": thread_counts,
        "cores": cores,
        "dtype": "float32 and int8",
        "spinning": False,
        "load_average": load,
        "versions": report["versions"],
        "cases": rows,
        "max_abs_diff": differences,
    }
    report.update(figures)
    report["markdown"] = latency_markdown(figures)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "onnx_runtime_latency-quick.json" if args.quick else "onnx_runtime_latency.json"
    (args.out / name).write_text(json.dumps(report, indent=2, default=str))
    print(report["markdown"])
    if not args.quick:
        command = report["command"].split()
        record = records.append_record("onnx_runtime_latency", figures, command=command, folder=args.records)
        print(f"appended a record to {args.records / 'onnx_runtime_latency.jsonl'} (commit {record['commit']})")
    return report


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
