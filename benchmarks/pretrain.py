"""The DeBERTa-v3 paper's pretraining comparison in miniature: MLM, RTD + `none`, RTD + `es`, RTD + `gdes`.

    python -m benchmarks.pretrain            # the run behind README.md's Pretraining table (see below for time)
    python -m benchmarks.pretrain --quick    # a smoke run: a few steps, tiny fine-tuning (the test suite runs it)

README's run took 19 minutes with --threads 1 on a 2-core machine shared with six other jobs; on an idle one it is
shorter (the four pretraining runs are about three quarters of it).

Text: `disentangled.data.pretraining_lines`, built-in templated sentences with facts and agreement to learn (each
city is the capital of one country, a sentence's sentiment words agree), seeded; one SentencePiece tokenizer for all.
Every mode trains the same discriminator (`--config tiny`: hidden 64, 4 layers; RTD's generator: half its depth, with
the Enhanced Mask Decoder) for the same steps on the same batches of tokens with `disentangled pretrain`, then:

- each encoder (the discriminator; for MLM the model) is fine-tuned with `Trainer` on the same downstream tasks,
  alongside one with no pretraining: `sentiment` (built-in sentences, held-out evaluation set) and `capitals`
  ("CITY is the capital of COUNTRY." true or false; fine-tuned on four cities, evaluated on the other two, so only
  facts learned in pretraining transfer);
- held-out pretraining metrics: the discriminator's ROC-AUC on replaced tokens and the generator's accuracy on masked
  tokens (for MLM: the model's own accuracy on masked tokens);
- the embedding analysis of the v3 paper (its Table 2): the average pairwise cosine similarity of the token embeddings
  within the generator and within the discriminator, and the average cosine similarity between the generator's and the
  discriminator's embedding of the same token;
- speed: an RTD step (forward + backward of generator, sampling, labels, sharing, discriminator) against a generator
  step plus a discriminator step timed alone on the same batch (interleaved, medians), and the tokens/s the data
  pipeline (tokenizing and grouping; the collator) sustains against the tokens/s training consumes.

Writes benchmarks/results/pretrain.json and pretrain.png (pretrain-quick.* with --quick).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from benchmarks import machine

RESULTS = Path(__file__).parent / "results"
MODES = ("mlm", "rtd-none", "rtd-es", "rtd-gdes")
COLORS = dict(zip(MODES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52")))
TASKS = ("sentiment", "capitals")
FULL = dict(steps=300, batch=32, length=32, sentences=20000, train_size=768, eval_size=256, epochs=2.0, repeats=15)
QUICK = dict(steps=6, batch=8, length=32, sentences=600, train_size=48, eval_size=32, epochs=1.0, repeats=2)


def pretrain_arguments(mode: str, data: Path, output: Path, settings: dict, seed: int) -> list[str]:
    """The `disentangled pretrain` command line of one mode (every mode: same config, steps, batch and seed)."""
    objective, _, sharing = mode.partition("-")
    arguments = ["--objective", objective] + (["--embedding-sharing", sharing] if sharing else [])
    arguments += ["--train-file", str(data / "train.txt"), "--validation-file", str(data / "validation.txt")]
    arguments += ["--tokenizer", str(data / "tokenizer" / "spm.model"), "--config", "tiny"]
    arguments += ["--max-seq-length", str(settings["length"]), "--max-steps", str(settings["steps"])]
    arguments += ["--per-device-train-batch-size", str(settings["batch"]), "--per-device-eval-batch-size", "64"]
    arguments += ["--learning-rate", "2e-3", "--warmup-steps", str(max(1, settings["steps"] // 10))]
    arguments += ["--logging-steps", str(max(1, settings["steps"] // 20)), "--do-eval", "--seed", str(seed)]
    arguments += ["--save-strategy", "no", "--report-to", "none", "--disable-tqdm", "true"]
    return arguments + ["--output-dir", str(output)]


def write_data(folder: Path, settings: dict, seed: int):
    """Training and validation text and the shared tokenizer; returns the tokenizer."""
    from disentangled.data import corpus_lines, pretraining_lines, train_sentencepiece
    from disentangled.tokenization import tokenizer_from_spm

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text("\n".join(pretraining_lines(settings["sentences"], seed=seed)) + "\n")
    (folder / "validation.txt").write_text("\n".join(pretraining_lines(2000, seed=seed + 1)) + "\n")
    text = pretraining_lines(3000, seed=seed + 2) + corpus_lines(1000, seed=seed + 2)  # every built-in word
    spm_file = train_sentencepiece(folder / "tokenizer", text, vocab_size=110)
    return tokenizer_from_spm(spm_file, check_text="paris is the capital of france.")


def pretrain(mode: str, data: Path, output: Path, settings: dict, seed: int) -> dict:
    """Run the command in this process; its logs, held-out metrics, speed and wall time."""
    from disentangled import cli

    arguments = pretrain_arguments(mode, data, output, settings, seed)
    started = time.perf_counter()
    code = cli.main(["pretrain", *arguments])
    wall = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"disentangled pretrain failed for {mode} (exit {code})")
    state = json.loads((output / "trainer_state.json").read_text())
    train = json.loads((output / "train_results.json").read_text())
    evaluation = json.loads((output / "eval_results.json").read_text())
    rtd = mode != "mlm"
    curves = {"step": [], "generator_loss": [], "discriminator_loss": [], "discriminator_auc": []}
    for entry in state["log_history"]:
        if "loss" not in entry:
            continue
        curves["step"].append(entry["step"])
        curves["generator_loss"].append(entry["generator_loss" if rtd else "mlm_loss"])
        curves["discriminator_loss"].append(entry.get("discriminator_loss"))
        curves["discriminator_auc"].append(entry.get("discriminator_auc"))
    return {
        "command": ("disentangled pretrain " + " ".join(arguments)).replace(str(data.parent), "WORK"),
        "wall_s": wall,
        "train_s": train["train_runtime"],
        "tokens_per_s": train["train_samples_per_second"] * settings["length"],
        "eval_discriminator_auc": evaluation.get("eval_discriminator_auc"),
        "eval_generator_accuracy": evaluation.get("eval_generator_accuracy" if rtd else "eval_masked_accuracy"),
        "curves": curves,
    }


def embedding_similarity(output: Path, mode: str) -> dict:
    """The v3 paper's Table 2 (average pairwise cosine similarity of token embeddings within each model) and the
    average cosine similarity between the generator's and the discriminator's embedding of each token."""
    from disentangled import DisentangledForMaskedLM
    from disentangled.modeling import DisentangledForReplacedTokenDetection

    def within(table: torch.Tensor) -> float:
        unit = torch.nn.functional.normalize(table, dim=-1)
        similarity = unit @ unit.T
        count = len(table)
        return float((similarity.sum() - similarity.diagonal().sum()) / (count * (count - 1)))

    if mode == "mlm":
        table = DisentangledForMaskedLM.from_pretrained(output).deberta.embeddings.word_embeddings.weight.detach()
        return {"generator": None, "discriminator": within(table), "between": None}
    generator = DisentangledForMaskedLM.from_pretrained(output / "generator")
    discriminator = DisentangledForReplacedTokenDetection.from_pretrained(output / "discriminator")
    gen_table = generator.deberta.embeddings.word_embeddings.weight.detach()
    disc_table = discriminator.deberta.embeddings.word_embeddings.weight.detach()
    between = torch.nn.functional.cosine_similarity(gen_table, disc_table, dim=-1).mean()
    return {"generator": within(gen_table), "discriminator": within(disc_table), "between": float(between)}


def fine_tune(encoder: Path | None, tokenizer, task: str, settings: dict, seed: int, work: Path) -> float:
    """Accuracy on the task's evaluation set after fine-tuning `encoder` (None: the same model, no pretraining)."""
    from disentangled import DisentangledConfig, DisentangledForSequenceClassification
    from disentangled.data import CITIES, capital_examples, sentiment_examples
    from disentangled.pretrain import PRESETS, V3

    if task == "sentiment":
        train = sentiment_examples(settings["train_size"], seed=seed + 10)
        evaluation = sentiment_examples(settings["eval_size"], seed=seed + 11)
        labels = ["negative", "positive"]
    else:  # fine-tune on four cities, evaluate on the two it never saw labelled
        train = capital_examples(settings["train_size"], cities=CITIES[:4], seed=seed + 10)
        evaluation = capital_examples(settings["eval_size"], cities=CITIES[4:], seed=seed + 11)
        labels = ["false", "true"]
    label2id = {label: index for index, label in enumerate(labels)}

    def encode(rows):
        encoded = tokenizer([row["text"] for row in rows])["input_ids"]
        return [{"input_ids": ids, "labels": label2id[row["label"]]} for ids, row in zip(encoded, rows)]

    torch.manual_seed(seed)
    if encoder is None:
        config = DisentangledConfig(**V3, **PRESETS["tiny"], vocab_size=len(tokenizer), pad_token_id=0, num_labels=2)
        model = DisentangledForSequenceClassification(config)
    else:
        model = DisentangledForSequenceClassification.from_pretrained(encoder, num_labels=2)
    arguments = transformers.TrainingArguments(
        output_dir=str(work),
        num_train_epochs=settings["epochs"],
        learning_rate=2e-3,  # the demo's recipe
        per_device_train_batch_size=16,
        per_device_eval_batch_size=64,
        save_strategy="no",
        report_to="none",
        seed=seed,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )

    def accuracy(prediction) -> dict[str, float]:
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    trainer = transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=encode(train),
        eval_dataset=encode(evaluation),
        data_collator=transformers.DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    trainer.train()
    return trainer.evaluate()["eval_accuracy"]


def median_times(steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each step function, called interleaved after one warm-up round."""
    times = {name: [] for name in steps}
    for round_index in range(repeats + 1):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            if round_index:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def speed(tokenizer, data: Path, settings: dict, seed: int) -> dict:
    """RTD step vs generator step + discriminator step alone (same batch), and the data pipeline's tokens/s.

    As the command trains: the data loader pads (`PaddingCollator`), the objective masks in its forward. The RTD step
    therefore includes masking, the generator, sampling, labels, sharing and the discriminator; the two steps alone
    read the same batch already masked (generator) and already corrupted (discriminator)."""
    from disentangled import DisentangledConfig, DisentangledForMaskedLM
    from disentangled.modeling import DisentangledForReplacedTokenDetection
    from disentangled.pretrain import PRESETS, V3
    from disentangled.pretraining import (
        MaskingCollator,
        PaddingCollator,
        ReplacedTokenDetectionPretraining,
        generator_config,
    )
    from disentangled.pretraining_data import load_texts, tokenize_and_group

    texts = load_texts([data / "train.txt"], "text", "--train-file")
    started = time.perf_counter()
    grouped = tokenize_and_group(texts, tokenizer, settings["length"])
    tokenize_s = time.perf_counter() - started
    padding, masking = PaddingCollator(tokenizer), MaskingCollator(tokenizer, objective="rtd")
    rows = [grouped[index] for index in range(min(len(grouped), 64 * settings["batch"]))]
    started = time.perf_counter()
    batches = [padding(rows[start : start + settings["batch"]]) for start in range(0, len(rows), settings["batch"])]
    padding_s = time.perf_counter() - started
    started = time.perf_counter()
    for batch in batches:
        masking.mask(batch["input_ids"], batch["attention_mask"])
    masking_s = time.perf_counter() - started
    tokens = len(rows) * settings["length"]
    pipeline = {
        "tokenize_and_group_tokens_per_s": len(grouped) * settings["length"] / tokenize_s,
        "padding_collator_tokens_per_s": tokens / padding_s,
        "masking_tokens_per_s": tokens / masking_s,
    }

    torch.manual_seed(seed)
    config = DisentangledConfig(**V3, **PRESETS["tiny"], vocab_size=len(tokenizer), pad_token_id=0)
    generator = DisentangledForMaskedLM(generator_config(config)).train()
    discriminator = DisentangledForReplacedTokenDetection(config).train()
    batch = batches[0]
    masked_ids, labels = masking.mask(batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():  # the discriminator alone reads a batch corrupted as RTD corrupts it
        module = ReplacedTokenDetectionPretraining(generator, DisentangledForReplacedTokenDetection(config), "none")
        made = module(masked_ids, batch["attention_mask"], labels)
    modules = {
        sharing: ReplacedTokenDetectionPretraining(
            DisentangledForMaskedLM(generator_config(config)),
            DisentangledForReplacedTokenDetection(config),
            sharing,
            masking=masking,
        ).train()
        for sharing in ("none", "es", "gdes")
    }

    def backward(model, **inputs):
        def step():
            model.zero_grad(set_to_none=True)
            model(**inputs).loss.backward()

        return step

    attention_mask = batch["attention_mask"]
    steps = {
        "generator": backward(generator, input_ids=masked_ids, attention_mask=attention_mask, labels=labels),
        "discriminator": backward(
            discriminator,
            input_ids=made.discriminator_input_ids,
            attention_mask=attention_mask,
            labels=made.discriminator_labels,
        ),
    }
    steps.update({f"rtd-{sharing}": backward(module, **batch) for sharing, module in modules.items()})
    times = median_times(steps, settings["repeats"])
    alone = times["generator"] + times["discriminator"]
    return {
        "batch": f"{settings['batch']}x{settings['length']}",
        "seconds": times,
        "ratio": {name: times[name] / alone for name in times if name.startswith("rtd-")},
        "pipeline": pipeline,
    }


def plot(report: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 3.6), layout="constrained")
    axes = figure.subplots(1, 3)
    panels = (
        ("generator_loss", "generator MLM loss (MLM: the model's)"),
        ("discriminator_loss", "discriminator RTD loss"),
        ("discriminator_auc", "discriminator ROC-AUC (training batches)"),
    )
    for axis, (name, title) in zip(axes, panels):
        for mode, result in report["modes"].items():
            curves = result["pretraining"]["curves"]
            points = [(s, v) for s, v in zip(curves["step"], curves[name]) if v is not None]
            if points:
                axis.plot(*zip(*points), marker=".", label=mode, color=COLORS[mode])
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(f"`{report['command']}`: {report['settings_text']}", fontsize=9)
    figure.savefig(path, dpi=110)


def markdown(report: dict) -> str:
    def number(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| mode | sentiment acc. | capitals acc. (held-out cities) | discriminator ROC-AUC | generator acc. "
        "| emb. cos G / D (within) | emb. cos G-D (same token) | tokens/s | wall time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    baseline = report["no_pretraining"]
    lines.append(
        f"| no pretraining | {number(baseline['sentiment'])} | {number(baseline['capitals'])} | - | - | - | - | - | - |"
    )
    for mode, result in report["modes"].items():
        pre, emb, down = result["pretraining"], result["embeddings"], result["downstream"]
        lines.append(
            f"| {mode} | {number(down['sentiment'])} | {number(down['capitals'])} "
            f"| {number(pre['eval_discriminator_auc'])} | {number(pre['eval_generator_accuracy'])} "
            f"| {number(emb['generator'], 2)} / {number(emb['discriminator'], 2)} | {number(emb['between'], 2)} "
            f"| {pre['tokens_per_s']:,.0f} | {pre['wall_s']:.0f} s |"
        )
    fast = report["speed"]
    seconds = fast["seconds"]
    lines += [
        "",
        f"Speed, batch {fast['batch']}, forward + backward (RTD: with masking), median of {report['settings']['repeats']} interleaved runs: "
        f"generator alone {seconds['generator'] * 1e3:.1f} ms + discriminator alone "
        f"{seconds['discriminator'] * 1e3:.1f} ms = {(seconds['generator'] + seconds['discriminator']) * 1e3:.1f} ms; "
        + ", ".join(
            f"{name} step {seconds[name] * 1e3:.1f} ms (ratio {fast['ratio'][name]:.2f})" for name in fast["ratio"]
        )
        + " (target: at most 1.10).",
        f"Data pipeline: tokenizing and grouping {fast['pipeline']['tokenize_and_group_tokens_per_s']:,.0f} tokens/s "
        f"(once, cached), padding into batches {fast['pipeline']['padding_collator_tokens_per_s']:,.0f} tokens/s, "
        f"masking {fast['pipeline']['masking_tokens_per_s']:,.0f} tokens/s; training consumes "
        f"{max(r['pretraining']['tokens_per_s'] for r in report['modes'].values()):,.0f} tokens/s at most.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few steps, tiny fine-tuning")
    parser.add_argument("--steps", type=int, help="pretraining steps per mode (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    if args.steps:
        settings["steps"] = args.steps
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python -m benchmarks.pretrain " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {
        "command": command.strip(),
        "machine": f"{machine.describe()}, transformers {transformers.__version__}",
        "seed": args.seed,
        "settings": settings,
        "settings_text": f"--config tiny, {settings['steps']} steps of {settings['batch']}x{settings['length']} "
        f"tokens, seed {args.seed}",
        "modes": {},
    }
    print(f"{report['command']} on {report['machine']}: {report['settings_text']}", flush=True)
    started = time.perf_counter()
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="pretrain-benchmark-") as folder:
        folder = Path(folder)
        tokenizer = write_data(folder / "data", settings, args.seed)
        report["no_pretraining"] = {
            task: fine_tune(None, tokenizer, task, settings, args.seed, folder / "finetune") for task in TASKS
        }
        print(f"no pretraining: {report['no_pretraining']}", flush=True)
        for mode in args.modes:
            output = folder / mode
            result = {"pretraining": pretrain(mode, folder / "data", output, settings, args.seed)}
            transformers.logging.set_verbosity_error()
            print(f"{mode}: {result['pretraining']['command']}", flush=True)
            result["embeddings"] = embedding_similarity(output, mode)
            encoder = output if mode == "mlm" else output / "discriminator"
            result["downstream"] = {
                task: fine_tune(encoder, tokenizer, task, settings, args.seed, folder / "finetune") for task in TASKS
            }
            report["modes"][mode] = result
            summary = {key: value for key, value in result["pretraining"].items() if key not in ("curves", "command")}
            print(f"{mode}: {summary} {result['embeddings']} {result['downstream']}", flush=True)
        report["speed"] = speed(tokenizer, folder / "data", settings, args.seed)
    report["total_s"] = time.perf_counter() - started
    report["markdown"] = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "pretrain-quick" if args.quick else "pretrain"
    plot(report, args.out / f"{name}.png")
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2))
    print(f"\n`{report['command']}` on {report['machine']}, {report['total_s']:.0f} s in all\n")
    print(report["markdown"])
    return report


if __name__ == "__main__":
    main()
