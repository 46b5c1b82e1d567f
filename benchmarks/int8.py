"""int8 inference on the CPU: speed of each int8 path, and how often it predicts what the float32 model does.

    python -m benchmarks.int8              # 2 layers, 8x128 and 4x512, classifier and fill-mask agreement
    python -m benchmarks.int8 --quick      # a smoke test: small model, few steps, one timing shape

Speed (DeBERTa-v3-base shape, random weights, `--layers` layers, interleaved medians, one call of each per
round): our float32 PyTorch model (sdpa) against torch's dynamic int8 (`disentangled.quantize_dynamic`, with its
default engine, and with torch's own default engine x86 as `ours-torch-int8-x86`),
onnxruntime float32 (`export-onnx`) and onnxruntime int8 (`export-onnx --quantize int8`, and the same with one
weight scale per output channel as `onnxruntime-int8-per-channel`), and a same-size BERT
with sdpa in float32. onnxruntime runs with as many threads as torch, thread spinning off (spinning threads
would take the cores from the next model in the round).

Agreement, on the project's built-in texts (`disentangled.demo.data`): a classifier (v3-base's layout and
`--layers`, but hidden 256 and 4 heads unless `--agreement-width base`, so that it trains in seconds)
fine-tuned here on the built-in sentiment task, then argmax agreement of each path with its float32
predictions on held-out texts (and each one's accuracy); a masked LM trained here on the built-in corpus, top-1
agreement at one masked word per held-out line; for both, the largest change of a probability.
Writes benchmarks/results/int8.json (int8-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

import disentangled
from benchmarks import machine, records
from benchmarks.run import V3_BASE, build_models, inputs_for
from disentangled.demo.data import corpus_lines, sentiment_examples, train_sentencepiece
from disentangled.integrations.tokenization import tokenizer_from_spm
from disentangled.serving import onnx_export, quantization

RESULTS = Path(__file__).parent / "results"
PATHS = [
    "ours-float32",
    "ours-torch-int8",
    "ours-torch-int8-x86",
    "onnxruntime-float32",
    "onnxruntime-int8",
    "onnxruntime-int8-per-channel",
    "bert-sdpa",
]
# torch's default quantized engine, for comparison with ours (oneDNN where the CPU has AMX: `default_engine`)
TORCH_ENGINE = "x86" if "x86" in torch.backends.quantized.supported_engines else torch.backends.quantized.engine
SMALL = dict(hidden_size=256, num_attention_heads=4, intermediate_size=1024)  # v3-base-like, narrower: trains fast


def onnx_pair(model: torch.nn.Module, task: str, folder: Path, threads: int) -> dict:
    """`export-onnx`'s float32 and int8 graphs of `model` (traced with sdpa attention, the command's default: the fused graph),
    as onnxruntime sessions."""
    float_path, int8_path = folder / f"{task}-float32.onnx", folder / f"{task}-int8.onnx"
    backend = model.config._attn_implementation
    model.set_attn_implementation(onnx_export.DEFAULT_ATTENTION)
    try:
        onnx_export.export(model, task, float_path)
    finally:
        model.set_attn_implementation(backend)
    onnx_export.lean_graph(float_path)
    onnx_export.quantize_int8(float_path, int8_path)
    per_channel = folder / f"{task}-int8-per-channel.onnx"
    onnx_export.quantize_int8(float_path, per_channel, per_channel=True)
    return {
        "onnxruntime-float32": onnx_export.session(float_path, threads, spinning=False),
        "onnxruntime-int8": onnx_export.session(int8_path, threads, spinning=False),
        "onnxruntime-int8-per-channel": onnx_export.session(per_channel, threads, spinning=False),
    }


def onnx_runner(session, output_name: str):
    def run(**inputs):
        feeds = {name: value.numpy() for name, value in inputs.items()}
        return torch.from_numpy(session.run([output_name], feeds)[0])

    return run


def torch_runner(model: torch.nn.Module, output_name: str):
    def run(**inputs):
        with torch.inference_mode():
            return getattr(model(**inputs), output_name)

    return run


def timing(layers: int, shapes: list[tuple[int, int]], repeats: int, threads: int, folder: Path) -> list[dict]:
    """Median seconds per forward of every path, per (batch, length), interleaved."""
    models = build_models(layers, folder / "checkpoint", ["sdpa"], training=False)
    ours, bert = models["ours-sdpa"], models["bert-sdpa"]
    del models
    runners = {
        "ours-float32": torch_runner(ours, "last_hidden_state"),
        "ours-torch-int8": torch_runner(disentangled.quantize_dynamic(ours), "last_hidden_state"),
        "ours-torch-int8-x86": torch_runner(
            disentangled.quantize_dynamic(ours, engine=TORCH_ENGINE), "last_hidden_state"
        ),
        **{
            name: onnx_runner(session, "last_hidden_state")
            for name, session in onnx_pair(ours, "base", folder, threads).items()
        },
        "bert-sdpa": torch_runner(bert, "last_hidden_state"),
    }
    rows = []
    for batch, length in shapes:
        inputs = inputs_for(batch, length, padded=True)
        for run in runners.values():  # warm-up
            run(**inputs)
        times = {name: [] for name in runners}
        for _ in range(repeats):
            for name, run in runners.items():
                start = time.perf_counter()
                run(**inputs)
                times[name].append(time.perf_counter() - start)
            gc.collect()
        medians = {name: statistics.median(values) for name, values in times.items()}
        row = {"case": f"{batch}x{length} ({layers} layers)", "times": medians}
        print(row, flush=True)
        rows.append(row)
    return rows


def operator_shares(path: Path, inputs: dict, threads: int, runs: int = 4) -> tuple[float, dict[str, float]]:
    """onnxruntime's profile of `runs` calls (the first, with its allocations, included): milliseconds per call
    spent in operators, and each operator type's share of them, largest first."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_profiling = True
    options.profile_file_prefix = str(path.with_suffix(""))
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {name: value.numpy() for name, value in inputs.items()}
    for _ in range(runs):
        session.run(None, feeds)
    trace = Path(session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    by_operator = {}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            operator = event["args"]["op_name"]
            by_operator[operator] = by_operator.get(operator, 0.0) + event["dur"]
    total = sum(by_operator.values())
    shares = {op: microseconds / total for op, microseconds in sorted(by_operator.items(), key=lambda x: -x[1])}
    return total / runs / 1000, shares


def profile(layers: int, batch: int, length: int, threads: int, folder: Path) -> dict:
    """Where the int8 graph spends its time: onnxruntime's `quantize_dynamic` as is on the plain export,
    against `export-onnx --quantize int8`'s graph (Einsums as MatMuls, weight subgraphs folded)."""
    from onnxruntime.quantization import quantize_dynamic

    models = build_models(layers, folder / "checkpoint", ["eager"], training=False)
    ours = models["ours-eager"]
    del models
    plain, as_is, prepared = folder / "plain.onnx", folder / "int8-as-is.onnx", folder / "int8.onnx"
    onnx_export.export(ours, "base", plain)
    quantize_dynamic(plain, as_is)
    onnx_export.lean_graph(plain)
    onnx_export.quantize_int8(plain, prepared)
    inputs = inputs_for(batch, length, padded=True)
    result = {}
    for name, path in (("quantize_dynamic as is", as_is), ("export-onnx --quantize int8", prepared)):
        milliseconds, shares = operator_shares(path, inputs, threads)
        result[name] = {"ms_per_call_in_operators": milliseconds, "shares": shares}
        print(
            f"{name}: {milliseconds:.0f} ms per call in operators ({batch}x{length}, {layers} layers, {threads} threads)"
        )
        for operator, share in list(shares.items())[:12]:
            print(f"  {operator:28s} {100 * share:5.1f}%")
    return result


def train(model: torch.nn.Module, batches, steps: int, learning_rate: float) -> float:
    """A plain AdamW loop over `batches` (a callable step -> inputs with labels); returns the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    model.train()
    for step in range(steps):
        loss = model(**batches(step)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return loss.item()


def compare(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Argmax agreement over the rows of [N, C] logits and the largest change of a probability."""
    return {
        "agreement": (reference.argmax(-1) == other.argmax(-1)).float().mean().item(),
        "max_prob_diff": (reference.softmax(-1) - other.softmax(-1)).abs().max().item(),
    }


def in_batches(run, encoded: dict, size: int = 64) -> torch.Tensor:
    rows = encoded["input_ids"].shape[0]
    return torch.cat([run(**{k: v[i : i + size] for k, v in encoded.items()}) for i in range(0, rows, size)])


def agreement(layers: int, width: str, steps: int, texts: int, threads: int, folder: Path) -> dict:
    """Fine-tune a classifier and train a masked LM on the built-in data, then compare every path with float32."""
    tokenizer = tokenizer_from_spm(
        train_sentencepiece(folder / "spm", corpus_lines(3000, seed=0), vocab_size=100),
        check_text="the quick brown fox sat on the mat",
    )
    shape = {**V3_BASE, **(SMALL if width == "small" else {})}
    config = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        num_hidden_layers=layers,
        **{k: shape[k] for k in ("hidden_size", "num_attention_heads", "intermediate_size")},
    )
    results = {}
    generator = torch.Generator().manual_seed(0)

    # classifier: the sentiment word decides the label
    torch.manual_seed(0)
    labels = {"negative": 0, "positive": 1}
    classifier = disentangled.DisentangledForSequenceClassification(
        disentangled.DisentangledConfig(**config, num_labels=2)
    )
    training = sentiment_examples(2048, seed=1)

    def classifier_batch(step: int) -> dict:
        rows = [training[(step * 32 + i) % len(training)] for i in range(32)]
        encoded = tokenizer([row["text"] for row in rows], padding=True, return_tensors="pt")
        encoded.pop("token_type_ids", None)
        return {**encoded, "labels": torch.tensor([labels[row["label"]] for row in rows])}

    loss = train(classifier, classifier_batch, steps, learning_rate=1e-4)
    held_out = sentiment_examples(texts, seed=3)
    encoded = dict(tokenizer([row["text"] for row in held_out], padding=True, return_tensors="pt"))
    encoded.pop("token_type_ids", None)
    truth = torch.tensor([labels[row["label"]] for row in held_out])
    runners = {
        "ours-float32": torch_runner(classifier, "logits"),
        "ours-torch-int8": torch_runner(disentangled.quantize_dynamic(classifier), "logits"),
        **{
            name: onnx_runner(session, "logits")
            for name, session in onnx_pair(classifier, "sequence-classification", folder, threads).items()
        },
    }
    logits = {name: in_batches(run, encoded) for name, run in runners.items()}
    results["classifier"] = {
        "training": f"{steps} steps of 32 built-in sentiment examples, last loss {loss:.3f}",
        "texts": texts,
        "accuracy": {name: (value.argmax(-1) == truth).float().mean().item() for name, value in logits.items()},
        **{name: compare(logits["ours-float32"], value) for name, value in logits.items() if name != "ours-float32"},
    }
    print("classifier", results["classifier"], flush=True)
    del classifier, runners
    gc.collect()

    # fill-mask: one masked word per held-out line of the built-in corpus
    torch.manual_seed(0)
    masked_lm = disentangled.DisentangledForMaskedLM(disentangled.DisentangledConfig(**config))
    lines = corpus_lines(4000, seed=5)
    training_lines, held_out_lines = lines[:-texts], lines[-texts:]
    special = torch.tensor(tokenizer.all_special_ids)

    def masked(encoded: dict, fraction: float | None) -> tuple[dict, torch.Tensor]:
        """Mask `fraction` of the real tokens (at least one per row), or exactly one per row (None)."""
        ids = encoded["input_ids"]
        maskable = ~torch.isin(ids, special) & encoded["attention_mask"].bool()
        scores = torch.rand(ids.shape, generator=generator).masked_fill(~maskable, 2.0)
        chosen = scores <= scores.min(-1, keepdim=True).values
        if fraction is not None:
            chosen |= scores < fraction
        return {**encoded, "input_ids": ids.masked_fill(chosen, tokenizer.mask_token_id)}, chosen

    def masked_lm_batch(step: int) -> dict:
        rows = [training_lines[(step * 32 + i) % len(training_lines)] for i in range(32)]
        encoded = dict(tokenizer(rows, padding=True, return_tensors="pt"))
        encoded.pop("token_type_ids", None)
        inputs, chosen = masked(encoded, 0.15)
        return {**inputs, "labels": encoded["input_ids"].masked_fill(~chosen, -100)}

    loss = train(masked_lm, masked_lm_batch, steps, learning_rate=1e-4)
    encoded = dict(tokenizer(held_out_lines, padding=True, return_tensors="pt"))
    encoded.pop("token_type_ids", None)
    inputs, chosen = masked(encoded, None)
    runners = {
        "ours-float32": torch_runner(masked_lm, "logits"),
        "ours-torch-int8": torch_runner(disentangled.quantize_dynamic(masked_lm), "logits"),
        **{
            name: onnx_runner(session, "logits")
            for name, session in onnx_pair(masked_lm, "masked-lm", folder, threads).items()
        },
    }
    logits = {name: in_batches(run, inputs)[chosen] for name, run in runners.items()}  # [texts, vocab]
    truth = encoded["input_ids"][chosen]
    results["fill-mask"] = {
        "training": f"{steps} steps of 32 built-in corpus lines, 15% masked, last loss {loss:.3f}",
        "texts": texts,
        "accuracy": {name: (value.argmax(-1) == truth).float().mean().item() for name, value in logits.items()},
        **{name: compare(logits["ours-float32"], value) for name, value in logits.items() if name != "ours-float32"},
    }
    print("fill-mask", results["fill-mask"], flush=True)
    return results


def markdown(report: dict) -> str:
    lines = [
        "| case | " + " | ".join(PATHS) + " | speed-up of each over ours-float32 |",
        "|---" * (len(PATHS) + 2) + "|",
    ]
    for row in report["timing"]:
        times = row["times"]
        cells = [f"{times[name] * 1000:.0f} ms" for name in PATHS]
        speedups = ", ".join(
            f"{name.removeprefix('ours-')} {times['ours-float32'] / times[name]:.2f}x"
            for name in PATHS
            if name != "ours-float32"
        )
        lines.append(f"| {row['case']} | " + " | ".join(cells) + f" | {speedups} |")
    lines += [
        "",
        "| task (held-out built-in texts) | path | agreement with float32 | max abs. diff. of a probability | accuracy |",
    ]
    lines.append("|---|---|---|---|---|")
    for task, result in report["agreement"].items():
        lines.append(f"| {task} | ours-float32 | - | - | {result['accuracy']['ours-float32']:.3f} |")
        for name in ("ours-torch-int8", "onnxruntime-float32", "onnxruntime-int8", "onnxruntime-int8-per-channel"):
            figure = result[name]
            lines.append(
                f"| {task} ({result['texts']} texts) | {name} | {figure['agreement']:.3f} | "
                f"{figure['max_prob_diff']:.1e} | {result['accuracy'][name]:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 layer, small agreement models, 8x128")
    parser.add_argument("--layers", type=int, default=None, help="layers of every model (default 2; 1 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7; 1 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="threads for torch and onnxruntime (default torch's)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per agreement model (default 200)")
    parser.add_argument("--texts", type=int, default=512, help="held-out texts per agreement task (default 512)")
    parser.add_argument(
        "--agreement-width",
        choices=["small", "base"],
        default="small",
        help="agreement models: small (hidden 256, 4 heads; default) or base (v3-base's 768, 12 heads)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="only onnxruntime's per-operator profile of the int8 graph, before and after the export's preparation",
    )
    parser.add_argument("--no-timing", action="store_true", help="agreement only")
    parser.add_argument("--no-agreement", action="store_true", help="timing only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--records", type=Path, default=records.RECORDS, help="where int8.jsonl gets the run's record")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    layers = args.layers or (1 if args.quick else 2)
    repeats = args.repeats or (1 if args.quick else 7)
    steps = args.steps or (20 if args.quick else 200)
    shapes = [(8, 128)] if args.quick else [(8, 128), (4, 512)]
    transformers.logging.set_verbosity_error()
    report = {
        "command": "python -m benchmarks.int8 " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine.describe(),
        "versions": (
            f"onnxruntime {onnx_export.onnxruntime_version()}, transformers {transformers.__version__}, "
            f"torch int8 engine {quantization.default_engine()} (ours-torch-int8-x86: {TORCH_ENGINE})"
        ),
    }
    print(report["machine"], flush=True)
    if args.profile:
        with tempfile.TemporaryDirectory() as folder:
            report["profile"] = profile(layers, *shapes[0], threads, Path(folder))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "int8-profile.json").write_text(json.dumps(report, indent=2))
        return report
    with tempfile.TemporaryDirectory() as folder:
        report["timing"] = [] if args.no_timing else timing(layers, shapes, repeats, threads, Path(folder))
        gc.collect()
        report["agreement"] = (
            {}
            if args.no_agreement
            else agreement(layers, args.agreement_width, steps, args.texts, threads, Path(folder))
        )
    report["markdown"] = (
        f"`{report['command']}` on {report['machine']}, {report['versions']}; median of {repeats} interleaved "
        f"runs.\n\n" + markdown(report)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ("int8-quick.json" if args.quick else "int8.json")).write_text(json.dumps(report, indent=2))
    print(report["markdown"])
    if not args.quick:  # a smoke run is not a measurement
        figures = {
            "layers": layers,
            "repeats": repeats,
            "timing": [dict(row, case=row["case"].split(" (")[0]) for row in report["timing"]],
            "agreement": report["agreement"],
            "versions": report["versions"],
            "engine": quantization.default_engine(),
        }
        record = records.append_record("int8", figures, command=report["command"].split(), folder=args.records)
        print(f"appended a record to {args.records / 'int8.jsonl'} (commit {record['commit']})")
    return report


if __name__ == "__main__":
    main()
