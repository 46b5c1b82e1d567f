"""Speed and memory of our backends against transformers' DeBERTa-v2 and a same-size BERT with sdpa.

    python -m benchmarks.run            # the full run behind README.md's Performance tables (about 25 min on 2 cores)
    python -m benchmarks.run --quick    # about a minute: small shapes, one repeat, no memory sweep
    python -m benchmarks.run --device cuda --dtype bfloat16   # on a GPU: the GPU cases, with the anchors
    python -m benchmarks.run --no-eager --layers 2 --cases train-4x128 train-2x512 --processes 5   # 5 processes
    python -m benchmarks.run --no-eager --layers 2 --no-memory --threads 2 --processes 3 --dtype bfloat16
    python -m benchmarks.run --no-eager --layers 2 --no-memory --threads 2 --processes 3 --pytorch-path

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
`--pytorch-path` also times ours-sdpa with our compiled CPU kernels turned off (`native.turned_off`: the pure-PyTorch
path, what a processor without them runs), interleaved with the rest: before and after the kernels in one run.
DISENTANGLED_CPU_ISA chooses the kernels' instruction set (`native.instruction_set`, in every record).
Every run appends one record to benchmarks/records/run.jsonl (processor and extensions, versions, commit, command,
each process's times, the ratios and their targets), from which the manual's tables and figures are generated.

On `--device cuda` the cases are the GPU ones (inference at 32x512, 8x2048, 1x8192, 1x16384, 1x32768 with the model
cast to --dtype; training steps at 16x512 and 4x2048: float32 weights under autocast, AdamW step included), 12 layers,
median of 10 calls after 2 warm-up calls. Beside ours-sdpa (our eager reference is left out there: it writes
[B, H, L, L] tensors), BERT-sdpa and transformers' DeBERTa, the anchors FlashDeBERTa and disentangled-flash are timed
interleaved with them when installed (`benchmarks/gpu_anchors.py`, the gpu-bench extra), built on transformers'
DeBERTa's config and weights; one that is missing, refuses a shape or runs out of memory is left out of that case
with its reason in the record. Each call's peak allocated memory above what was allocated before it (the loaded
models and optimizer states) is recorded per model, in place of the memory sweep (which runs on CUDA only when
--memory-models names its models). `--budget-s` starts no new case once that many seconds have gone.
The record adds the GPU's name, the torch, CUDA, Triton and transformers versions and the anchors' versions.
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
from benchmarks import gpu_anchors, machine
from benchmarks.records import RECORDS, append_record
from disentangled import environment
from disentangled.configuration.configuration_disentangled import V3_FIELDS
from disentangled.modeling import native

RESULTS = Path(__file__).parent / "results"
V3_BASE = dict(
    vocab_size=32000,  # the embedding lookup costs nothing; a smaller table keeps four models in memory
    hidden_size=768,
    num_attention_heads=12,
    intermediate_size=3072,
    hidden_act="gelu",
    **V3_FIELDS,
    pad_token_id=0,
)


# A trained model's position table is one of the parameters a training step zeroes and updates: BERT-base's has 512
# rows; the training cases reach 2,048 tokens (on a GPU), inference 32k. A 32k-row table (100 MB of gradient to zero
# and scatter into) would slow BERT's training step by about 10% at 4x128 and flatter our ratio.
BERT_POSITIONS = {"training": 2048, "inference": 4096 * 8 + 2}


def build_bert(layers: int, positions: int = BERT_POSITIONS["inference"]) -> transformers.BertModel:
    """A BERT of the same size, plain attention through sdpa, with `positions` absolute positions."""
    config = transformers.BertConfig(
        vocab_size=V3_BASE["vocab_size"],
        hidden_size=768,
        num_hidden_layers=layers,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=positions,
    )
    config._attn_implementation = "sdpa"
    bert = transformers.BertModel(config, add_pooling_layer=False)
    assert bert.config._attn_implementation == "sdpa"
    return bert


PYTORCH_PATH = "ours-sdpa-pytorch"  # ours-sdpa with the compiled CPU kernels turned off (--pytorch-path)


def build_models(
    layers: int,
    folder: Path,
    backends: list[str],
    training: bool,
    device="cpu",
    dtype=torch.float32,
    pytorch_path: bool = False,
) -> dict[str, torch.nn.Module]:
    """transformers' DebertaV2Model, ours on its weights (one per backend, and with `pytorch_path` a second sdpa
    model that `measured_call` runs with the compiled CPU kernels off), and a same-size BertModel with sdpa.

    For inference the models are cast to `dtype`; for training in a lower precision they keep float32 weights and
    `time_once` runs the step under autocast to `dtype`, as mixed-precision training does."""
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(**V3_BASE, num_hidden_layers=layers)
    reference = transformers.DebertaV2Model(config)
    reference.save_pretrained(folder)
    transformers.logging.set_verbosity_error()  # "a model of type deberta-v2 to instantiate ... disentangled" is expected
    ours = disentangled.DisentangledModel.from_pretrained(folder, attn_implementation="eager")
    bert = build_bert(layers, BERT_POSITIONS["training" if training else "inference"])
    models = {}
    for backend in backends:
        model = ours if backend == backends[-1] else copy.deepcopy(ours)
        model.set_attn_implementation(backend)
        models[f"ours-{backend}"] = model
    if pytorch_path:
        models[PYTORCH_PATH] = copy.deepcopy(models["ours-sdpa"])
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


def time_once(model, inputs, training: bool, dtype: torch.dtype = torch.float32, optimizer=None) -> float:
    """Seconds of one call: a forward in inference mode, or a training step (under autocast to `dtype` when that is
    not float32; the model's weights are float32 then), with `optimizer`'s step when one is given."""
    device = inputs["input_ids"].device
    synchronize(device)
    start = time.perf_counter()
    if training:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**inputs).last_hidden_state.float().square().mean()
        loss.backward()
        if optimizer is not None:
            optimizer.step()
    else:
        with torch.inference_mode():
            model(**inputs)
    synchronize(device)
    return time.perf_counter() - start


def measured_call(model, inputs, training: bool, dtype: torch.dtype, optimizer, peaks: dict, name: str) -> float:
    """`time_once`, and on CUDA the call's peak allocated memory above what was allocated before it (the loaded
    models, optimizer states and, in training, no gradients: they are dropped first) into `peaks[name]`, in GiB."""
    device = inputs["input_ids"].device
    if name == PYTORCH_PATH:
        with native.turned_off():
            return time_once(model, inputs, training, dtype, optimizer)
    if device.type != "cuda":
        return time_once(model, inputs, training, dtype, optimizer)
    if training:
        model.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    seconds = time_once(model, inputs, training, dtype, optimizer)
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    peaks[name] = max(peaks.get(name, 0.0), peak)
    return seconds


def may_fail(name: str) -> bool:
    """Whether a model's error leaves it out of a case (transformers' DeBERTa out of memory, an anchor's refusal)
    rather than stopping the run (ours and BERT must run every case)."""
    return not (name.startswith("ours-") or name == "bert-sdpa")


def timing_case(
    models,
    batch: int,
    length: int,
    training: bool,
    repeats: int,
    warmup: int,
    device="cpu",
    dtype=torch.float32,
    optimizers: dict | None = None,
    found: dict | None = None,
) -> dict[str, float]:
    """Median seconds per call for every model, interleaved: warm-up calls, then `repeats` rounds of one call each.

    `optimizers` (name -> optimizer) adds a step to each training call. `found`, when given, receives "peak_gib"
    (name -> GiB, on CUDA) and "failed" (name -> why): a model other than ours and BERT that raises (out of memory,
    a refused shape) is left out of the case, its times dropped, and the others go on."""
    inputs = inputs_for(batch, length, padded=True, device=device)
    optimizers = dict(optimizers or {})
    peaks, failed = {}, {}
    models = dict(models)
    times = {name: [] for name in models}

    def call(name: str) -> float | None:
        try:
            return measured_call(models[name], inputs, training, dtype, optimizers.get(name), peaks, name)
        except Exception as error:  # whatever an anchor raises is reported, not fatal
            if not may_fail(name):
                raise
            failed[name] = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            print(f"{name} left out of {batch}x{length}: {failed[name]}", flush=True)
        for held in (models, times, peaks, optimizers):
            held.pop(name, None)
        release_memory(str(device))
        return None

    for _ in range(warmup):
        for name in list(models):
            call(name)
    peaks.clear()  # the warm-up's peaks include compiling and autotuning
    for _ in range(repeats):
        for name in list(models):
            seconds = call(name)
            if seconds is not None:
                times[name].append(seconds)
        gc.collect()
    if found is not None:
        found.update(peak_gib=dict(peaks), failed=failed)
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
        ours, bert, theirs = (row["times"].get(n) for n in ("ours-sdpa", "bert-sdpa", "transformers-deberta"))
        speedup = f"{theirs / ours:.2f}x" if theirs else "-"
        lines.append(f"| {row['case']} | " + " | ".join(cells) + f" | {ours / bert:.2f} | {speedup} |")
    return "\n".join(lines)


def markdown_gpu_table(rows: list[dict], names: list[str]) -> str:
    """Milliseconds and peak GiB (above the loaded models) per model and case; why a model sat a case out."""
    lines = ["| case | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for row in rows:
        cells = []
        for name in names:
            if name in row["times"]:
                cells.append(f"{row['times'][name] * 1000:.1f} ms, {row['peak_gib'].get(name, 0.0):.2f} GiB")
            else:
                cells.append("left out" if name in row["failed"] else "-")
        lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
    notes = [f"{row['case']}, {name}: {why}" for row in rows for name, why in row["failed"].items()]
    return "\n".join(lines + ([""] + [f"- {note}" for note in notes] if notes else []))


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


# On an NVIDIA GPU in bfloat16 (issue 38): ours-sdpa / BERT-sdpa at most ...
CUDA_BFLOAT16_TARGETS = {
    ("infer", 32, 512): 2.5,
    ("infer", 8, 2048): 2.5,
    ("infer", 1, 8192): 2.5,
    ("train", 16, 512): 1.6,
}
ANCHORS = ("flashdeberta", "disentangled-flash")
# ... ours-sdpa faster than these, in the same run ...
CUDA_BFLOAT16_FASTER_THAN = {
    ("infer", 32, 512): ANCHORS,
    ("infer", 8, 2048): ANCHORS,
    ("infer", 1, 8192): ANCHORS,
    ("infer", 1, 16384): ("flashdeberta",),
    ("infer", 1, 32768): ("flashdeberta",),
    ("train", 16, 512): (*ANCHORS, "transformers-deberta"),
    ("train", 4, 2048): (*ANCHORS, "transformers-deberta"),
}
# ... and ours-sdpa's peak memory above the loaded models at most this many GiB
CUDA_BFLOAT16_PEAK_GIB = {("infer", 1, 16384): 1.0}
# (layers, batch, length): the GPU cases, 12 layers each
GPU_INFERENCE_CASES = [(12, 32, 512), (12, 8, 2048), (12, 1, 8192), (12, 1, 16384), (12, 1, 32768)]
GPU_TRAINING_CASES = [(12, 16, 512), (12, 4, 2048)]


def targets_for(device: str, dtype: str) -> dict:
    """The ours-sdpa / BERT-sdpa targets of a run: float32's on any CPU, and for bfloat16 where the CPU has no AMX;
    bfloat16's with AMX; on CUDA, bfloat16's (issue 38); none in float16 or on CUDA in another dtype."""
    if device.startswith("cuda"):
        return CUDA_BFLOAT16_TARGETS if dtype == "bfloat16" else {}
    if device != "cpu" or dtype == "float16":
        return {}
    if dtype == "bfloat16" and "amx_bf16" in machine.processor()[1]:
        return BFLOAT16_AMX_TARGETS
    return TARGETS


def gpu_targets_for(device: str, dtype: str) -> dict:
    """Per (mode, batch, length), the other targets of a CUDA bfloat16 run: {"faster_than": [models ours-sdpa must
    beat], "peak_gib_target": ours-sdpa's bound on its peak memory above the loaded models, or None}; empty
    elsewhere."""
    if not device.startswith("cuda") or dtype != "bfloat16":
        return {}
    return {
        case: {
            "faster_than": list(CUDA_BFLOAT16_FASTER_THAN.get(case, ())),
            "peak_gib_target": CUDA_BFLOAT16_PEAK_GIB.get(case),
        }
        for case in {**CUDA_BFLOAT16_FASTER_THAN, **CUDA_BFLOAT16_PEAK_GIB}
    }


def ratio_summary(values: list[float]) -> dict | None:
    """Median, lowest and highest of a ratio over processes; None where no process measured both models."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratios(times: list[dict], numerator: str, denominator: str) -> list[float]:
    """`numerator` / `denominator` in each process that timed both."""
    return [t[numerator] / t[denominator] for t in times if numerator in t and denominator in t]


def software_versions() -> dict:
    """The versions a GPU record names: torch, its CUDA, Triton, transformers (`disentangled env`'s) and the anchors
    (None where absent)."""
    found = environment.versions()
    versions = {name: found[name] for name in ("torch", "cuda", "transformers", "triton")}
    versions.update({name: gpu_anchors.version(name) for name in gpu_anchors.ANCHORS})
    return versions


def record_figures(args: argparse.Namespace, rows: list[dict], repeats: int, memory: dict | None = None) -> dict:
    """The figures of a `run` record: per case, each process's median times and the ratios' median and range.
    `rows` is [{"case", "times": [one {model: seconds} per process]}] in case order; on CUDA each row also holds
    "peak_gib" (one {model: GiB} per process) and "failed" ({model: why}), and the figures name the GPU, the
    versions, the other targets (`gpu_targets_for`) and each other model's time over ours-sdpa's."""
    targets = targets_for(args.device, args.dtype)
    cuda = args.device.startswith("cuda")
    gpu_targets = gpu_targets_for(args.device, args.dtype)
    cases = []
    for row in rows:
        mode, shape = row["case"].split()[:2]
        batch, length = (int(part) for part in shape.split("x"))
        times = row["times"]
        case = {
            "case": f"{mode} {shape}",
            "mode": mode,
            "batch": batch,
            "length": length,
            "layers": row["layers"],
            "times": times,
            "ours_over_bert": ratio_summary(ratios(times, "ours-sdpa", "bert-sdpa")),
            "transformers_over_ours": ratio_summary(ratios(times, "transformers-deberta", "ours-sdpa")),
            "target": targets.get((mode, batch, length)),
        }
        if any(PYTORCH_PATH in t for t in times):  # the pure-PyTorch path (the kernels off), in the same run
            case["pytorch_path_over_bert"] = ratio_summary(ratios(times, PYTORCH_PATH, "bert-sdpa"))
        if cuda:
            others = sorted({name for t in times for name in t} - {"ours-sdpa", "bert-sdpa"})
            case["over_ours"] = {name: ratio_summary(ratios(times, name, "ours-sdpa")) for name in others}
            case["peak_gib"] = row.get("peak_gib", [])
            case["failed"] = row.get("failed", {})
            goals = gpu_targets.get((mode, batch, length), {})
            case["faster_than"] = goals.get("faster_than", [])
            case["peak_gib_target"] = goals.get("peak_gib_target")
        cases.append(case)
    figures = {
        "device": args.device,
        "dtype": args.dtype,
        "layers": args.layers or 12,
        "repeats": repeats,
        "processes": args.processes,
        "cases": cases,
    }
    if cuda:
        figures["gpu"] = torch.cuda.get_device_name(args.device) if torch.cuda.is_available() else args.device
        figures["versions"] = software_versions()
        figures["parity"] = args.parity
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


def record_command(argv: list[str] | None) -> list[str]:
    """The command a record names: this module's with the arguments it was given (also when benchmarks.device_check
    calls it), less --parity, whose verdict the figures hold."""
    arguments = list(argv if argv is not None else sys.argv[1:])
    if "--parity" in arguments:
        del arguments[arguments.index("--parity") : arguments.index("--parity") + 2]
    return ["python", "-m", "benchmarks.run", *arguments]


def release_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def time_case(
    models: dict, anchors: list[str], batch: int, length: int, training: bool, repeats: int, args, dtype
) -> dict:
    """One case: `models` and each anchor built on their transformers' DeBERTa for it, interleaved. On the CPU
    {"times"}; on CUDA also "peak_gib" per model and "failed" (why an anchor or transformers' DeBERTa sat it out),
    with 2 warm-up calls and, for training, an AdamW step in each call."""
    cuda = args.device.startswith("cuda")
    models, failed = dict(models), {}
    for anchor in anchors:
        model, why = gpu_anchors.build_anchor(anchor, models["transformers-deberta"], training=training, length=length)
        if model is None:
            failed[anchor] = why
            print(why, flush=True)
        else:
            models[anchor] = model
    optimizers = None
    if training and cuda:
        optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-6) for name, model in models.items()}
    found = {}
    warmup = 2 if cuda else 1
    times = timing_case(models, batch, length, training, repeats, warmup, args.device, dtype, optimizers, found)
    del models, optimizers
    release_memory(args.device)
    if not cuda:
        return {"times": times}
    return {"times": times, "peak_gib": found["peak_gib"], "failed": {**failed, **found["failed"]}}


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
        "| case | ours-sdpa / bert | transformers / ours-sdpa | target | at or under it |"
        + (" kernels off / bert |" if args.pytorch_path else ""),
        "|---|---|---|---|---|" + ("---|" if args.pytorch_path else ""),
    ]
    for index, row in enumerate(reports[0]["inference"] + reports[0]["training"]):
        rows = [(report["inference"] + report["training"])[index]["times"] for report in reports]
        ours = ratios(rows, "ours-sdpa", "bert-sdpa")
        pytorch = ratios(rows, PYTORCH_PATH, "bert-sdpa")
        before = f" {statistics.median(pytorch):.2f} ({min(pytorch):.2f}-{max(pytorch):.2f}) |" if pytorch else ""
        theirs = ratios(rows, "transformers-deberta", "ours-sdpa")
        mode, shape = row["case"].split()[:2]
        batch, length = (int(part) for part in shape.split("x"))
        target = targets_for(args.device, args.dtype).get((mode, batch, length))
        met = f"{sum(ratio <= target for ratio in ours)} of {len(ours)}" if target else "-"
        speedup = f"{statistics.median(theirs):.2f}x ({min(theirs):.2f}-{max(theirs):.2f})" if theirs else "-"
        lines.append(
            f"| {row['case']} | {statistics.median(ours):.2f} ({min(ours):.2f}-{max(ours):.2f}) "
            f"| {speedup} | {f'{target:.2f}' if target else '-'} | {met} |{before}"
        )
    markdown = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "processes.json").write_text(json.dumps({"markdown": markdown, "processes": reports}, indent=2))
    print(markdown)
    if not args.no_record:
        rows = []
        for index, row in enumerate(reports[0]["inference"] + reports[0]["training"]):
            per_process = [(report["inference"] + report["training"])[index] for report in reports]
            rows.append(
                {
                    "case": row["case"],
                    "layers": row["layers"],
                    "times": [one["times"] for one in per_process],
                    "peak_gib": [one.get("peak_gib", {}) for one in per_process],
                    "failed": {name: why for one in per_process for name, why in one.get("failed", {}).items()},
                }
            )
        append_record("run", record_figures(args, rows, reports[0]["repeats"]), folder=args.records, commit=args.commit)


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
    parser.add_argument("--records", type=Path, default=RECORDS, help="the folder of run.jsonl (default: the repo's)")
    parser.add_argument(
        "--anchors",
        nargs="*",
        choices=list(gpu_anchors.ANCHORS),
        default=None,
        help="the anchors to time beside ours (default: both on CUDA, none on the CPU)",
    )
    parser.add_argument("--budget-s", type=float, default=None, help="start no case after this many seconds")
    parser.add_argument(
        "--pytorch-path", action="store_true", help="also time ours-sdpa with the compiled CPU kernels off"
    )
    parser.add_argument("--commit", default=None, help="the commit measured, for a tree that is not a git checkout")
    parser.add_argument("--parity", default=None, help=argparse.SUPPRESS)  # benchmarks.device_check's verdict
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
    started = time.monotonic()
    cuda = args.device.startswith("cuda")
    repeats = args.repeats or (1 if args.quick else 10 if cuda else 5)
    if args.quick:
        inference_cases = [(12, 8, 128), (12, 2, 512)]
        training_cases = [(12, 2, 128)]
    elif cuda:
        inference_cases, training_cases = GPU_INFERENCE_CASES, GPU_TRAINING_CASES
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
    anchors = args.anchors if args.anchors is not None else list(gpu_anchors.ANCHORS) if cuda else []
    eager = not args.no_eager and not cuda  # on a GPU our eager reference's [B, H, L, L] tensors do not fit at 32k
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "processor": machine.describe(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
        f" ({torch.get_num_threads()} threads), transformers {transformers.__version__}, {args.dtype}"
        + (f", {torch.cuda.get_device_name(args.device)}" if cuda else ""),
        "repeats": repeats,
        "inference": [],
        "training": [],
        "memory": {},
        "skipped": [],
    }
    if cuda:
        report["versions"] = software_versions()
    name = (
        "benchmark-quick" if args.quick else "memory" if args.no_timing else "timing" if args.no_memory else "benchmark"
    )
    print(f"Processor: {report['processor']}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        if not args.no_timing:
            backends = (["eager"] if eager else []) + (["flex_attention"] if args.flex else []) + ["sdpa"]
            # the models of one (layers, mode) serve all its cases on CUDA and in a --quick run; otherwise, on the CPU,
            # each case builds its own
            built = {}
            for training, cases in ((False, inference_cases), (True, training_cases)):
                for layers, batch, length in cases:
                    label = f"{'train' if training else 'infer'} {batch}x{length} ({layers} layers)"
                    if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                        report["skipped"].append(label)
                        print(f"{label}: not started, the {args.budget_s:g} s budget is spent", flush=True)
                        continue
                    if (layers, training) not in built:
                        built.clear()
                        release_memory(args.device)
                        backends_here = [b for b in backends if not (training and b == "flex_attention")]
                        built[layers, training] = build_models(
                            layers, folder / f"l{layers}", backends_here, training, args.device, dtype,
                            pytorch_path=args.pytorch_path,
                        )  # fmt: skip
                    row = time_case(built[layers, training], anchors, batch, length, training, repeats, args, dtype)
                    row = {"case": label, "layers": layers, **row}
                    report["training" if training else "inference"].append(row)
                    print(f"{label}: {row}  ({time.monotonic() - started:.0f} s since the start)", flush=True)
                    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2))  # what a killed run keeps
                    if not cuda and not args.quick:
                        built.clear()
                    gc.collect()
            built.clear()
            release_memory(args.device)
        if not args.quick and not args.no_memory and not (cuda and args.memory_models is None):
            model_names = args.memory_models or [
                "ours-sdpa",
                "ours-flex_attention",
                "transformers-deberta",
                "bert-sdpa",
            ]
            build_models(1, folder / "memory", [], False)  # the checkpoint folder the children load
            for model_name in model_names:
                report["memory"][model_name] = {}
                for length in args.memory_lengths:
                    result = memory_case(
                        model_name,
                        length,
                        args.memory_cap_gib,
                        folder / "memory",
                        args.memory_timeout,
                        args.device,
                        args.dtype,
                    )
                    report["memory"][model_name][length] = result
                    print(model_name, length, result, flush=True)
                    if not result["ok"]:
                        break  # longer inputs fail too
    names = (
        (["ours-eager"] if eager else [])
        + (["ours-flex_attention"] if args.flex else [])
        + ["ours-sdpa"]
        + ([PYTORCH_PATH] if args.pytorch_path else [])
        + ["transformers-deberta", "bert-sdpa"]
        + anchors
    )
    text = [
        f"`{report['command']}` on {report['machine']}; median of {repeats} interleaved runs.",
        f"Processor: {report['processor']}",
        "",
    ]
    rows = report["inference"] + report["training"]
    if rows:
        text += [markdown_timing_table(rows, names), ""]
    if rows and cuda:
        text += ["Milliseconds per call and peak GiB above the loaded models:", "", markdown_gpu_table(rows, names), ""]
    if report["skipped"]:
        text += [f"Not started (budget of {args.budget_s:g} s spent): {', '.join(report['skipped'])}", ""]
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
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2))
    print(report["markdown"])
    if not args.no_record and (rows or report["memory"]):
        rows = [
            {**row, "times": [row["times"]], **({"peak_gib": [row["peak_gib"]]} if "peak_gib" in row else {})}
            for row in rows
        ]
        figures = record_figures(args, rows, repeats, report["memory"])
        if report["skipped"]:
            figures["not_started"] = report["skipped"]
        append_record("run", figures, folder=args.records, commit=args.commit, command=record_command(argv))


if __name__ == "__main__":
    main()
