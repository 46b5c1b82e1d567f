"""`disentangled demo`: the README's main job, end to end, on a built-in stand-in for a Hub model.

1. train a SentencePiece tokenizer on built-in text (DeBERTa-v3's special ids),
2. make a small DeBERTa-v3-style checkpoint in transformers' own format (`DebertaV2ForMaskedLM`, random weights:
   nothing can be downloaded here) with that tokenizer, laid out as on the Hub,
3. convert it with the verified converter (`disentangled convert`: parity against transformers is checked),
4. in a fresh process where the package is hidden, load the converted folder with
   `Auto...from_pretrained(folder, trust_remote_code=True)` and run pipelines on it,
5. fine-tune it there with `Trainer` on a small built-in labelled dataset, printing the accuracy before and after.

`--model microsoft/deberta-v3-xsmall` skips 1-2 and converts that Hub checkpoint instead.
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

from .data import corpus_lines, sentiment_examples, train_sentencepiece, write_rows

CHILD_SCRIPT = Path(__file__).with_name("demo_remote.py")  # run by path: importing it would hide the package here
# A DeBERTa-v3-style encoder (relative attention with c2p + p2c, 256 log buckets, shared keys, normalised relative
# embeddings, no absolute positions), small enough to fine-tune in a minute on 2 CPU cores.
STAND_IN = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=512,
    max_position_embeddings=512,
    relative_attention=True,
    position_buckets=256,
    max_relative_positions=-1,
    pos_att_type=["p2c", "c2p"],
    share_att_key=True,
    norm_rel_ebd="layer_norm",
    position_biased_input=False,
    type_vocab_size=0,
    layer_norm_eps=1e-7,
    hidden_act="gelu",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="a DeBERTa Hub id or folder to use instead of the built-in stand-in (needs the Hub)"
    )
    parser.add_argument("--output-dir", help="keep everything here (default: a temporary folder, removed)")
    parser.add_argument("--epochs", type=float, default=2.0, help="fine-tuning epochs")
    parser.add_argument(
        "--learning-rate", type=float, help="fine-tuning learning rate (default 2e-3 built-in, 3e-5 with --model)"
    )
    parser.add_argument("--train-size", type=int, default=768, help="built-in training sentences")
    parser.add_argument("--eval-size", type=int, default=256, help="built-in evaluation sentences")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if importlib.util.find_spec("accelerate") is None:
        raise ValueError(
            "the demo fine-tunes with transformers' Trainer, which needs accelerate: pip install 'disentangled[train]'"
        )
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
    source = args.model or str(make_stand_in(folder / "source", args.seed))

    step = _step(f"converting {source} with the verified converter")
    from .conversion.convert import convert

    converted = folder / "converted"
    convert(source, converted, force=True, log=lambda line: print(f"   {line}", flush=True))
    _done(step)

    train = write_rows(sentiment_examples(args.train_size, seed=args.seed + 1), folder / "data" / "train.csv")
    evaluation = write_rows(sentiment_examples(args.eval_size, seed=args.seed + 2), folder / "data" / "eval.csv")
    learning_rate = args.learning_rate or (3e-5 if args.model else 2e-3)
    command = [sys.executable, str(CHILD_SCRIPT), str(converted), str(train), str(evaluation), str(folder)]
    command += ["--epochs", str(args.epochs), "--learning-rate", str(learning_rate), "--seed", str(args.seed)]
    if args.model:
        command += ["--warmup-steps", "20"]
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
    figures = dict(part.split("=") for part in result_line.split()[1:])
    print(
        f"\ndemo done in {time.perf_counter() - started:.0f} s: converted, loaded with trust_remote_code, pipelines "
        f"run, fine-tuned from accuracy {float(figures['accuracy_before']):.3f} to "
        f"{float(figures['accuracy_after']):.3f}"
    )
    if args.output_dir:
        print(f"kept in {folder}: source/ (the stand-in), converted/, finetuned/")
    return 0


def make_stand_in(folder: Path, seed: int) -> Path:
    """Steps 1-2: a SentencePiece tokenizer and a random DeBERTa-v3-style checkpoint in transformers' format."""
    import torch
    import transformers

    from .tokenization import tokenizer_from_spm

    step = _step("tokenizer: a SentencePiece model trained on built-in text")
    spm_file = train_sentencepiece(folder, corpus_lines(3000, seed=seed), vocab_size=100)
    tokenizer = tokenizer_from_spm(spm_file, check_text="the quick brown fox sat on the mat")
    print(
        f"   {len(tokenizer)} tokens; special ids {dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))}"
    )
    print(f"   'paris is the capital of france' -> {tokenizer.tokenize('paris is the capital of france')}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False, "vocab_type": "spm"}))
    _done(step)

    step = _step("checkpoint: a small DeBERTa-v3-style DebertaV2ForMaskedLM in transformers' format (stand-in)")
    config = transformers.DebertaV2Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **STAND_IN)
    torch.manual_seed(seed)
    model = transformers.DebertaV2ForMaskedLM(config)
    model.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"   {parameters:,} parameters: hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads, terms {config.pos_att_type}, {config.position_buckets} position buckets; "
        "random weights (a stand-in for a Hub download, so its fill-mask guesses are arbitrary)"
    )
    print(f"   wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}")
    _done(step)
    return folder
