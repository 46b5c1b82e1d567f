"""The second half of `disentangled demo`, run as a script in a fresh process where `disentangled` is hidden.

It uses a converted folder the way a Hub user does: `Auto...from_pretrained(folder, trust_remote_code=True)`, the
tokenizer with plain `AutoTokenizer`, transformers pipelines, then fine-tuning with `Trainer` on the CSV files the
parent wrote, printing the accuracy before and after. It imports nothing from the package (stdlib, torch,
transformers only), so it is run by path: `python remote.py FOLDER TRAIN.csv EVAL.csv OUTPUT_DIR [options]`.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time

sys.modules["disentangled"] = None  # as on a machine without the package: everything comes from the folder

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    pipeline,
)

# Sentences of the built-in pretraining text's kinds: a country, an animal's place, a sentiment word fit the gaps.
FILL_MASK_PROBES = (
    "paris is the capital of [MASK].",
    "the lazy dog sat on the [MASK].",
    "we hate this film, it was [MASK].",
)


def step(text: str) -> float:
    print(f"\n== {text}", flush=True)
    return time.perf_counter()


def done(started: float) -> None:
    print(f"   ({time.perf_counter() - started:.1f} s)", flush=True)


def read_csv(path: str, tokenizer, label2id: dict[str, int], max_length: int = 128) -> list[dict]:
    with open(path, newline="") as file:
        rows = list(csv.DictReader(file))
    encoded = tokenizer([row["text"] for row in rows], truncation=True, max_length=max_length)
    return [
        {"input_ids": ids, "attention_mask": mask, "labels": label2id[row["label"]]}
        for ids, mask, row in zip(encoded["input_ids"], encoded["attention_mask"], rows)
    ]


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float(np.mean(prediction.predictions.argmax(-1) == prediction.label_ids))}


def use_pipelines(folder: str, tokenizer) -> None:
    started = step("pipelines on the converted folder, loaded with trust_remote_code=True (package hidden)")
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    if any(name.endswith("ForMaskedLM") for name in config.architectures or []):
        model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)
        print(f"   {type(model).__name__} from {type(model).__module__}")
        fill = pipeline("fill-mask", model=model, tokenizer=tokenizer, trust_remote_code=True)
        for text in FILL_MASK_PROBES:
            text = text.replace("[MASK]", tokenizer.mask_token)
            guesses = ", ".join(f"{r['token_str']!r} {r['score']:.3f}" for r in fill(text, top_k=3))
            print(f"   fill-mask  {text!r}: {guesses}")
    else:
        model = AutoModel.from_pretrained(folder, trust_remote_code=True)
        print(f"   {type(model).__name__} from {type(model).__module__}")
    extract = pipeline("feature-extraction", model=folder, tokenizer=tokenizer, trust_remote_code=True)
    features = np.asarray(extract("the quick brown fox"))
    print(f"   feature-extraction 'the quick brown fox': hidden states of shape {features.shape}")
    done(started)


def train_classifier(args: argparse.Namespace, tokenizer, model, train: list, evaluation: list, output: str):
    """`Trainer` with the demo's recipe; returns it, trained, and the accuracy before and after."""
    training_args = TrainingArguments(
        output_dir=output,
        num_train_epochs=args.epochs,
        learning_rate=args.learning_rate,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        warmup_steps=args.warmup_steps,
        weight_decay=0.01,
        logging_steps=max(1, len(train) // args.batch_size // 4),
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    return trainer, before, trainer.evaluate()["eval_accuracy"]


def fine_tune(args: argparse.Namespace, tokenizer) -> None:
    started = step(f"fine-tuning with transformers' Trainer on {args.train} (sentiment, 2 labels)")
    labels = ["negative", "positive"]
    label2id = {label: index for index, label in enumerate(labels)}
    names = dict(num_labels=2, id2label=dict(enumerate(labels)), label2id=label2id)
    torch.manual_seed(args.seed)  # the new classifier's weights: the same on every run with this seed
    model = AutoModelForSequenceClassification.from_pretrained(args.folder, trust_remote_code=True, **names)
    print(f"   {type(model).__name__} from {type(model).__module__}: a new, untrained classifier on the encoder")
    train, evaluation = read_csv(args.train, tokenizer, label2id), read_csv(args.eval, tokenizer, label2id)
    print(f"   {len(train)} training and {len(evaluation)} evaluation sentences")
    print(
        f"   recipe: learning rate {args.learning_rate:g}, warm-up {args.warmup_steps:g} steps, {args.epochs:g} epochs, "
        f"batch {args.batch_size}",
        flush=True,
    )
    trainer, before, after = train_classifier(args, tokenizer, model, train, evaluation, f"{args.output_dir}/trainer")
    print(f"   accuracy before fine-tuning: {before:.3f}  (chance: 0.5)")
    print(f"   accuracy after fine-tuning:  {after:.3f}", flush=True)
    random_after = float("nan")
    if args.compare_random:  # the same encoder shape and recipe from random weights: what pretraining added
        torch.manual_seed(args.seed)
        config = AutoConfig.from_pretrained(args.folder, trust_remote_code=True, **names)
        untrained = AutoModelForSequenceClassification.from_config(config, trust_remote_code=True)
        _, _, random_after = train_classifier(
            args, tokenizer, untrained, train, evaluation, f"{args.output_dir}/trainer-random"
        )
        print(f"   the same fine-tuning from random weights: {random_after:.3f}")
    done(started)

    started = step("the fine-tuned model, saved and loaded back with trust_remote_code=True")
    saved = f"{args.output_dir}/finetuned"
    trainer.save_model(saved)  # the weights, the tokenizer and (loaded as remote code) the bundled code
    classify = pipeline("text-classification", model=saved, trust_remote_code=True)
    for text in ("we love this wonderful story", "the film was boring and awful"):
        result = classify(text)
        print(f"   text-classification {text!r}: {result[0]['label']} {result[0]['score']:.3f}")
    print(f"   saved to {saved}")
    done(started)
    print(f"RESULT accuracy_before={before:.4f} accuracy_after={after:.4f} accuracy_random={random_after:.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("train")
    parser.add_argument("eval")
    parser.add_argument("output_dir")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup-steps", type=float, default=0.1, help="steps, or a fraction of them below 1")
    parser.add_argument("--compare-random", action="store_true", help="also fine-tune from random weights")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    print(
        f"   fresh process: python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; `import disentangled` is blocked here"
    )
    tokenizer = AutoTokenizer.from_pretrained(args.folder, trust_remote_code=True)
    use_pipelines(args.folder, tokenizer)
    fine_tune(args, tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
