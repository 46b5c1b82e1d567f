"""Does pretraining transfer? The DeBERTa-v3 paper's comparison in miniature, over seeds, on real and generated text.

    python -m studies.pretrain                         # 3 seeds, both corpora, 2 worker processes of 1 thread each
    python -m studies.pretrain --seeds 0 --corpora generated --workers 1
    python -m studies.pretrain --quick --out DIR       # a smoke run: a few steps (the test suite runs it)
    python -m studies.pretrain --speed                 # also time an RTD step against its two models' steps alone

Five arms on each corpus and seed: no pretraining, masked LM, and replaced-token detection with each embedding sharing
(`none`, `es`, `gdes`). Every pretrained arm is `disentangled pretrain --config tiny` (hidden 64, 4 layers; RTD's
generator half its depth) with the command's own default recipe for that shape (the learning rate and warm-up it
prints), the same steps and batches; then every encoder, and a randomly initialised one, is

- fine-tuned with `Trainer` on each downstream task at each learning rate of `--learning-rates`, the rate chosen by
  the balanced accuracy on the task's validation split, the test split scored once at that rate (no arm loses to a
  bad rate);
- probed: a logistic regression on frozen features, once on the [CLS] state and once on the mean of the token states
  (its L2 weight chosen on validation): does pretraining put content into [CLS], or only into the tokens?

Corpora and tasks (labels that depend on what the corpus teaches):
- `generated`: `disentangled.demo.data.pretraining_lines`, templated sentences with facts and agreement, one sentence a
  sequence of 32 tokens. `sentiment`: neutral words around one sentiment word (the corpus teaches which words go
  with "love" and which with "hate"). `capitals`: "CITY is the capital of COUNTRY." true or false, fine-tuned on
  four cities and their countries, tested on the other two: only facts learned in pretraining transfer. Six cities
  leave none to validate on apart from the test's, so its learning rate is chosen on other sentences of the
  training cities (what fits best, not what transfers best).
- `real`: `disentangled.demo.data.python_docs_split`, Python's reference manual and the standard library's docstrings
  (English written by people, shipped with Python), split by source file, 128-token sequences. `topics`: which of
  four packages (asyncio, email, tkinter, xml) a docstring comes from; trained and validated on documents of the
  pretraining split, tested on the held-out files' documents, which pretraining never saw.

Reported per corpus, task and arm: the test balanced accuracy (chance 1 / classes) at the chosen rate, mean, standard
deviation and range over seeds; the probes; the discriminator's held-out ROC-AUC on the generator's replacements and
on uniformly random ones, the generator's (or MLM model's) held-out accuracy on masked tokens. Appends a record to
benchmarks/records/pretrain.jsonl (the manual's table and figure are generated from it: `python -m benchmarks.report`);
--quick writes DIR/pretrain-quick.json instead.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from disentangled.pretraining.command import SCRATCH_LEARNING_RATES

ARMS = ("none", "mlm", "rtd-none", "rtd-es", "rtd-gdes")
MODES = ARMS[1:]  # the pretrained arms
CORPORA = {
    "generated": dict(length=32, line_by_line=True, tasks=("sentiment", "capitals"), vocab_size=110),
    "real": dict(length=128, line_by_line=False, tasks=("topics",), vocab_size=4000),
}
FULL = dict(steps=300, batch=32, epochs=3.0, learning_rates=(3e-4, 1e-3, 3e-3), lines=None, rows=None)
QUICK = dict(steps=4, batch=8, epochs=1.0, learning_rates=(1e-3, 3e-3), lines=160, rows=16)  # rows: of each split
SPEED_REPEATS = {"full": 15, "quick": 2}  # --speed: timed rounds of each step (a smoke run only sees that they run)


# -- the data ---------------------------------------------------------------------------------------------------


def write_corpus(name: str, folder: Path, settings: dict) -> dict:
    """Pretraining text (train.txt, validation.txt), a SentencePiece tokenizer, and each task's three splits."""
    from disentangled.demo import data

    folder.mkdir(parents=True, exist_ok=True)
    if name == "generated":
        train = data.pretraining_lines(20000, seed=0)
        validation = data.pretraining_lines(2000, seed=1)
        tokenizer_text = data.pretraining_lines(3000, seed=2) + data.corpus_lines(1000, seed=2)  # every built-in word
        cities = data.CITIES
        tasks = {
            "sentiment": dict(
                train=data.sentiment_examples(256, seed=10),
                validation=data.sentiment_examples(256, seed=12),
                test=data.sentiment_examples(512, seed=11),
            ),
            "capitals": dict(
                train=data.capital_examples(256, cities=cities[:4], seed=10),
                validation=data.capital_examples(128, cities=cities[:4], seed=12),  # the training cities: see below
                test=data.capital_examples(256, cities=cities[4:], seed=11),
            ),
        }
    else:
        train_documents, held_out = data.python_docs_split()
        train = [line for document in train_documents for line in document["text"].splitlines() if line.strip()]
        validation = [line for document in held_out for line in document["text"].splitlines() if line.strip()]
        tokenizer_text = train
        labelled = data.python_docs_topics(train_documents, seed=0)
        by_topic = {topic: [row for row in labelled if row["label"] == topic] for topic in data.TOPIC_PACKAGES}
        tasks = {
            "topics": dict(  # 80 documents of each topic to train on, up to 40 more to choose the learning rate
                train=[row for rows in by_topic.values() for row in rows[:80]],
                validation=[row for rows in by_topic.values() for row in rows[80:120]],
                test=data.python_docs_topics(held_out, seed=0),
            )
        }
        for rows in tasks["topics"].values():
            random.Random(0).shuffle(rows)
    train, validation = train[: settings["lines"]], validation[: settings["lines"]]
    tasks = {task: {name: rows[: settings["rows"]] for name, rows in splits.items()} for task, splits in tasks.items()}
    (folder / "train.txt").write_text("\n".join(train) + "\n")
    (folder / "validation.txt").write_text("\n".join(validation) + "\n")
    data.train_sentencepiece(folder / "tokenizer", tokenizer_text, vocab_size=CORPORA[name]["vocab_size"])
    (folder / "tasks.json").write_text(json.dumps(tasks))
    return {"folder": str(folder), "words": sum(len(line.split()) for line in train)}


# -- one arm's pretraining ------------------------------------------------------------------------------------------


def pretrain_arguments(mode: str, corpus: str, data: Path, output: Path, settings: dict, seed: int) -> list[str]:
    """`disentangled pretrain` for one mode: the same shape, steps, batches and seed for every mode, and the command's
    default learning rate and warm-up for the tiny shape from scratch."""
    objective, _, sharing = mode.partition("-")
    arguments = ["--objective", objective] + (["--embedding-sharing", sharing] if sharing else [])
    arguments += ["--train-file", str(data / "train.txt"), "--validation-file", str(data / "validation.txt")]
    arguments += ["--line-by-line"] if CORPORA[corpus]["line_by_line"] else []
    arguments += ["--tokenizer", str(data / "tokenizer" / "spm.model"), "--config", "tiny"]
    arguments += ["--max-seq-length", str(CORPORA[corpus]["length"]), "--max-steps", str(settings["steps"])]
    arguments += ["--per-device-train-batch-size", str(settings["batch"]), "--per-device-eval-batch-size", "64"]
    arguments += ["--logging-steps", str(max(1, settings["steps"] // 10)), "--seed", str(seed)]
    arguments += ["--save-strategy", "no", "--report-to", "none", "--disable-tqdm", "true"]
    return arguments + ["--output-dir", str(output)]


def pretrain(mode: str, corpus: str, data: Path, output: Path, settings: dict, seed: int, held_out_batch) -> dict:
    """Run the command in this process; the held-out figures of its final check, and for RTD the discriminator's
    ROC-AUC on uniformly random replacements of `held_out_batch` (input ids, attention mask, replaceable ids)."""
    from disentangled import cli

    arguments = pretrain_arguments(mode, corpus, data, output, settings, seed)
    started = time.perf_counter()
    if cli.main(["pretrain", *arguments]) != 0:
        raise RuntimeError(f"disentangled pretrain failed for {mode} on {corpus} (seed {seed})")
    held_out = json.loads((output / "held_out_results.json").read_text())
    result = {"seconds": time.perf_counter() - started}
    if mode == "mlm":
        result["masked_accuracy"] = held_out.get("held_out_masked_accuracy")
        return result
    from disentangled import DisentangledForMaskedLM
    from disentangled.modeling import DisentangledForReplacedTokenDetection
    from disentangled.pretraining import random_replacement_auc

    result["auc"] = held_out.get("held_out_discriminator_auc")
    result["masked_accuracy"] = held_out.get("held_out_generator_accuracy")
    discriminator = DisentangledForReplacedTokenDetection.from_pretrained(output / "discriminator")
    result["random_auc"] = random_replacement_auc(discriminator, *held_out_batch, seed=seed)
    generator = DisentangledForMaskedLM.from_pretrained(output / "generator")
    result["embeddings"] = embedding_similarity(generator, discriminator)
    return result


def held_out_batch(data: Path, tokenizer, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first 2,000 held-out lines, padded, and the ids a random replacement draws from (the rtd masking's)."""
    from disentangled.pretraining import MaskingCollator

    lines = (data / "validation.txt").read_text().splitlines()[:2000]
    batch = tokenizer(lines, truncation=True, max_length=length, padding=True, return_tensors="pt")
    replaceable = MaskingCollator(tokenizer, objective="rtd")._random_ids
    return batch["input_ids"], batch["attention_mask"], replaceable


def embedding_similarity(generator, discriminator) -> dict:
    """The v3 paper's Table 2 (average pairwise cosine similarity of token embeddings within each model) and the
    average cosine similarity between the generator's and the discriminator's embedding of each token."""

    def within(table: torch.Tensor) -> float:
        unit = torch.nn.functional.normalize(table, dim=-1)
        similarity = unit @ unit.T
        count = len(table)
        return float((similarity.sum() - similarity.diagonal().sum()) / (count * (count - 1)))

    gen_table = generator.deberta.embeddings.word_embeddings.weight.detach()
    disc_table = discriminator.deberta.embeddings.word_embeddings.weight.detach()
    between = torch.nn.functional.cosine_similarity(gen_table, disc_table, dim=-1).mean()
    return {"generator": within(gen_table), "discriminator": within(disc_table), "between": float(between)}


# -- downstream: fine-tuning and probes --------------------------------------------------------------------------


def balanced_accuracy(predicted, gold) -> float:
    """The mean over classes of the fraction of that class predicted right (chance: 1 / classes, however skewed)."""
    predicted, gold = torch.as_tensor(predicted), torch.as_tensor(gold)
    return float(torch.stack([(predicted[gold == c] == c).float().mean() for c in gold.unique()]).mean())


def encode(rows: list[dict], tokenizer, labels: list[str], length: int) -> list[dict]:
    encoded = tokenizer([row["text"] for row in rows], truncation=True, max_length=length)["input_ids"]
    return [{"input_ids": ids, "labels": labels.index(row["label"])} for ids, row in zip(encoded, rows)]


def new_encoder(model_class, encoder: Path | None, vocab_size: int, seed: int, **kwargs):
    """The pretrained encoder with a new head, or (None) the same shape from random weights; seeded."""
    from disentangled import DisentangledConfig
    from disentangled.pretraining.command import PRESETS, V3

    torch.manual_seed(seed)
    if encoder is not None:
        return model_class.from_pretrained(encoder, **kwargs)
    return model_class(DisentangledConfig(**V3, **PRESETS["tiny"], vocab_size=vocab_size, pad_token_id=0, **kwargs))


def fine_tune(encoder, tokenizer, splits: dict, labels: list[str], length: int, rate: float, settings, seed, work):
    """(validation, test) balanced accuracy after fine-tuning at `rate` with `Trainer`."""
    import transformers

    from disentangled import DisentangledForSequenceClassification

    model = new_encoder(DisentangledForSequenceClassification, encoder, len(tokenizer), seed, num_labels=len(labels))
    arguments = transformers.TrainingArguments(
        output_dir=str(work),
        num_train_epochs=settings["epochs"],
        learning_rate=rate,
        warmup_steps=0.1,
        weight_decay=0.01,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=64,
        save_strategy="no",
        report_to="none",
        seed=seed,
        disable_tqdm=True,
        use_cpu=True,
    )
    data = {name: encode(rows, tokenizer, labels, length) for name, rows in splits.items()}
    collator = transformers.DataCollatorWithPadding(tokenizer)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=data["train"], data_collator=collator)
    trainer.train()
    scores = []
    for name in ("validation", "test"):
        prediction = trainer.predict(data[name])
        scores.append(balanced_accuracy(prediction.predictions.argmax(-1), prediction.label_ids))
    return tuple(scores)


@torch.no_grad()
def features(model, tokenizer, rows: list[dict], length: int, with_sinks: bool = False) -> dict:
    """Frozen last-layer features of each text: the [CLS] state and the mean of its tokens' states; `with_sinks`:
    also the attention sinks of these texts (`sinks`), from the same forward passes."""
    cls, mean, attended = [], [], []
    for start in range(0, len(rows), 64):
        texts = [row["text"] for row in rows[start : start + 64]]
        batch = tokenizer(texts, truncation=True, max_length=length, padding=True, return_tensors="pt")
        out = model(**batch, output_attentions=with_sinks)
        hidden = out.last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        cls.append(hidden[:, 0])
        mean.append((hidden * mask).sum(1) / mask.sum(1))
        if with_sinks:
            special = [
                tokenizer.get_special_tokens_mask(ids, already_has_special_tokens=True) for ids in batch["input_ids"]
            ]
            attended.append((out.attentions, batch["attention_mask"], torch.tensor(special)))
    found = {"cls": torch.cat(cls), "mean": torch.cat(mean)}
    return found | ({"sinks": sinks(attended)} if with_sinks else {})


def sinks(batches: list[tuple]) -> dict[str, list[float]]:
    """Attention sinks: per layer, the attention probability that ordinary tokens give [CLS] and [SEP] (mean over
    heads and over every ordinary query of every text). `batches`: (attentions per layer [B, H, L, L], attention mask,
    special-tokens mask) of each batch. A model that attends uniformly gives each about 1 / length."""
    totals, queries_seen = {"cls": 0.0, "sep": 0.0}, 0.0
    for attentions, attention_mask, special in batches:
        queries = (attention_mask.bool() & (special == 0)).float()  # [B, L]
        last = attention_mask.sum(1) - 1  # [SEP]: the last real token of each text
        probabilities = torch.stack(attentions).mean(2)  # [layers, B, L, L]
        to_cls = probabilities[..., 0]  # [layers, B, L]
        to_sep = probabilities.gather(3, last.view(1, -1, 1, 1).expand(*probabilities.shape[:3], 1))[..., 0]
        totals["cls"] = totals["cls"] + (to_cls * queries).sum((1, 2))
        totals["sep"] = totals["sep"] + (to_sep * queries).sum((1, 2))
        queries_seen += float(queries.sum())
    return {token: (total / queries_seen).tolist() for token, total in totals.items()}


def logistic_regression(x: torch.Tensor, y: torch.Tensor, classes: int, l2: float) -> torch.Tensor:
    """Weights [features + 1, classes] of a multinomial logistic regression with an L2 penalty, fitted by L-BFGS."""
    x = torch.cat([x, torch.ones(len(x), 1)], 1)
    weights = torch.zeros(x.shape[1], classes, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights], max_iter=200, line_search_fn="strong_wolfe")

    def loss():
        optimizer.zero_grad()
        value = torch.nn.functional.cross_entropy(x @ weights, y) + l2 * weights[:-1].pow(2).sum()
        value.backward()
        return value

    optimizer.step(loss)
    return weights.detach()


def probe(encoder, tokenizer, splits: dict, labels: list[str], length: int, seed: int) -> dict[str, float]:
    """Test balanced accuracy of a linear probe on frozen [CLS] states and on mean-pooled states, and the attention
    sinks on the test texts."""
    from disentangled import DisentangledModel

    model = new_encoder(DisentangledModel, encoder, len(tokenizer), seed).eval()
    gold = {name: torch.tensor([labels.index(row["label"]) for row in rows]) for name, rows in splits.items()}
    found = {name: features(model, tokenizer, rows, length, name == "test") for name, rows in splits.items()}
    result = {}
    for kind in ("cls", "mean"):
        train = found["train"][kind]
        center, scale = train.mean(0), train.std(0) + 1e-6
        x = {name: (found[name][kind] - center) / scale for name in splits}

        def scored(weights, name, x=x):
            logits = torch.cat([x[name], torch.ones(len(x[name]), 1)], 1) @ weights
            return balanced_accuracy(logits.argmax(-1), gold[name])

        fits = [logistic_regression(x["train"], gold["train"], len(labels), l2) for l2 in (1e-4, 1e-3, 1e-2, 1e-1)]
        best = max(fits, key=lambda weights: scored(weights, "validation"))
        result[kind] = scored(best, "test")
    result["sinks"] = found["test"]["sinks"]
    return result


# -- one (corpus, seed) job ------------------------------------------------------------------------------------------


def run_job(job: dict) -> dict:
    """Pretrain every mode on one corpus with one seed, then fine-tune and probe every arm on its tasks. Runs in a
    worker process; its output goes to a log file in the work folder."""
    import transformers

    from disentangled.integrations.tokenization import tokenizer_from_spm

    corpus, seed, settings, data = job["corpus"], job["seed"], job["settings"], Path(job["data"])
    if not job.get("here"):  # a worker: its output to a log file of the job
        log = os.open(Path(job["work"]) / f"{corpus}-seed{seed}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
    torch.set_num_threads(job["threads"])
    transformers.logging.set_verbosity_error()
    tokenizer = tokenizer_from_spm(data / "tokenizer" / "spm.model")
    tasks = json.loads((data / "tasks.json").read_text())
    length = CORPORA[corpus]["length"]
    work = Path(job["work"]) / f"{corpus}-seed{seed}"
    result = {"corpus": corpus, "seed": seed, "pretraining": {}, "tasks": {}}
    encoders = {"none": None}
    held_out = held_out_batch(data, tokenizer, length)
    for mode in job["modes"]:
        output = work / mode
        result["pretraining"][mode] = pretrain(mode, corpus, data, output, settings, seed, held_out)
        transformers.logging.set_verbosity_error()
        encoders[mode] = output if mode == "mlm" else output / "discriminator"
        print(f"{corpus} seed {seed} {mode}: {result['pretraining'][mode]}", flush=True)
    for task, splits in tasks.items():
        labels = sorted({row["label"] for rows in splits.values() for row in rows})
        result["tasks"][task] = {}
        for arm, encoder in encoders.items():
            tried = {}
            for rate in settings["learning_rates"]:
                tried[rate] = fine_tune(encoder, tokenizer, splits, labels, length, rate, settings, seed, work / "ft")
            chosen = max(tried, key=lambda rate: (tried[rate][0], -rate))  # best on validation; ties: the lower rate
            result["tasks"][task][arm] = {
                "learning_rate": chosen,
                "validation": tried[chosen][0],
                "test": tried[chosen][1],
                "tried": {f"{rate:g}": list(scores) for rate, scores in tried.items()},
                "probe": probe(encoder, tokenizer, splits, labels, length, seed),
            }
            print(f"{corpus} seed {seed} {task} {arm}: {result['tasks'][task][arm]}", flush=True)
    return result


# -- speed (--speed) ----------------------------------------------------------------------------------------------


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
    from disentangled.pretraining import (
        MaskingCollator,
        PaddingCollator,
        ReplacedTokenDetectionPretraining,
        generator_config,
    )
    from disentangled.pretraining.command import PRESETS, V3
    from disentangled.pretraining.data import load_texts, tokenize_and_group

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


# -- the report ------------------------------------------------------------------------------------------------------


def summary(values: list[float | None]) -> dict | None:
    values = [value for value in values if value is not None]
    if not values:
        return None
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "seeds": values,
    }


def aggregate(results: list[dict], arms: list[str]) -> dict:
    """Per corpus: per task and arm, the test accuracy and the probes over seeds; per mode, the held-out figures."""
    report = {}
    for corpus in dict.fromkeys(result["corpus"] for result in results):
        mine = sorted((r for r in results if r["corpus"] == corpus), key=lambda r: r["seed"])
        tasks = {}
        for task in mine[0]["tasks"]:
            tasks[task] = {
                arm: {
                    "test": summary([r["tasks"][task][arm]["test"] for r in mine]),
                    "probe_cls": summary([r["tasks"][task][arm]["probe"]["cls"] for r in mine]),
                    "probe_mean": summary([r["tasks"][task][arm]["probe"]["mean"] for r in mine]),
                    **{
                        f"sink_{token}": summary(
                            [statistics.fmean(r["tasks"][task][arm]["probe"]["sinks"][token]) for r in mine]
                        )
                        for token in ("cls", "sep")
                        if all("sinks" in r["tasks"][task][arm]["probe"] for r in mine)
                    },
                    "learning_rates": [r["tasks"][task][arm]["learning_rate"] for r in mine],
                }
                for arm in arms
            }
        pretraining = {
            mode: {
                figure: summary([r["pretraining"][mode].get(figure) for r in mine])
                for figure in ("auc", "random_auc", "masked_accuracy", "seconds")
            }
            for mode in arms
            if mode != "none"
        }
        report[corpus] = {"seeds": [r["seed"] for r in mine], "tasks": tasks, "pretraining": pretraining}
    return report


def markdown(figures: dict) -> str:
    """The table of the manual's pretraining page: one row per arm, a column per task, then the held-out figures."""

    def cell(stats: dict | None) -> str:
        if stats is None:
            return "-"
        return f"{stats['mean']:.3f} ± {stats['std']:.3f}"

    settings = figures["settings"]
    blocks = [
        f"Each arm: `disentangled pretrain --config tiny`, {settings['steps']} steps of {settings['batch']} sequences, "
        f"the command's default recipe for the tiny shape from scratch (learning rate {settings['tiny_learning_rate']:g}, "
        f"10% warm-up); fine-tuned {settings['epochs']:g} epochs at the best of "
        f"{', '.join(f'{rate:g}' for rate in settings['learning_rates'])} on validation. Test balanced accuracy (chance: "
        "1 / classes), mean ± standard deviation over seeds; probes: logistic regression on frozen features; the "
        "discriminator's held-out ROC-AUC on the generator's and on uniformly random replacements; held-out accuracy "
        "on masked tokens (RTD: the generator's)."
        + (
            f" {settings['threads']} thread(s) per job, {settings['workers']} job(s) side by side."
            if "workers" in settings
            else ""
        )
    ]
    for corpus, report in figures["corpora"].items():
        tasks = list(report["tasks"])
        head = ["arm"] + [f"{task}: fine-tuned" for task in tasks]
        head += [f"{task}: probe [CLS] / mean" for task in tasks]
        head += ["disc. AUC (generator's / random repl.)", "masked-token acc."]
        length = CORPORA[corpus]["length"]
        lines = [f"**{corpus} text** ({length}-token sequences; seeds {', '.join(map(str, report['seeds']))})", ""]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for arm in figures["arms"]:
            row = [arm if arm != "none" else "no pretraining"]
            row += [cell(report["tasks"][task][arm]["test"]) for task in tasks]
            row += [
                f"{cell(report['tasks'][task][arm]['probe_cls'])} / {cell(report['tasks'][task][arm]['probe_mean'])}"
                for task in tasks
            ]
            pre = report["pretraining"].get(arm, {})
            auc = f"{cell(pre.get('auc'))} / {cell(pre.get('random_auc'))}" if pre.get("auc") else "-"
            row += [auc, cell(pre.get("masked_accuracy"))]
            lines.append("| " + " | ".join(row) + " |")
        first = report["tasks"][tasks[0]]
        if "sink_cls" in first["none"]:
            lines += [
                "",
                f"Attention sinks on the {tasks[0]} test texts: the attention ordinary tokens give [CLS] and [SEP], "
                "mean over layers, heads and queries (uniform attention: about 1 / length).",
                "",
                "| arm | on [CLS] | on [SEP] |",
                "|---|---|---|",
            ]
            for arm in figures["arms"]:
                name = arm if arm != "none" else "no pretraining"
                lines.append(f"| {name} | {cell(first[arm]['sink_cls'])} | {cell(first[arm]['sink_sep'])} |")
        blocks.append("\n".join(lines))
    if figures.get("speed"):
        fast = figures["speed"]
        seconds = fast["seconds"]
        blocks.append(
            f"Speed, batch {fast['batch']}, forward + backward: generator alone {seconds['generator'] * 1e3:.1f} ms + "
            f"discriminator alone {seconds['discriminator'] * 1e3:.1f} ms; "
            + ", ".join(
                f"{name} step {seconds[name] * 1e3:.1f} ms ({fast['ratio'][name]:.2f} of the two alone)"
                for name in fast["ratio"]
            )
            + "."
        )
    return "\n\n".join(blocks)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few steps, small data")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--corpora", nargs="+", choices=list(CORPORA), default=list(CORPORA))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="pretrained arms")
    parser.add_argument("--steps", type=int, help=f"pretraining steps per mode (default {FULL['steps']})")
    parser.add_argument(
        "--learning-rates",
        type=float,
        nargs="+",
        help=f"fine-tuning rates to choose from (default {FULL['learning_rates']})",
    )
    parser.add_argument("--epochs", type=float, help=f"fine-tuning epochs (default {FULL['epochs']:g})")
    parser.add_argument("--workers", type=int, default=2, help="jobs (corpus, seed) run side by side")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--speed", action="store_true", help="also time an RTD step against its models' steps")
    parser.add_argument("--out", type=Path, help="--quick: where pretrain-quick.json goes")
    parser.add_argument("--records", type=Path, help="the records folder (default benchmarks/records)")
    args = parser.parse_args(argv)
    if args.quick and args.out is None:
        parser.error("--quick needs --out DIR (a smoke run is not a record)")
    settings = dict(QUICK if args.quick else FULL)
    settings["steps"] = args.steps or settings["steps"]
    settings["learning_rates"] = tuple(args.learning_rates or settings["learning_rates"])
    settings["epochs"] = args.epochs or settings["epochs"]
    command = "python -m studies.pretrain " + " ".join(argv if argv is not None else sys.argv[1:])
    arms = ["none", *args.modes]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pretrain-benchmark-") as folder:
        folder = Path(folder)
        corpora = {name: write_corpus(name, folder / name, settings) for name in args.corpora}
        jobs = [
            dict(corpus=name, seed=seed, settings=settings, data=corpora[name]["folder"], work=str(folder))
            | dict(threads=args.threads, modes=args.modes)
            for seed in args.seeds
            for name in args.corpora
        ]
        print(f"{command.strip()}: {len(jobs)} jobs on {args.workers} workers; logs in {folder}", flush=True)
        if args.workers > 1:
            with multiprocessing.get_context("spawn").Pool(args.workers, maxtasksperchild=1) as pool:
                results = []
                for result in pool.imap_unordered(run_job, jobs):
                    print(f"done: {result['corpus']} seed {result['seed']} ({time.perf_counter() - started:.0f} s)")
                    results.append(result)
        else:
            results = [run_job(job | {"here": True}) for job in jobs]
        figures = {
            "settings": settings
            | {"tiny_learning_rate": SCRATCH_LEARNING_RATES["tiny"], "workers": args.workers, "threads": args.threads},
            "arms": arms,
            "words": {name: corpus["words"] for name, corpus in corpora.items()},
            "corpora": aggregate(results, arms),
            "jobs": results,
        }
        if args.speed:
            from disentangled.integrations.tokenization import tokenizer_from_spm

            data = Path(corpora[args.corpora[0]]["folder"])
            tokenizer = tokenizer_from_spm(data / "tokenizer" / "spm.model")
            figures["speed"] = speed(
                tokenizer,
                data,
                settings | {"length": 32, "repeats": SPEED_REPEATS["quick" if args.quick else "full"]},
                args.seeds[0],
            )
    figures["seconds"] = time.perf_counter() - started
    figures["markdown"] = markdown(figures)
    print(figures["markdown"])
    if args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pretrain-quick.json").write_text(json.dumps(figures, indent=2))
    else:
        from benchmarks.records import RECORDS, append_record

        append_record("pretrain", figures, command=command.split(), folder=args.records or RECORDS)
    return figures


if __name__ == "__main__":
    main()
