"""Why did the discriminator not learn? Short RTD runs on real text, one change at a time (issue 28, item 1).

    python -m studies.pretrain_diagnosis                          # every variant, 1 thread (about 25 min)
    python -m studies.pretrain_diagnosis --variants old zero-delta --steps 200

Text: `disentangled.demo.data.python_docs_split` (the Python reference's topics and the standard library's docstrings:
real English that ships with Python), split by source file; a 4,000-piece SentencePiece tokenizer trained on the
training part. Model: `--config tiny` (hidden 64, 4 layers), generator half its depth, 32 x 128 tokens a step, as
`disentangled pretrain` builds them, trained with the objective module and AdamW (linear warm-up then decay) in a
loop of this script so that the optimiser can be varied. Every `--eval-every` steps, on held-out sequences: the
discriminator's exact ROC-AUC on the generator's replacements, its ROC-AUC on tokens replaced by uniformly random
ones, and the generator's accuracy on masked tokens.

Variants (each one change from `old`, the recipe the issue ran, unless it says otherwise):
  old            lr 5e-4, 10% warm-up, one gradient clip (1.0) over both models, E_delta = E_D - E_G at step 0
  zero-delta     E_delta = 0 at step 0 (E_D = E_G), as Microsoft's GDES; the base of the variants below
  lr-1e-4, lr-2e-3       the learning rate
  decoupled      zero-delta, and each model's gradient clipped on its own (Microsoft's decoupled training)
  rtd-weight-1, rtd-weight-50   the weight of the discriminator's loss
  generator-narrow       the generator half as wide (and E_delta on a table of its width: --embedding-sharing none)
  no-clip        zero-delta without gradient clipping
  init-0.1       zero-delta with weights drawn with std 0.1 instead of 0.02 (initializer_range)
  init-0.1-lr-1e-3       the same at learning rate 1e-3 (the tiny preset's recipe now)
  default-1000-steps     that recipe for 1,000 steps (whatever --steps says)
  default-generator-1-layer, default-generator-narrow   that recipe with a weaker generator: one layer of the
                         discriminator's four, or half its width (ELECTRA's advice: a quarter to half the size)

Writes docs/pretraining/diagnosis.json and diagnosis.png, and appends a record to benchmarks/records/pretrain_diagnosis.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent.parent / "docs" / "pretraining"
BASE = dict(lr=5e-4, warmup=0.1, clip="joint", delta="difference", rtd_weight=10.0, generator="half-depth", init=0.02)
VARIANTS = {
    "old": {},
    "zero-delta": dict(delta="zero"),
    "lr-1e-4": dict(delta="zero", lr=1e-4),
    "lr-2e-3": dict(delta="zero", lr=2e-3),
    "decoupled": dict(delta="zero", clip="per-model"),
    "rtd-weight-1": dict(delta="zero", rtd_weight=1.0),
    "rtd-weight-50": dict(delta="zero", rtd_weight=50.0),
    "generator-narrow": dict(delta="zero", generator="half-width"),
    "no-clip": dict(delta="zero", clip="none"),
    "init-0.1": dict(delta="zero", init=0.1),
    "init-0.1-lr-1e-3": dict(delta="zero", init=0.1, lr=1e-3),
    # the recipe `disentangled pretrain --config tiny` uses now (init-0.1-lr-1e-3), longer or with a weaker generator
    "default-1000-steps": dict(delta="zero", init=0.1, lr=1e-3, steps=1000),
    "default-generator-1-layer": dict(delta="zero", init=0.1, lr=1e-3, generator="1-layer"),
    "default-generator-narrow": dict(delta="zero", init=0.1, lr=1e-3, generator="half-width"),
}


def corpus(folder: Path, vocab_size: int, length: int):
    """(tokenizer, training sequences [N, length], held-out sequences [M, length])."""
    from disentangled.demo.data import python_docs_split, train_sentencepiece
    from disentangled.integrations.tokenization import tokenizer_from_spm

    train, held_out = python_docs_split()
    lines = [line for document in train for line in document["text"].splitlines() if line.strip()]
    tokenizer = tokenizer_from_spm(train_sentencepiece(folder / "tokenizer", lines, vocab_size=vocab_size))

    def sequences(documents: list[dict]) -> torch.Tensor:
        pieces = tokenizer([d["text"] for d in documents], add_special_tokens=False)["input_ids"]
        stream = [piece for document in pieces for piece in (*document, tokenizer.sep_token_id)]
        body = length - 2
        rows = [
            [tokenizer.cls_token_id, *stream[start : start + body], tokenizer.sep_token_id]
            for start in range(0, len(stream) - body + 1, body)
        ]
        return torch.tensor(rows)

    return tokenizer, sequences(train), sequences(held_out)


def build(settings: dict, tokenizer, seed: int):
    from disentangled import DisentangledConfig, DisentangledForMaskedLM
    from disentangled.modeling import DisentangledForReplacedTokenDetection
    from disentangled.pretraining import MaskingCollator, ReplacedTokenDetectionPretraining, generator_config
    from disentangled.pretraining.command import PRESETS, V3

    shape = {**PRESETS["tiny"], "initializer_range": settings["init"]}
    config = DisentangledConfig(**V3, **shape, vocab_size=len(tokenizer), pad_token_id=0)
    gen_config = generator_config(config, 1 if settings["generator"] == "1-layer" else None)
    sharing = "gdes"
    if settings["generator"] == "half-width":
        gen_config = generator_config(config, config.num_hidden_layers)
        gen_config.hidden_size, gen_config.intermediate_size = config.hidden_size // 2, config.intermediate_size // 2
        gen_config.num_attention_heads = config.num_attention_heads // 2
        sharing = "none"
    torch.manual_seed(seed)
    discriminator = DisentangledForReplacedTokenDetection(config)
    generator = DisentangledForMaskedLM(gen_config)
    keep = settings["delta"] == "difference"
    module = ReplacedTokenDetectionPretraining(
        generator, discriminator, sharing, settings["rtd_weight"], keep_discriminator_tables=keep
    )
    return module, MaskingCollator(tokenizer, objective="rtd")


@torch.no_grad()
def evaluate(module, masking, held_out: torch.Tensor, seed: int) -> dict:
    from disentangled.pretraining import roc_auc

    module.eval()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    scores, labels, random_scores, random_labels, correct, masked = [], [], [], [], 0, 0
    vocabulary = masking._random_ids
    for batch in held_out.split(64):
        input_ids, mlm_labels = masking.mask(batch)
        out = module(input_ids=input_ids, labels=mlm_labels)
        keep = out.discriminator_labels != -100
        scores.append(out.discriminator_logits[keep])
        labels.append(out.discriminator_labels[keep])
        picked = mlm_labels != -100
        correct += int((out.generator_logits.argmax(-1) == mlm_labels[picked]).sum())  # logits at masked tokens
        masked += int(picked.sum())
        # uniformly random replacements of 15% of the ordinary tokens
        ordinary = ~masking._special[batch]
        replace = ordinary & (torch.rand(batch.shape) < 0.15)
        random_ids = vocabulary[torch.randint(len(vocabulary), batch.shape)]
        corrupted = torch.where(replace, random_ids, batch)
        replaced = corrupted != batch
        logits = module.discriminator(input_ids=corrupted).logits
        random_scores.append(logits.flatten())
        random_labels.append(replaced.flatten().long())
    torch.random.set_rng_state(generator_state)
    module.train()
    return {
        "auc": roc_auc(torch.cat(scores), torch.cat(labels)),
        "random_auc": roc_auc(torch.cat(random_scores), torch.cat(random_labels)),
        "generator_accuracy": correct / max(masked, 1),
    }


def train(name: str, settings: dict, tokenizer, sequences, held_out, steps: int, batch: int, eval_every: int, seed):
    module, masking = build(settings, tokenizer, seed)
    groups = [
        {"params": [p for p in module.generator.parameters() if p.requires_grad]},
        {"params": [p for n, p in module.discriminator.named_parameters() if p.requires_grad]},
    ]
    optimizer = torch.optim.AdamW(groups, lr=settings["lr"], weight_decay=0.01)
    warmup = int(settings["warmup"] * steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / max(warmup, 1), max(0.0, (steps - step) / max(steps - warmup, 1)))
    )
    order = torch.Generator().manual_seed(seed)
    curve = {"step": [], "auc": [], "random_auc": [], "generator_accuracy": [], "train_auc": []}
    started = time.perf_counter()
    window_scores, window_labels = [], []
    from disentangled.pretraining import roc_auc

    for step in range(1, steps + 1):
        rows = sequences[torch.randint(len(sequences), (batch,), generator=order)]
        input_ids, labels = masking.mask(rows)
        out = module(input_ids=input_ids, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        if settings["clip"] == "joint":
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        elif settings["clip"] == "per-model":
            for group in groups:
                torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
        optimizer.step()
        schedule.step()
        keep = out.discriminator_labels != -100
        window_scores.append(out.discriminator_logits[keep])
        window_labels.append(out.discriminator_labels[keep])
        if step % eval_every == 0 or step == steps:
            figures = evaluate(module, masking, held_out, seed + 1)
            curve["step"].append(step)
            curve["train_auc"].append(roc_auc(torch.cat(window_scores), torch.cat(window_labels)))
            window_scores, window_labels = [], []
            for key, value in figures.items():
                curve[key].append(value)
            print(
                f"{name:18s} step {step:4d}  train AUC {curve['train_auc'][-1]:.3f}  held-out AUC {figures['auc']:.3f}"
                f"  random-replacement AUC {figures['random_auc']:.3f}  generator acc {figures['generator_accuracy']:.3f}"
                f"  ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-sequences", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=str(RESULTS / "diagnosis.json"))
    parser.add_argument("--report", action="store_true", help="run nothing: plot and record the results already there")
    parser.add_argument("--no-record", action="store_true", help="append no record (smoke runs)")
    args = parser.parse_args(argv)
    figure = Path(args.output).with_suffix(".png")
    if args.report:
        results = json.loads(Path(args.output).read_text())
        plot(results, figure)
        record(results)
        return 0
    torch.set_num_threads(args.threads)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tokenizer, sequences, held_out = corpus(Path(folder), args.vocab_size, args.length)
    held_out = held_out[: args.eval_sequences]
    print(f"{len(sequences)} training and {len(held_out)} held-out sequences of {args.length} tokens", flush=True)
    output = Path(args.output)
    results = json.loads(output.read_text()) if output.is_file() else {}
    for name in args.variants:
        settings = {**BASE, **VARIANTS[name]}
        steps = settings.pop("steps", args.steps)
        curve = train(name, settings, tokenizer, sequences, held_out, steps, args.batch, args.eval_every, args.seed)
        results[name] = {"settings": settings, "curve": curve, "steps": steps, "seed": args.seed}
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, figure)
    if not args.no_record:
        record(results)
    return 0


def record(results: dict) -> None:
    """One record per report: each variant's settings and held-out figures at every evaluation step."""
    from benchmarks.records import append_record

    figures = {
        name: {"settings": result["settings"], "steps": result["steps"], "seed": result["seed"], **result["curve"]}
        for name, result in results.items()
    }
    append_record("pretrain_diagnosis", figures, command=["python", "-m", "studies.pretrain_diagnosis", *sys.argv[1:]])


def plot(results: dict, path: Path) -> None:
    """The figure as `python -m benchmarks.report` draws it from this study's newest record."""
    from benchmarks import report
    from benchmarks.records import machine_fields

    fields = machine_fields() | {"time": time.strftime("%Y-%m-%d", time.gmtime())}  # UTC, as records are dated
    figures = {name: result["curve"] for name, result in results.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    report.draw(path.name, report.diagnosis_data(fields | {"figures": figures}), path)


if __name__ == "__main__":
    raise SystemExit(main())
