#!/usr/bin/env python
"""Fine-tune a disentangled-attention (DeBERTa) model for text or token classification with transformers' Trainer.

In the style of transformers' `run_glue.py` / `run_ner.py`: a model folder or Hub id, local CSV / JSON-lines files
read with `datasets`, every `TrainingArguments` option on the command line, metrics computed here (nothing is
downloaded), progress bars, and a saved model that loads back with `trust_remote_code=True`, also where this package
is not installed (the folder carries the model code).

    python examples/finetune.py --model_name_or_path ./deberta-v3-xsmall-disentangled --trust_remote_code \\
        --task text-classification --train_file train.csv --validation_file dev.csv \\
        --output_dir out --do_train --do_eval --num_train_epochs 3 --learning_rate 5e-5 --warmup_steps 0.1

Recipes (docs/pretraining.md, "Fine-tuning what pretraining taught"): a released model, 2e-5 to 5e-5 with 10%
warm-up; a small model pretrained here (hidden 64-128), 1e-3 with 10% warm-up, 3 epochs or more.
`--layerwise_lr_decay 0.8` gives lower layers smaller learning rates, as ELECTRA fine-tunes.

Text classification reads `--text_column` (and `--text_pair_column` for pairs) and `--label_column`; token
classification reads a list of words (`--tokens_column`) and one tag per word (`--tags_column`), labels the first
piece of each word and ignores the others. The same command runs on several processes:

    torchrun --nproc_per_node=2 examples/finetune.py ...        # DDP; gloo on CPU, nccl on GPUs
    accelerate launch --num_processes=2 examples/finetune.py ...
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    EvalPrediction,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

try:  # registers the architecture with the Auto classes; without it, models load as remote code
    import disentangled  # noqa: F401

    # FSDP: a wrap policy that parts a table from its reader fails clearly
    from disentangled.integrations.sharding import WrapCheck

    CALLBACKS = [WrapCheck]
except ImportError:
    CALLBACKS = []

logger = logging.getLogger(__name__)
TASKS = {
    "text-classification": AutoModelForSequenceClassification,
    "token-classification": AutoModelForTokenClassification,
}


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a model folder or Hub id"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run the model code the folder carries"})
    revision: str = field(default="main", metadata={"help": "Hub revision (branch, tag or commit)"})


@dataclass
class DataArguments:
    task: str = field(default="text-classification", metadata={"choices": list(TASKS)})
    train_file: str | None = field(default=None, metadata={"help": "CSV or JSON(-lines) training file"})
    validation_file: str | None = field(default=None, metadata={"help": "CSV or JSON(-lines) evaluation file"})
    text_column: str = "text"
    text_pair_column: str | None = field(default=None, metadata={"help": "second text of a pair, if any"})
    label_column: str = "label"
    tokens_column: str = "tokens"
    tags_column: str = "tags"
    max_seq_length: int = field(default=128, metadata={"help": "longer inputs are truncated"})
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    evaluate_before_training: bool = field(default=False, metadata={"help": "also evaluate the untrained model"})
    layerwise_lr_decay: float = field(
        default=1.0,
        metadata={
            "help": "layer-wise learning-rate decay, as ELECTRA fine-tunes: layer l of L gets learning_rate x "
            "decay^(L - l), the embeddings decay^(L + 1), the head the full rate (1.0: off; ELECTRA used 0.8)"
        },
    )


def load_splits(data_args: DataArguments) -> datasets.DatasetDict:
    files = {name: path for name, path in (("train", data_args.train_file), ("validation", data_args.validation_file))}
    files = {name: path for name, path in files.items() if path}
    if not files:
        raise ValueError("give --train_file and/or --validation_file")
    extensions = {Path(path).suffix.lstrip(".") for path in files.values()}
    if len(extensions) != 1 or not extensions <= {"csv", "json", "jsonl"}:
        raise ValueError(f"data files must all be .csv or all .json/.jsonl, got {sorted(files.values())}")
    builder = "csv" if extensions == {"csv"} else "json"
    splits = datasets.load_dataset(builder, data_files=files)
    for name, limit in (("train", data_args.max_train_samples), ("validation", data_args.max_eval_samples)):
        if name in splits and limit is not None:
            splits[name] = splits[name].select(range(min(limit, len(splits[name]))))
    return splits


def label_names(splits: datasets.DatasetDict, data_args: DataArguments) -> list[str]:
    """The label set, sorted, from every split (tags for token classification)."""
    seen = set()
    for split in splits.values():
        if data_args.task == "token-classification":
            seen.update(tag for tags in split[data_args.tags_column] for tag in tags)
        else:
            seen.update(str(label) for label in split[data_args.label_column])
    return sorted(seen)


def tokenize_function(tokenizer, data_args: DataArguments, label2id: dict[str, int]):
    def text_classification(batch):
        texts = [batch[data_args.text_column]]
        if data_args.text_pair_column:
            texts.append(batch[data_args.text_pair_column])
        encoded = tokenizer(*texts, truncation=True, max_length=data_args.max_seq_length)
        encoded["labels"] = [label2id[str(label)] for label in batch[data_args.label_column]]
        return encoded

    def token_classification(batch):
        encoded = tokenizer(
            batch[data_args.tokens_column],
            is_split_into_words=True,
            truncation=True,
            max_length=data_args.max_seq_length,
        )
        encoded["labels"] = []
        for row, tags in enumerate(batch[data_args.tags_column]):
            labels, previous = [], None
            for word in encoded.word_ids(row):  # the first piece of a word carries its tag; -100 is ignored
                labels.append(-100 if word is None or word == previous else label2id[tags[word]])
                previous = word
            encoded["labels"].append(labels)
        return encoded

    return token_classification if data_args.task == "token-classification" else text_classification


def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
    """Accuracy and macro F1 over the labelled positions (examples, or first pieces of words)."""
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    predicted, labels = logits.argmax(-1).reshape(-1), prediction.label_ids.reshape(-1)
    keep = labels != -100
    predicted, labels = predicted[keep], labels[keep]
    f1s = []
    for label in np.unique(labels):
        true_positive = np.sum((predicted == label) & (labels == label))
        f1s.append(2 * true_positive / max(np.sum(predicted == label) + np.sum(labels == label), 1))
    return {"accuracy": float(np.mean(predicted == labels)), "macro_f1": float(np.mean(f1s))}


def add_remote_code(model, output_dir: str) -> None:
    """Make the saved folder load with `trust_remote_code=True` where the package is not installed.

    A model that ran as remote code was saved with its code by transformers already; a model that came from the
    installed package gets the converter's bundle (the package's own files, flat) and `auto_map` here.
    """
    if not type(model).__module__.startswith("disentangled."):
        return
    from disentangled.conversion.bundle import auto_map, write_bundle

    write_bundle(output_dir)
    saved_config = Path(output_dir) / "config.json"
    config = json.loads(saved_config.read_text())
    config["auto_map"] = auto_map()
    saved_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def portable_tokenizer(tokenizer, output_dir: str) -> None:
    """Make the saved tokenizer load on transformers 4.57 too, as the model does (see make_tokenizer_portable)."""
    try:
        from disentangled.integrations.tokenization import make_tokenizer_portable
    except ImportError:
        logger.warning("disentangled is not installed: the saved tokenizer may not load on transformers 4.57")
        return
    make_tokenizer_portable(output_dir, tokenizer)


def layerwise_parameter_groups(model, learning_rate: float, decay: float, weight_decay: float) -> list[dict]:
    """AdamW parameter groups with layer-wise learning-rate decay: the head at `learning_rate`, encoder layer l (of
    L, counted from 1 at the bottom) at learning_rate * decay^(L + 1 - l), the embeddings at decay^(L + 1). Biases
    and LayerNorm weights get no weight decay, as in Trainer."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"--layerwise_lr_decay must be in (0, 1], got {decay}")
    layers = model.config.num_hidden_layers
    groups: dict[tuple[float, float], list] = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if ".embeddings." in name:
            depth = 0
        elif ".encoder.layer." in name:
            depth = int(name.split(".encoder.layer.")[1].split(".")[0]) + 1
        elif ".encoder." in name:  # relative position embeddings and their LayerNorm: shared by every layer
            depth = 1
        else:  # the head (pooler, classifier)
            depth = layers + 1
        rate = learning_rate * decay ** (layers + 1 - depth)
        no_decay = parameter.ndim == 1 or "LayerNorm" in name
        groups.setdefault((rate, 0.0 if no_decay else weight_decay), []).append(parameter)
    return [{"params": params, "lr": rate, "weight_decay": wd} for (rate, wd), params in groups.items()]


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    logger.setLevel(training_args.get_process_log_level())
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    datasets.utils.logging.set_verbosity(training_args.get_process_log_level())
    logger.warning(  # every process says who it is
        "process %d of %d, device %s", training_args.process_index, training_args.world_size, training_args.device
    )
    set_seed(training_args.seed)

    splits = load_splits(data_args)
    labels = label_names(splits, data_args)
    label2id = {label: index for index, label in enumerate(labels)}
    load = {"trust_remote_code": model_args.trust_remote_code, "revision": model_args.revision}
    config = AutoConfig.from_pretrained(
        model_args.model_name_or_path,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id=label2id,
        finetuning_task=data_args.task,
        **load,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, **load)
    model = TASKS[data_args.task].from_pretrained(
        model_args.model_name_or_path, config=config, ignore_mismatched_sizes=True, **load
    )

    with training_args.main_process_first(desc="tokenizing"):  # rank 0 writes the cache, the others read it
        columns = next(iter(splits.values())).column_names
        tokenized = splits.map(
            tokenize_function(tokenizer, data_args, label2id), batched=True, remove_columns=columns, desc="tokenizing"
        )
    if data_args.task == "token-classification":
        collator = DataCollatorForTokenClassification(tokenizer)
    else:
        collator = DataCollatorWithPadding(tokenizer)
    optimizers = (None, None)
    if data_args.layerwise_lr_decay != 1.0:
        groups = layerwise_parameter_groups(
            model, training_args.learning_rate, data_args.layerwise_lr_decay, training_args.weight_decay
        )
        optimizers = (torch.optim.AdamW(groups, lr=training_args.learning_rate), None)
    trainer = Trainer(
        model=model,
        args=training_args,
        optimizers=optimizers,
        train_dataset=tokenized.get("train") if training_args.do_train else None,
        eval_dataset=tokenized.get("validation") if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
        callbacks=[callback() for callback in CALLBACKS],
    )

    results: dict = {}
    if training_args.do_eval and data_args.evaluate_before_training:
        results["eval_before"] = trainer.evaluate(metric_key_prefix="eval_before")
        trainer.log_metrics("eval_before", results["eval_before"])
    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint
        if checkpoint is None and Path(training_args.output_dir).is_dir():
            checkpoint = get_last_checkpoint(training_args.output_dir)  # continue an interrupted run
            if checkpoint:
                logger.info("resuming from %s", checkpoint)
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        if trainer.is_fsdp_enabled:  # FSDP's checkpoints stay sharded; the saved folder holds the whole model
            trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        trainer.save_model()  # the model and the tokenizer, on the main process
        if trainer.is_world_process_zero():
            add_remote_code(trainer.model, training_args.output_dir)
            portable_tokenizer(tokenizer, training_args.output_dir)
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)
        trainer.save_state()
        results["train"] = train_result.metrics
    if training_args.do_eval:
        results["eval"] = trainer.evaluate()
        trainer.log_metrics("eval", results["eval"])
        trainer.save_metrics("eval", results["eval"])
    results["log_history"] = trainer.state.log_history
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # under torchrun / accelerate: left to interpreter exit, Gloo's threads can abort the finished process
        # ("terminate called without an active exception", pytorch/pytorch#190489), and so can a group destroyed
        # while the other process still waits in a collective (the last save's): every process reaches the end first
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        # Destroyed, the group can still outlive the call where an object of the run keeps a reference to it; its
        # worker threads are then torn down during the interpreter's finalization and abort the process as above
        # (CI saw rank 1 abort so once the barrier was in; pytorch/pytorch#179291). The work is done and every file
        # written: the process ends here, without that teardown.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
