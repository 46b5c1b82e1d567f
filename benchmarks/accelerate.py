"""Libraries' own DeBERTa models with `disentangled.accelerate` against without: GLiNER, GLiNER2 and a CrossEncoder.

    python -m benchmarks.accelerate                          # 12 layers, float32, every case: about an hour on 2 cores
    python -m benchmarks.accelerate --layers 2               # every case, 2 layers: 15 minutes
    python -m benchmarks.accelerate --layers 2 --cases gliner-1x2048 crossencoder-1x2048   # a few cases, 2 layers
    python -m benchmarks.accelerate --dtype bfloat16 --threads 2
    python -m benchmarks.accelerate --device cuda --dtype bfloat16                        # on a GPU
    python -m benchmarks.accelerate --quick                   # a tiny model in seconds: checks that everything runs

Each library builds transformers' `DebertaV2Model` itself, from a local DeBERTa-v3-base-shaped folder written here
(hidden 768, 12 heads, intermediate 3072, 256 position buckets, shared keys, p2c|c2p, layer-normed relative
embeddings; random seeded weights; a SentencePiece tokenizer trained at run time on generated words). Per library,
the model is built once and copied; `disentangled.accelerate` is called on the copy, so both run the same
parameters. Per case (library, batch, tokens), the texts are generated words, as many as make the encoder's input
exactly that long (a hook on the encoder reads its input's shape, and the run prints it); the two models then run the
library's own call (GLiNER `inference`, GLiNER2 `batch_extract_entities`, `CrossEncoder.predict`) with the whole
batch, interleaved: one warm-up call each, then `--repeats` rounds of one call each, the order alternating. The
warm-up also compares the encoders' outputs at the real tokens (the largest difference is printed and recorded).
Random heads score every span near 0.5, so entity extraction runs with a threshold of 0.95: the decoding then does
what a trained model's handful of entities costs, not the tens of thousands of spans above 0.5.

GLiNER 0.2.29 requires transformers < 5.17: where the running interpreter cannot import it, its cases run in a child
process of `--python` (by default `.venv457/bin/python`, the transformers 4.57 environment of .ci/run, when it
has gliner), on the same folder; every case records the versions it ran with. A library that is not installed is
skipped, and the run says so.

The ratio printed per case is the unaccelerated median time over the accelerated one. On the CPU in float32 the
targets (issue 39) are: at least 1.5x at 512 tokens, at least 3x at 2,048, never slower at 128. Every run appends a
record to benchmarks/records/accelerate.jsonl (processor, dtype, versions, commit, command, figures), from which
`python -m benchmarks.report` generates the table of docs/libraries.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

import disentangled
from benchmarks import machine
from benchmarks.records import RECORDS, append_record
from benchmarks.run import V3_BASE
from disentangled.integrations.acceleration import is_accelerated

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv457" / "bin" / "python"  # transformers 4.57 (.ci/run), where gliner installs
LIBRARIES = ("gliner", "gliner2", "crossencoder")
PACKAGES = {"gliner": "gliner", "gliner2": "gliner2", "crossencoder": "sentence_transformers"}
LENGTHS, BATCHES = (128, 512, 2048), (1, 8)
QUICK_LENGTHS, QUICK_BATCHES = (48,), (1, 2)
TINY = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128)  # --quick: seconds, not minutes
TARGETS = {128: 1.0, 512: 1.5, 2048: 3.0}  # speed-up at least, by tokens: on the CPU in float32 (issue 39)
TARGET_LAYERS = 12  # the targets are for the model these libraries load (DeBERTa-v3-base); other depths are context
LABELS = ["person", "organization", "location", "date"]
QUERY_WORDS = 8  # a CrossEncoder pair is (query, passage); the passage fills the rest
THRESHOLD = 0.95
BASES = (transformers.DebertaV2Model,)


# ---------------------------------------------------------------------------------------------------------------
# The backbone folder and the texts


def write_backbone(folder: Path, layers: int, quick: bool) -> Path:
    """A DeBERTa-v3-base-shaped `DebertaV2ForSequenceClassification` (one label: a CrossEncoder's head; GLiNER and
    GLiNER2 load its `DebertaV2Model`) with random seeded weights, and a DeBERTa-v3 tokenizer (spm.model) trained here
    on generated words. Returns `folder`."""
    from disentangled.demo.data import train_sentencepiece
    from disentangled.integrations.tokenization import SPM_TOKENIZER_CONFIG

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = sorted({"".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(6000)})
    lines = [" ".join(rng.choice(words) for _ in range(24)) for _ in range(6000)]
    vocab_size = 1000 if quick else 4000  # the speed is the encoder's; a real vocabulary's 128k rows add nothing
    spm = train_sentencepiece(folder / "_spm", lines, vocab_size=vocab_size)
    shape = {key: value for key, value in V3_BASE.items() if key != "vocab_size"}
    shape.update(TINY if quick else {})
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(**shape, vocab_size=vocab_size, num_hidden_layers=layers, num_labels=1)
    transformers.DebertaV2ForSequenceClassification(config).save_pretrained(folder)
    (folder / "spm.model").write_bytes(spm.read_bytes())
    tokenizer_config = {**SPM_TOKENIZER_CONFIG, "model_max_length": 1 << 16}  # GLiNER truncates at this
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


def vocabulary_words(folder: Path) -> list[str]:
    """Words that are one piece of the folder's tokenizer each (a piece that starts a word, letters only)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return sorted(piece[1:] for piece in tokenizer.get_vocab() if piece[:1] == "▁" and piece[1:].isalpha())


def generated_texts(words: list[str], batch: int, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(count)) for _ in range(batch)]


# ---------------------------------------------------------------------------------------------------------------
# The libraries: how each builds its model from the folder, and its call on a batch of texts


def load_gliner(folder: Path, max_words: int, device: str) -> torch.nn.Module:
    from gliner import GLiNER, GLiNERConfig

    config = GLiNERConfig(model_name=str(folder), max_len=max_words)  # max_len counts words: room for the longest
    model = GLiNER.from_config(config, backbone_from_pretrained=True, local_files_only=True, map_location=device)
    return model


def run_gliner(model, texts: list[str]):
    return model.inference(texts, LABELS, threshold=THRESHOLD, batch_size=len(texts))


def load_gliner2(folder: Path, max_words: int, device: str) -> torch.nn.Module:
    from gliner2 import ExtractorConfig, GLiNER2

    return GLiNER2(ExtractorConfig(model_name=str(folder))).to(device).eval()


def run_gliner2(model, texts: list[str]):
    return model.batch_extract_entities(texts, LABELS, batch_size=len(texts), threshold=THRESHOLD)


def load_crossencoder(folder: Path, max_words: int, device: str) -> torch.nn.Module:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device=device, max_length=max_words + QUERY_WORDS + 8)


def run_crossencoder(model, texts: list[str]):
    query = " ".join(texts[0].split()[:QUERY_WORDS])
    return model.predict([(query, text) for text in texts], batch_size=len(texts), show_progress_bar=False)


ADAPTERS: dict[str, tuple[Callable, Callable]] = {
    "gliner": (load_gliner, run_gliner),
    "gliner2": (load_gliner2, run_gliner2),
    "crossencoder": (load_crossencoder, run_crossencoder),
}


# ---------------------------------------------------------------------------------------------------------------
# Measuring


class _Measured(Exception):
    """Raised by the probe hook to stop a call once the encoder's input shape is known."""


def encoder(model: torch.nn.Module) -> torch.nn.Module:
    (base,) = [module for module in model.modules() if isinstance(module, BASES)]
    return base


def input_shape(model: torch.nn.Module, run: Callable, texts: list[str]) -> tuple[int, int]:
    """[batch, tokens] of the encoder's input for `run(model, texts)`, without running the encoder."""

    def stop(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        raise _Measured(tuple((ids if ids is not None else kwargs["inputs_embeds"]).shape[:2]))

    handle = encoder(model).register_forward_pre_hook(stop, with_kwargs=True)
    try:
        run(model, texts)
    except _Measured as measured:
        return measured.args[0]
    finally:
        handle.remove()
    raise RuntimeError("the library's call never ran its DeBERTa encoder")


def texts_for(model, run, words: list[str], batch: int, tokens: int, seed: int) -> tuple[list[str], int]:
    """Texts whose encoder input is `tokens` long (the library adds its prompt and special tokens): a word is one
    token, so the word count moves by the difference until the lengths agree. Returns the texts and the length."""
    count = tokens
    for _ in range(6):
        texts = generated_texts(words, batch, count, seed)
        length = input_shape(model, run, texts)[1]
        if length == tokens or count <= 1:
            break
        count = max(1, count + tokens - length)
    return texts, length


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_call(model, run: Callable, texts: list[str], device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        run(model, texts)
    synchronize(device)
    return time.perf_counter() - start


def encoder_difference(models: dict, run: Callable, texts: list[str]) -> float:
    """One call of each model (the warm-up); the largest difference of the encoders' outputs at real tokens."""
    outputs = {}
    for name, model in models.items():

        def keep(module, args, kwargs, output, name=name):
            mask = kwargs.get("attention_mask")
            outputs[name] = (output[0].float(), None if mask is None else mask.bool())

        handle = encoder(model).register_forward_hook(keep, with_kwargs=True)
        try:
            with torch.inference_mode():
                run(model, texts)
        finally:
            handle.remove()
    (plain, mask), (accelerated, _) = outputs["transformers"], outputs["accelerated"]
    difference = (plain - accelerated).abs()
    return float((difference[mask] if mask is not None and mask.dim() == 2 else difference).max())


def versions(library: str) -> dict[str, str]:
    found = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    distribution = {"crossencoder": "sentence-transformers"}.get(library, library)
    try:
        found[distribution] = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    return found


def target_for(library: str, tokens: int, device: str, dtype: str, quick: bool) -> float | None:
    if quick or device != "cpu" or dtype != "float32":
        return None
    return TARGETS.get(tokens)


def time_library(library: str, cases: list[tuple[int, int]], folder: Path, args: argparse.Namespace) -> list[dict]:
    """Every (batch, tokens) case of one library, accelerated against not, in this process."""
    load, run = ADAPTERS[library]
    dtype = getattr(torch, args.dtype)
    words = vocabulary_words(folder)
    plain = load(folder, max(tokens for _, tokens in cases), args.device)
    plain.to(dtype=dtype).eval()
    models = {"transformers": plain, "accelerated": disentangled.accelerate(copy.deepcopy(plain))}
    assert is_accelerated(models["accelerated"]) and not is_accelerated(plain)
    rows = []
    for batch, tokens in cases:
        texts, length = texts_for(plain, run, words, batch, tokens, seed=tokens * 10 + batch)
        difference = encoder_difference(models, run, texts)
        times = {name: [] for name in models}
        for repeat in range(args.repeats):
            for name in list(models) if repeat % 2 == 0 else list(models)[::-1]:
                times[name].append(time_call(models[name], run, texts, args.device))
            gc.collect()
        medians = {name: statistics.median(values) for name, values in times.items()}
        row = {
            "case": f"{library} {batch}x{tokens}",
            "library": library,
            "batch": batch,
            "tokens": tokens,
            "encoder_input": [batch, length],
            "times": times,
            "median": medians,
            "speedup": medians["transformers"] / medians["accelerated"],
            "target": target_for(library, tokens, args.device, args.dtype, args.quick),
            "max_abs_diff": difference,
            "versions": versions(library),
        }
        print(
            f"{row['case']}: encoder input {batch}x{length}, transformers {medians['transformers']:.3f} s, "
            f"accelerated {medians['accelerated']:.3f} s, {row['speedup']:.2f}x (outputs differ by {difference:.1e})",
            flush=True,
        )
        rows.append(row)
    del models, plain
    gc.collect()
    return rows


def has_library(python: str, library: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec(PACKAGES[library]) is not None
    check = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({PACKAGES[library]!r}) is None)"
    return Path(python).exists() and subprocess.run([python, "-c", check], capture_output=True).returncode == 0


def interpreter_for(library: str, args: argparse.Namespace) -> str | None:
    """The Python that runs `library`'s cases: this one where it has the library (for GLiNER, unless `--python` names
    another); else, for GLiNER, `--python` or the transformers 4.57 venv; None where none has it."""
    if has_library(sys.executable, library) and not (library == "gliner" and args.python):
        return sys.executable
    if library != "gliner":
        return None
    python = str(args.python or VENV_PYTHON)
    return python if has_library(python, library) else None


def in_child(python: str, library: str, cases: list[tuple[int, int]], folder: Path, args) -> list[dict]:
    """`library`'s cases in a child process of `python` on the same folder (run from the repository root)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "cases.json"
        command = [python, "-m", "benchmarks.accelerate", "--child", library, str(folder), str(out)]
        command += ["--cases", *[case_name(library, batch, tokens) for batch, tokens in cases]]
        command += ["--repeats", str(args.repeats), "--dtype", args.dtype, "--device", args.device]
        command += (["--threads", str(args.threads)] if args.threads else []) + (["--quick"] if args.quick else [])
        done = subprocess.run(command, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"{library} in {python} failed (exit {done.returncode})")
        return json.loads(out.read_text())


def case_name(library: str, batch: int, tokens: int) -> str:
    """The `--cases` name of a case: gliner-8x512, crossencoder-1x2048."""
    return f"{library}-{batch}x{tokens}"


def chosen_cases(args: argparse.Namespace) -> dict[str, list[tuple[int, int]]]:
    lengths, batches = (QUICK_LENGTHS, QUICK_BATCHES) if args.quick else (LENGTHS, BATCHES)
    every = {library: [(b, n) for n in lengths for b in batches] for library in LIBRARIES}
    if not args.cases:
        return every
    known = [case_name(library, b, n) for library, cases in every.items() for b, n in cases]
    if unknown := sorted(set(args.cases) - set(known)):
        raise SystemExit(f"--cases {' '.join(unknown)}: not among this run's cases ({', '.join(known)})")
    return {
        library: [(b, n) for b, n in cases if case_name(library, b, n) in args.cases]
        for library, cases in every.items()
        if any(case_name(library, b, n) in args.cases for b, n in cases)
    }


# ---------------------------------------------------------------------------------------------------------------
# Tables


def table(rows: list[dict]) -> list[str]:
    """The cases as a markdown table: median times, the speed-up, the target and whether it was met."""
    lines = [
        "| case | encoder input | transformers' DeBERTa | accelerated | speed-up | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        target = row["target"]
        met = "-" if target is None else "yes" if row["speedup"] >= target else "no"
        batch, length = row["encoder_input"]
        lines.append(
            f"| {row['case']} | {batch}x{length} | {row['median']['transformers']:.3f} s "
            f"| {row['median']['accelerated']:.3f} s | {row['speedup']:.2f}x "
            f"| {f'{target:g}x' if target is not None else '-'} | {met} |"
        )
    return lines


def markdown(record: dict) -> str:
    """docs/libraries.md's table for one record: where it ran, then the cases (benchmarks.report calls this)."""
    figures = record["figures"]
    shape = "tiny (--quick)" if figures.get("quick") else "DeBERTa-v3-base"
    library_versions = sorted(
        {f"{name} {version}" for row in figures["cases"] for name, version in row["versions"].items()}
        - {f"python {row['versions']['python']}" for row in figures["cases"]}
    )
    lines = [
        f"{record['processor']} ({' '.join(record['extensions']) or 'no listed vector extensions'}), "
        f"{figures['device']}, {figures['dtype']}, {record['threads']} thread{'s' if record['threads'] != 1 else ''}; "
        f"{shape} shape, {figures['layers']} layers; median of {figures['repeats']} interleaved calls; "
        f"{', '.join(library_versions)}; commit {record['commit']}, {record['time'][:10]}. "
        f"Command: `{record['command']}`",
        "",
        *table(figures["cases"]),
    ]
    if figures.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{name} ({why})" for name, why in figures["skipped"].items()) + "."]
    return "\n".join(lines)


NAMES = {"gliner": "GLiNER", "gliner2": "GLiNER2", "crossencoder": "sentence-transformers' CrossEncoder"}
CALLS = {"gliner": "`inference`", "gliner2": "`batch_extract_entities`", "crossencoder": "`predict`"}


def cell(row: dict, targeted: bool = True) -> str:
    """A speed-up as the page shows it: below 1 it says "slower"; under its target it names the target, in a column
    the targets apply to (`targeted`: the 12-layer model)."""
    speedup = row["speedup"]
    times = f"{row['median']['transformers']:.3f} s / {row['median']['accelerated']:.3f} s"
    if speedup < 1.0:
        return f"**{speedup:.2f}x, slower** ({times})"
    if targeted and row["target"] is not None and speedup < row["target"]:
        return f"{speedup:.2f}x, under {row['target']:g}x ({times})"
    return f"{speedup:.2f}x ({times})"


def depths(newest: dict[tuple, tuple[dict, dict]]) -> list[str]:
    """A line comparing each shallower model's speed-ups with the 12-layer model's, per dtype, over the inputs both
    timed: where they are lower, where higher ([] where no input was timed at both depths)."""
    lines = []
    for dtype, layers in sorted({(key[0], key[1]) for key in newest if key[1] != TARGET_LAYERS}):
        both = sorted(
            (tokens, batch)
            for (kind, depth, batch, tokens) in newest
            if (kind, depth) == (dtype, layers) and (dtype, TARGET_LAYERS, batch, tokens) in newest
        )
        if not both:
            continue
        lower, higher = [], []
        for tokens, batch in both:
            shallow = newest[(dtype, layers, batch, tokens)][0]["speedup"]
            deep = newest[(dtype, TARGET_LAYERS, batch, tokens)][0]["speedup"]
            (lower if shallow < deep else higher).append(f"{batch}x{tokens} ({shallow:.2f}x against {deep:.2f}x)")
        said = [f"a lower speed-up at {', '.join(lower)}" if lower else ""]
        said += [f"a higher one at {', '.join(higher)}" if higher else ""]
        lines.append(f"{layers} layers against {TARGET_LAYERS}, {dtype}: " + "; ".join(filter(None, said)) + ".")
    return ["", *lines] if lines else []


def section(records: list[dict]) -> str:
    """docs/libraries.md's generated section: per library, one table per machine (processor and device), a column
    per configuration (dtype and layers) and a row per input; each cell from the newest record that timed that case
    in that configuration. Under each table, the slower cases in words, then each column's records."""
    full = [record for record in records if not record["figures"].get("quick")]
    if not full:
        return "No record yet: `python -m benchmarks.accelerate` writes one."
    lines = []
    for library in LIBRARIES:
        runs = [record for record in full if any(row["library"] == library for row in record["figures"]["cases"])]
        if not runs:
            continue
        lines += [f"### Speed of {NAMES[library]}", ""]
        machines = sorted({(machine.label(record), record["figures"]["device"]) for record in runs})
        for where, device in machines:
            here = [
                record for record in runs if (machine.label(record), record["figures"]["device"]) == (where, device)
            ]
            configurations = sorted(
                {(record["figures"]["dtype"], record["figures"]["layers"]) for record in here},
                key=lambda configuration: (-configuration[1], configuration[0] != "float32", configuration[0]),
            )
            newest: dict[tuple, tuple[dict, dict]] = {}  # (dtype, layers, batch, tokens) -> (row, record)
            for record in here:  # oldest first: a newer record of a case replaces it
                for row in record["figures"]["cases"]:
                    if row["library"] == library:
                        key = (record["figures"]["dtype"], record["figures"]["layers"], row["batch"], row["tokens"])
                        newest[key] = (row, record)
            inputs = sorted({(key[3], key[2]) for key in newest})  # by tokens, then batch
            versions = sorted(
                {
                    f"{name} {version}"
                    for row, _ in newest.values()
                    for name, version in row["versions"].items()
                    if name != "python"
                }
            )
            first, last = min(record["time"][:10] for record in here), max(record["time"][:10] for record in here)
            dates = first if first == last else f"{first} to {last}"
            lines += [
                f"**{NAMES[library]}'s {CALLS[library]}, transformers' DeBERTa time over the accelerated time** "
                f"(median of interleaved calls; DeBERTa-v3-base shape): {here[-1]['processor']} "
                f"({' '.join(here[-1]['extensions']) or 'no listed vector extensions'}), {device.upper()}, "
                f"{here[-1]['threads']} thread{'s' if here[-1]['threads'] != 1 else ''}, {dates}; "
                f"{', '.join(versions)}:",
                "",
                "| input | " + " | ".join(f"{dtype}, {layers} layers" for dtype, layers in configurations) + " |",
                "|---" * (len(configurations) + 1) + "|",
            ]
            for tokens, batch in inputs:
                cells = [
                    cell(newest[(dtype, layers, batch, tokens)][0], targeted=layers == TARGET_LAYERS)
                    if (dtype, layers, batch, tokens) in newest
                    else "-"
                    for dtype, layers in configurations
                ]
                lines.append(f"| {batch}x{tokens} | " + " | ".join(cells) + " |")
            slower = [
                f"{batch}x{tokens} in {dtype} with {layers} layers ({row['speedup']:.2f}x)"
                for (dtype, layers, batch, tokens), (row, _) in sorted(newest.items())
                if row["speedup"] < 1.0
            ]
            lines += [
                "",
                (
                    f"Slower accelerated than not: {'; '.join(slower)}."
                    if slower
                    else "Faster accelerated than not in every case here."
                ),
                *depths(newest),
                "",
                "Measured by:",
                "",
                *[
                    f"- {dtype}, {layers} layers: "
                    + "; ".join(
                        f"{record['time'][:10]}, commit {record['commit']}, {record['figures']['repeats']} calls, "
                        f"`{record['command']}`"
                        for record in here
                        if (record["figures"]["dtype"], record["figures"]["layers"]) == (dtype, layers)
                        and any(found is record for _, found in newest.values())
                    )
                    for dtype, layers in configurations
                ],
                "",
            ]
    skipped = sorted(
        {f"{name} ({why})" for record in full for name, why in record["figures"].get("skipped", {}).items()}
    )
    if skipped:
        lines += ["Not run in some records: " + "; ".join(skipped) + ".", ""]
    return "\n".join(lines).rstrip("\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (hidden 64), 48 tokens, 1 repeat")
    parser.add_argument("--layers", type=int, default=None, help="encoder layers (default 12; 2 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls of each model per case (default 3)")
    parser.add_argument("--cases", nargs="+", metavar="CASE", help="only these: gliner-1x512, crossencoder-8x2048, ...")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda where a GPU is available")
    parser.add_argument("--python", default=None, help="the Python with gliner installed (default: see above)")
    parser.add_argument("--no-record", action="store_true", help="append no record to benchmarks/records/")
    parser.add_argument("--records", type=Path, default=RECORDS, help=argparse.SUPPRESS)  # the tests' own folder
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # library, backbone folder, output JSON
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # the heads GLiNER adds and the classifier it drops are expected
    if args.child:
        library, folder, out = args.child
        rows = time_library(library, chosen_cases(args)[library], Path(folder), args)
        Path(out).write_text(json.dumps(rows))
        return

    layers = args.layers or (2 if args.quick else 12)
    print(f"Processor: {machine.describe()}", flush=True)
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = write_backbone(Path(scratch) / "backbone", layers, args.quick)
        for library, cases in chosen_cases(args).items():
            python = interpreter_for(library, args)
            if python is None:
                skipped[library] = f"{PACKAGES[library]} is not installed" + (
                    f" here nor in {args.python or VENV_PYTHON}" if library == "gliner" else ""
                )
                print(f"{library}: skipped, {skipped[library]}", flush=True)
            elif python == sys.executable:
                rows += time_library(library, cases, folder, args)
            else:
                print(f"{library}: in {python}", flush=True)
                rows += in_child(python, library, cases, folder, args)
    print("\n" + "\n".join(table(rows)))
    if not args.no_record and rows:
        figures = {
            "device": args.device,
            "dtype": args.dtype,
            "layers": layers,
            "quick": args.quick,
            "repeats": args.repeats,
            "threshold": THRESHOLD,
            "labels": LABELS,
            "cases": rows,
            "skipped": skipped,
        }
        command = ["python", "-m", "benchmarks.accelerate", *(argv if argv is not None else sys.argv[1:])]
        append_record("accelerate", figures, command=command, folder=args.records)


if __name__ == "__main__":
    main()
