"""`disentangled demo`: the job of docs/getting-started.md, end to end, on a built-in stand-in for a Hub model.

1. train a SentencePiece tokenizer on built-in text (DeBERTa-v3's special ids),
2. pretrain a small DeBERTa-v3-style masked-LM model on built-in templated text with `disentangled pretrain
   --objective mlm` (a short run: nothing can be downloaded here), so that it has learned something to show,
3. export it to transformers' own format (`DebertaV2ForMaskedLM`, laid out as on the Hub: the stand-in for a Hub
   download) and convert that with the verified converter (`disentangled convert`: parity against transformers is
   checked),
4. in a fresh process where the package is hidden, load the converted folder with
   `Auto...from_pretrained(folder, trust_remote_code=True)` and run pipelines on it (fill-mask answers words that fit),
5. fine-tune it there with `Trainer` on a small built-in labelled dataset, printing the accuracy before and after.

The pretraining is masked LM *without* the Enhanced Mask Decoder: transformers' `DebertaV2ForMaskedLM` cannot represent
the decoder (it predicts from the last layer's output), so only a model without it exports to transformers' format
honestly. `disentangled pretrain --objective rtd` trains DeBERTa-v3's own objective (docs/pretraining.md).
`--model microsoft/deberta-v3-xsmall` skips 1-3 and converts that Hub checkpoint instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..configuration.configuration_disentangled import V3_FIELDS
from .data import corpus_lines, pretraining_lines, sentiment_examples, train_sentencepiece, write_rows

CHILD_SCRIPT = Path(__file__).with_name("remote.py")  # run by path: importing it would hide the package here
# A DeBERTa-v3-style encoder (relative attention with c2p + p2c, 256 log buckets, shared keys, normalised relative
# embeddings, no absolute positions), small enough to pretrain and fine-tune in a minute each on 2 CPU cores.
# Weights drawn with std 0.1 (not DeBERTa's 0.02, meant for widths of 384 and more) and no dropout: at width 128 and
# std 0.02 attention stays near uniform for hundreds of steps, and 400 steps teach the templates but not the facts
# (docs/pretraining.md, "What makes a small model learn"). 1,000 steps (about 15 s on 2 cores): after 400 the facts
# were there but fine-tuning from the stand-in lost to random weights on one seed of three; after 1,000 it wins on
# every seed tried (docs/pretraining.md, "The demo's stand-in").
STAND_IN = dict(
    initializer_range=0.1,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=512,
    hidden_act="gelu",
    **V3_FIELDS,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="a DeBERTa Hub id or folder to use instead of the built-in stand-in (needs the Hub)"
    )
    parser.add_argument("--output-dir", help="keep everything here (default: a temporary folder, removed)")
    parser.add_argument("--epochs", type=float, default=3.0, help="fine-tuning epochs")
    parser.add_argument(
        "--learning-rate", type=float, help="fine-tuning learning rate (default 2e-3 built-in, 3e-5 with --model)"
    )
    parser.add_argument(
        "--train-size",
        type=int,
        default=256,
        help="built-in training sentences (256: few enough that pretraining shows; with 768 random weights reach 1.0 too)",
    )
    parser.add_argument("--eval-size", type=int, default=256, help="built-in evaluation sentences")
    parser.add_argument("--pretrain-steps", type=int, default=1000, help="pretraining steps of the built-in stand-in")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if importlib.util.find_spec("accelerate") is None:
        raise ValueError(
            "the demo fine-tunes with transformers' Trainer, which needs accelerate: pip install 'disentangled[train]'"
        )
    if args.pretrain_steps < 1:
        raise ValueError(f"--pretrain-steps must be at least 1, got {args.pretrain_steps}")
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        return _run(args, Path(args.output_dir).absolute(), started)
    with tempfile.TemporaryDirectory(prefix="disentangled-demo-") as folder:
        return _run(args, Path(folder), started)


def _step(text: str) -> float:
    print(f"\n== {text}", flush=True)
    return time.perf_counter()


def _done(started: float) -> None:
    print(f"   ({time.perf_counter() - started:.1f} s)", flush=True)


def _run(args: argparse.Namespace, folder: Path, started: float) -> int:
    import torch

    torch.manual_seed(args.seed)
    source, reached = (args.model, None) if args.model else make_stand_in(folder, args.seed, args.pretrain_steps)

    step = _step(f"converting {source} with the verified converter")
    from ..conversion.convert import convert

    converted = folder / "converted"
    convert(source, converted, force=True, log=lambda line: print(f"   {line}", flush=True))
    _done(step)

    train = write_rows(sentiment_examples(args.train_size, seed=args.seed + 1), folder / "data" / "train.csv")
    evaluation = write_rows(sentiment_examples(args.eval_size, seed=args.seed + 2), folder / "data" / "eval.csv")
    learning_rate = args.learning_rate or (3e-5 if args.model else 2e-3)
    command = [sys.executable, str(CHILD_SCRIPT), str(converted), str(train), str(evaluation), str(folder)]
    command += ["--epochs", str(args.epochs), "--learning-rate", str(learning_rate), "--seed", str(args.seed)]
    command += ["--warmup-steps", "20" if args.model else "0.1"]
    if not args.model:  # the built-in stand-in: show what pretraining added, against the same from random weights
        command += ["--compare-random"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    result_line = ""
    # The child's report, line by line as it comes (its progress bars go straight to stderr).
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, bufsize=1) as child:
        for line in child.stdout:
            if line.startswith("RESULT "):
                result_line = line
            else:
                print(line, end="", flush=True)
    if child.returncode != 0 or not result_line:
        print(f"disentangled demo: the fresh process failed (exit {child.returncode})", file=sys.stderr)
        return 1
    from transformers import AutoTokenizer

    from ..integrations.tokenization import make_tokenizer_portable

    # The child saved with Trainer.save_model where this package is hidden: make that tokenizer load on 4.57 too.
    make_tokenizer_portable(folder / "finetuned", AutoTokenizer.from_pretrained(converted, trust_remote_code=True))
    figures = dict(part.split("=") for part in result_line.split()[1:])
    print(
        f"\ndemo done in {time.perf_counter() - started:.0f} s: {reached + ', ' if reached else ''}"
        "converted, loaded with trust_remote_code, pipelines "
        f"run, fine-tuned from accuracy {float(figures['accuracy_before']):.3f} to "
        f"{float(figures['accuracy_after']):.3f}"
        + (
            f" (from random weights: {float(figures['accuracy_random']):.3f})"
            if figures.get("accuracy_random", "nan") != "nan"
            else ""
        )
    )
    if args.output_dir:
        kept = "converted/, finetuned/" if args.model else "pretrained/, source/ (the stand-in), converted/, finetuned/"
        print(f"kept in {folder}: {kept}")
    return 0


def make_stand_in(folder: Path, seed: int, steps: int) -> tuple[str, str]:
    """Steps 1-3: a SentencePiece tokenizer, a short `disentangled pretrain --objective mlm` run on built-in text,
    exported to transformers' format in `folder/source` (the stand-in for a Hub download); returns that folder and
    what the pretraining reached."""
    step = _step("tokenizer: a SentencePiece model trained on built-in text")
    text = pretraining_lines(3000, seed=seed) + corpus_lines(1000, seed=seed)  # + random word order: every word
    spm_file = train_sentencepiece(folder / "tokenizer", text, vocab_size=110)
    from ..integrations.tokenization import tokenizer_from_spm

    tokenizer = tokenizer_from_spm(spm_file, check_text="the quick brown fox sat on the mat")
    print(
        f"   {len(tokenizer)} tokens; special ids {dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))}"
    )
    print(f"   'paris is the capital of france' -> {tokenizer.tokenize('paris is the capital of france')}")
    _done(step)

    pretrained, reached = pretrain_stand_in(folder, spm_file, len(tokenizer), seed, steps)

    step = _step("checkpoint: the pretrained model in transformers' own format, DebertaV2ForMaskedLM (stand-in)")
    from ..conversion.export import export_transformers

    source = folder / "source"
    export_transformers(pretrained, source, force=True, log=lambda line: print(f"   {line}", flush=True))
    print(
        "   a stand-in for a Hub download: transformers' DebertaV2ForMaskedLM predicts from the last layer, so the "
        "demo pretrains without the Enhanced Mask Decoder, which that class cannot represent"
    )
    print(f"   wrote {source}: {', '.join(sorted(p.name for p in source.iterdir()))}")
    _done(step)
    return str(source), reached


def pretrain_stand_in(folder: Path, spm_file: Path, vocab_size: int, seed: int, steps: int) -> tuple[Path, str]:
    """Step 2: `disentangled pretrain --objective mlm` in a subprocess on built-in templated sentences; prints the
    command and what the run reached (loss and accuracy on masked tokens, first and last log)."""
    from ..configuration import DisentangledConfig

    step = _step(f"pretraining: {steps} steps of masked LM on built-in text (`disentangled pretrain`)")
    data = folder / "pretraining"
    data.mkdir(parents=True, exist_ok=True)
    lines = pretraining_lines(20000, seed=seed + 3)
    (data / "train.txt").write_text("\n".join(lines) + "\n")
    config = DisentangledConfig(vocab_size=vocab_size, legacy=False, **STAND_IN)  # legacy=False: v3's head layout
    config.save_pretrained(data / "config")
    print(f"   {len(lines):,} templated sentences, e.g. {lines[0]!r}, {lines[1]!r}")
    pretrained = folder / "pretrained"
    arguments = ["--objective", "mlm", "--no-enhanced-mask-decoder", "--train-file", str(data / "train.txt")]
    arguments += ["--line-by-line"]  # one sentence a sequence: a fact is never cut, nor mixed with other facts
    arguments += ["--tokenizer", str(spm_file), "--config", str(data / "config"), "--max-seq-length", "32"]
    arguments += ["--max-steps", str(steps), "--per-device-train-batch-size", "32", "--learning-rate", "2e-3"]
    arguments += ["--warmup-steps", str(steps // 10), "--logging-steps", str(max(1, steps // 10))]
    arguments += ["--save-strategy", "no", "--report-to", "none", "--seed", str(seed), "--disable-tqdm", "true"]
    arguments += ["--output-dir", str(pretrained)]
    print("   disentangled pretrain " + " ".join(arguments), flush=True)
    command = [sys.executable, "-m", "disentangled.cli", "pretrain", *arguments]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"the pretraining run failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    logs = json.loads((pretrained / "trainer_state.json").read_text())["log_history"]
    logged = [entry for entry in logs if "masked_accuracy" in entry]
    first, last = logged[0], logged[-1]
    print(
        f"   reached: loss on masked tokens {first['mlm_loss']:.2f} (step {first['step']}) -> {last['mlm_loss']:.2f} "
        f"(step {last['step']}); accuracy on masked tokens {first['masked_accuracy']:.3f} -> "
        f"{last['masked_accuracy']:.3f} (a uniform guess: {1 / vocab_size:.3f})"
    )
    _done(step)
    return pretrained, f"pretrained {steps} steps to {last['masked_accuracy']:.3f} accuracy on masked tokens"
