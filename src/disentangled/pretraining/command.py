"""`disentangled pretrain`: pretrain, or continue pretraining, a DeBERTa model with `Trainer`.

    disentangled pretrain --train-file corpus.txt --output-dir out --vocab-size 8000 --config small \\
        --max-steps 10000 --per-device-train-batch-size 32

With no `--learning-rate` / `--warmup-steps`, the recipe follows from the run (`default_recipe`, printed at the start):
from scratch, the preset's learning rate (`SCRATCH_LEARNING_RATES`) with 10% warm-up; continued pretraining
(`--init-from`), 5e-5 with 6% warm-up, Microsoft's range for an already trained model. The run ends with one line
saying whether the discriminator learned: its held-out ROC-AUC against 0.5 (`--validation-file`, or
`--validation-split-percentage` of the training sequences held out).

`--objective rtd` (default): replaced-token detection with a generator (see `disentangled.pretraining`), saved as
`out/discriminator` and `out/generator`; `--objective mlm`: masked LM, saved as `out`. Every
`transformers.TrainingArguments` option is accepted (`--max_steps` or `--max-steps`, `--bf16`, `--resume_from_checkpoint`,
...); the command runs under `torchrun` and `accelerate launch`. Bad input fails before anything is written.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import shutil
import tempfile
import typing
from pathlib import Path

from ..configuration.configuration_disentangled import V3_FIELDS

logger = logging.getLogger("disentangled.pretrain")

# DeBERTa-v3 shapes (relative attention with 256 log buckets, c2p + p2c, shared keys, no absolute input positions).
V3 = dict(V3_FIELDS, legacy=False)
PRESETS = {
    # tiny: weights drawn with std 0.1, not 0.02: at width 64, 0.02 leaves attention near uniform for hundreds of steps
    # and the discriminator learns only unigram cues (docs/pretraining.md, "What makes the discriminator learn")
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256, initializer_range=0.1
    ),
    "xsmall": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536),
    "small": dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}
DEBERTA_MODEL_TYPES = ("disentangled", "deberta-v2")
# Our options; each also answers to its underscore spelling, as TrainingArguments' options do.
OWN_TRAINING_FIELDS = {"output_dir"}
# From scratch: the peak learning rate per preset (the smaller the model, the higher it can go; see
# docs/pretraining.md, "What makes the discriminator learn"). Warm-up: a fraction of the steps.
SCRATCH_LEARNING_RATES = {"tiny": 1e-3, "xsmall": 5e-4, "small": 3e-4, "base": 2e-4, "large": 1e-4}
SCRATCH_WARMUP = 0.1
CONTINUED_LEARNING_RATE = 5e-5  # --init-from: Microsoft's continued-pretraining / fine-tuning range
CONTINUED_WARMUP = 0.06
RECIPE_FIELDS = ("learning_rate", "warmup_steps")  # parsed with default None: the run decides


def _option(parser, name: str, **kwargs) -> None:
    parser.add_argument(f"--{name}", f"--{name.replace('-', '_')}", **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from transformers import HfArgumentParser, TrainingArguments

    data = parser.add_argument_group("data")
    _option(data, "train-file", nargs="+", required=True, metavar="FILE", help="text, .csv or .json(l) files")
    _option(data, "validation-file", nargs="+", metavar="FILE", help="held-out files, same kind (evaluation)")
    _option(data, "text-column", default="text", help="the text column of .csv / .json(l) files")
    _option(data, "max-seq-length", type=int, default=512, help="tokens per sequence (texts are concatenated)")
    _option(
        data,
        "line-by-line",
        action="store_true",
        help="each document (line) its own sequence, padded, instead of concatenated and cut (run_mlm.py's option)",
    )
    _option(data, "preprocessing-num-workers", type=int, default=None, help="processes for tokenizing")
    _option(
        data,
        "validation-split-percentage",
        type=float,
        default=5.0,
        help="without --validation-file: percent of the training sequences held out for the final check (default 5)",
    )
    model = parser.add_argument_group("model and objective")
    _option(model, "objective", choices=("rtd", "mlm"), default="rtd", help="replaced-token detection or masked LM")
    _option(model, "embedding-sharing", choices=("gdes", "es", "none"), default="gdes", help="rtd: embedding sharing")
    _option(model, "tokenizer", metavar="PATH", help="a tokenizer folder, Hub id or spm.model")
    _option(model, "vocab-size", type=int, metavar="N", help="train a SentencePiece tokenizer of N pieces instead")
    _option(model, "config", metavar="NAME|PATH", help=f"one of {', '.join(PRESETS)} or a config.json (default xsmall)")
    _option(model, "init-from", metavar="MODEL", help="continue pretraining from a DeBERTa folder or Hub id")
    _option(model, "init-generator", metavar="MODEL", help="rtd: start the generator from this masked-LM model")
    _option(model, "generator-layers", type=int, metavar="N", help="rtd: generator depth (default half)")
    _option(model, "rtd-weight", type=float, default=10.0, help="rtd: loss = generator loss + W * discriminator loss")
    _option(model, "mlm-probability", type=float, default=0.15, help="fraction of tokens masked")
    _option(model, "whole-word-mask", action="store_true", help="mask whole words")
    _option(
        model,
        "enhanced-mask-decoder",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="mlm: predict with the Enhanced Mask Decoder (default: on with the presets, else the config's own)",
    )

    training = parser.add_argument_group("training (every transformers.TrainingArguments option)")
    hints = typing.get_type_hints(TrainingArguments)
    for training_field in dataclasses.fields(TrainingArguments):
        if not training_field.init:
            continue
        training_field = copy.copy(training_field)
        training_field.type = hints[training_field.name]
        if training_field.name == "output_dir" or training_field.name in RECIPE_FIELDS:
            training_field.default = None
        HfArgumentParser._parse_dataclass_field(training, training_field)


def preset_of(args: argparse.Namespace) -> str:
    """The preset whose recipe fits the run's model: the named preset, else the one of the nearest width."""
    name = args.config or "xsmall"
    if name in PRESETS:
        return name
    try:
        hidden = model_config(args, 16, 0).hidden_size
    except ValueError:
        return "xsmall"  # the config's own error comes later, with its message
    return min(PRESETS, key=lambda preset: abs(PRESETS[preset]["hidden_size"] - hidden) + (preset == "small"))


def default_recipe(args: argparse.Namespace) -> dict:
    """The learning rate and warm-up the run uses where the command line names none, and why."""
    if args.init_from:
        recipe = dict(learning_rate=CONTINUED_LEARNING_RATE, warmup_steps=CONTINUED_WARMUP)
        reason = "continued pretraining (--init-from)"
    else:
        preset = preset_of(args)
        recipe = dict(learning_rate=SCRATCH_LEARNING_RATES[preset], warmup_steps=SCRATCH_WARMUP)
        reason = f"pretraining the {preset} shape from scratch"
    chosen = {}
    for name, value in recipe.items():
        given = getattr(args, name, None)
        chosen[name] = (value, "default for " + reason) if given is None else (given, "given")
    return chosen


def describe_recipe(chosen: dict, max_steps: int) -> str:
    (rate, rate_source), (warmup, warmup_source) = chosen["learning_rate"], chosen["warmup_steps"]
    steps = f"{warmup:g} of {max_steps} steps" if 0 < warmup < 1 and max_steps > 0 else f"{warmup:g} steps"
    return f"recipe: learning rate {rate:g} ({rate_source}), warm-up {steps} ({warmup_source})"


def training_arguments(args: argparse.Namespace):
    from transformers import TrainingArguments

    if not args.output_dir:
        raise ValueError("give --output-dir DIR")
    values = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(TrainingArguments) if f.init and hasattr(args, f.name)
    }
    for name, (value, _) in default_recipe(args).items():
        values[name] = value
    values["remove_unused_columns"] = False  # the collator makes the model's inputs
    values["prediction_loss_only"] = True  # evaluation reports the objective's metrics, not logits
    return TrainingArguments(**values)


# ----------------------------------------------------------------------------------------------------------------------
# Checks before anything is written


def read_model_config(path: str, option: str):
    """The config of a DeBERTa model folder / Hub id, as a `DisentangledConfig`; ValueError when it is not one."""
    from transformers import PretrainedConfig

    from ..configuration import DisentangledConfig

    try:  # the raw dict: DisentangledConfig's own reading turns a deberta-v2 one into ours, model_type gone
        config_dict, _ = PretrainedConfig.get_config_dict(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"{option} {path}: no model config found ({error})") from error
    model_type = config_dict.get("model_type")
    if model_type not in DEBERTA_MODEL_TYPES:
        hint = " (DeBERTa v1: run `disentangled convert` first)" if model_type == "deberta" else ""
        raise ValueError(
            f"{option} {path} is a {model_type or 'model without model_type'} model, not DeBERTa-v2/v3-shaped; "
            f"give a converted or transformers DeBERTa-v2/v3 folder or Hub id{hint}"
        )
    return DisentangledConfig.from_dict(config_dict)


def model_config(args, vocab_size: int, pad_token_id: int):
    from ..configuration import DisentangledConfig

    if args.init_from:
        config = read_model_config(args.init_from, "--init-from")
        if config.vocab_size < vocab_size:
            raise ValueError(
                f"--init-from {args.init_from} has {config.vocab_size} embeddings but the tokenizer {vocab_size} "
                "tokens; use the model's own tokenizer"
            )
        return config
    name = args.config or "xsmall"
    if name in PRESETS:
        return DisentangledConfig(**V3, **PRESETS[name], vocab_size=vocab_size, pad_token_id=pad_token_id)
    path = Path(name)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--config {name}: neither one of {', '.join(PRESETS)} nor a config.json")
    config = read_model_config(str(path.parent if path.name == "config.json" else path), "--config")
    config.vocab_size, config.pad_token_id = vocab_size, pad_token_id
    return config


def check_lengths(config, max_seq_length: int, absolute_table: bool, who: str) -> None:
    if max_seq_length < 8:
        raise ValueError(f"--max-seq-length must be at least 8, got {max_seq_length}")
    if absolute_table and max_seq_length > config.max_position_embeddings:
        raise ValueError(
            f"--max-seq-length {max_seq_length} is longer than the {who}'s absolute position table "
            f"(max_position_embeddings {config.max_position_embeddings}); use --max-seq-length "
            f"{config.max_position_embeddings} or less"
        )


def check_loaded(model, info: dict, path: str, option: str) -> None:
    """A checkpoint whose encoder weights did not load is not DeBERTa-shaped."""
    missing = [key for key in info.get("missing_keys", []) if key.startswith("deberta.")]
    if not model.config.position_biased_input:  # the decoder's absolute table: new where the checkpoint has none
        missing = [key for key in missing if key != "deberta.embeddings.position_embeddings.weight"]
    mismatched = info.get("mismatched_keys", [])
    if missing or mismatched:
        names = [str(key) for key in (missing or mismatched)][:3]
        raise ValueError(
            f"{option} {path} is not DeBERTa-shaped: its weights lack or mis-shape {', '.join(names)}"
            + (f" and {len(missing or mismatched) - 3} more" if len(missing or mismatched) > 3 else "")
        )


# ----------------------------------------------------------------------------------------------------------------------
# Building the objective


def _load(model_class, path: str, option: str, config=None):
    kwargs = {"output_loading_info": True}
    if config is not None:
        kwargs["config"] = config
    try:
        model, info = model_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError, RuntimeError) as error:
        raise ValueError(f"{option} {path}: could not load the weights ({error})") from error
    check_loaded(model, info, path, option)
    return model


def build_objective(args, tokenizer, masking=None):
    """The module `Trainer` trains (ReplacedTokenDetectionPretraining or MaskedLMPretraining)."""
    import torch

    from ..modeling import DisentangledForMaskedLM
    from . import (
        MaskedLMPretraining,
        ReplacedTokenDetectionPretraining,
        check_sharing,
        generator_config,
    )

    vocab_size = len(tokenizer)
    config = model_config(args, vocab_size, tokenizer.pad_token_id)
    config.vocab_size = max(config.vocab_size, vocab_size)

    if args.objective == "mlm":
        if args.enhanced_mask_decoder is not None:
            config.enhanced_mask_decoder = args.enhanced_mask_decoder
        elif not args.init_from and (args.config or "xsmall") in PRESETS:  # else the config's (checkpoint's) own
            config.enhanced_mask_decoder = True
        emd = bool(getattr(config, "enhanced_mask_decoder", False))
        check_lengths(config, args.max_seq_length, config.position_biased_input or emd, "model")
        if args.init_from:
            model = _load(DisentangledForMaskedLM, args.init_from, "--init-from", config)
        else:
            torch.manual_seed(args.seed)
            model = DisentangledForMaskedLM(config)
        return MaskedLMPretraining(model, masking, global_token_mean=True)

    from ..modeling import DisentangledForReplacedTokenDetection

    config.enhanced_mask_decoder = False
    if args.init_generator:
        gen_config = read_model_config(args.init_generator, "--init-generator")
    else:
        gen_config = generator_config(config, args.generator_layers)
    check_sharing(gen_config, config, args.embedding_sharing)
    check_lengths(config, args.max_seq_length, config.position_biased_input, "discriminator")
    check_lengths(gen_config, args.max_seq_length, True, "generator")

    torch.manual_seed(args.seed)
    if args.init_from:
        discriminator = _load(DisentangledForReplacedTokenDetection, args.init_from, "--init-from", config)
    else:
        discriminator = DisentangledForReplacedTokenDetection(config)
    if args.init_generator:
        generator = _load(DisentangledForMaskedLM, args.init_generator, "--init-generator")
    elif args.init_from:  # the discriminator's embeddings and lowest layers, heads where the checkpoint has them
        generator = _load(DisentangledForMaskedLM, args.init_from, "--init-from", gen_config)
    else:
        generator = DisentangledForMaskedLM(gen_config)
    return ReplacedTokenDetectionPretraining(
        generator,
        discriminator,
        args.embedding_sharing,
        args.rtd_weight,
        masking=masking,
        keep_discriminator_tables=bool(args.init_from),  # else E_delta = 0: E_D = E_G at step 0
        global_token_mean=True,  # losses over the step's tokens, whichever process holds them
    )


# ----------------------------------------------------------------------------------------------------------------------
# Saving


def write_model_folder(model, tokenizer_files, folder: Path, card: str) -> None:
    """An ordinary, complete model folder: config (+ auto_map), safetensors, tokenizer, remote-code bundle, card."""
    from ..conversion.bundle import auto_map, write_bundle

    model.save_pretrained(folder, safe_serialization=True)
    tokenizer_files.save(folder)
    write_bundle(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = auto_map()
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "README.md").write_text(card)


def model_card(role: str, model, args, facts: dict) -> str:
    auto_class = {"discriminator": "AutoModelForPreTraining"}.get(role, "AutoModelForMaskedLM")
    objective = (
        f"replaced-token detection (ELECTRA-style, DeBERTa-v3), embedding sharing `{args.embedding_sharing}`, "
        f"loss = generator MLM + {args.rtd_weight:g} x discriminator"
        if args.objective == "rtd"
        else "masked language modelling (80/10/10)"
    )
    start = f"continued from `{args.init_from}`" if args.init_from else "trained from scratch"
    config = model.config
    return "\n".join(
        [
            "---",
            "library_name: transformers",
            "tags: [custom_code, deberta, disentangled-attention, pretraining]",
            "---",
            "",
            f"# DeBERTa {role}, pretrained with `disentangled pretrain`",
            "",
            f"- Objective: {objective}; {start}.",
            f"- Role: {role} ({type(model).__name__}, {config.num_hidden_layers} layers, hidden size {config.hidden_size}).",
            f"- Masking: {args.mlm_probability:g} of the tokens{' (whole words)' if args.whole_word_mask else ''}.",
            f"- Data: {facts['documents']} documents, {facts['sequences']} sequences of {args.max_seq_length} tokens "
            f"({facts['tokens']} tokens) from {', '.join(Path(f).name for f in args.train_file)}.",
            f"- Training: {facts['steps']} optimizer steps, {facts['tokens_seen']} tokens seen; final loss {facts['loss']}.",
            "",
            "```python",
            f"from transformers import {auto_class}, AutoTokenizer",
            f"model = {auto_class}.from_pretrained('path/to/this/folder', trust_remote_code=True)",
            "tokenizer = AutoTokenizer.from_pretrained('path/to/this/folder')",
            "```",
            "",
        ]
    )


# ----------------------------------------------------------------------------------------------------------------------
# The command


def run(args: argparse.Namespace) -> int:
    import datasets
    import transformers
    from transformers.trainer_utils import get_last_checkpoint

    from ..integrations.sharding import WrapCheck, is_sharded, unsharded_copy
    from . import MaskingCollator, PaddingCollator, PretrainingTrainer, check_mask_token
    from .data import (
        check_data_files,
        load_texts,
        load_tokenizer,
        tokenize_and_group,
        train_tokenizer,
        training_text_lines,
    )

    training_args = training_arguments(args)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    logging.getLogger("disentangled.pretraining").setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    logger.warning(
        "process %d of %d, device %s", training_args.process_index, training_args.world_size, training_args.device
    )

    # Everything that can be wrong with the input is found here, before anything is written.
    if (args.tokenizer is None) == (args.vocab_size is None) and not (args.init_from and args.vocab_size is None):
        raise ValueError("give --tokenizer PATH or --vocab-size N (or --init-from a model that has a tokenizer)")
    if args.config and args.init_from:
        raise ValueError("give --config or --init-from, not both (--init-from brings its config)")
    if args.objective == "mlm" and (args.init_generator or args.generator_layers):
        raise ValueError("--init-generator and --generator-layers are for --objective rtd")
    train_files = check_data_files(args.train_file, "--train-file")
    validation_files = check_data_files(args.validation_file, "--validation-file") if args.validation_file else None
    with training_args.main_process_first(desc="reading the text"):
        train_texts = load_texts(train_files, args.text_column, "--train-file")
        validation_texts = (
            load_texts(validation_files, args.text_column, "--validation-file") if validation_files else None
        )

    scratch = Path(tempfile.mkdtemp(prefix="disentangled-pretrain-"))
    try:
        if args.vocab_size is not None:
            with training_args.main_process_first(desc="training the tokenizer"):
                tokenizer_files = train_tokenizer(training_text_lines(train_texts), args.vocab_size, scratch / "spm")
        else:
            tokenizer_files = load_tokenizer(args.tokenizer or args.init_from)
        tokenizer = tokenizer_files.tokenizer
        check_mask_token(tokenizer)
        masking = MaskingCollator(
            tokenizer,
            objective=args.objective,
            mlm_probability=args.mlm_probability,
            whole_word_mask=args.whole_word_mask,
            seed=args.seed,  # drawn per sequence: the same masks and samples on any number of processes
        )
        module = build_objective(args, tokenizer, masking)  # masks in its forward, after Trainer restores RNG state

        with training_args.main_process_first(desc="tokenizing"):
            train_dataset = tokenize_and_group(
                train_texts, tokenizer, args.max_seq_length, args.preprocessing_num_workers, args.line_by_line
            )
            eval_dataset = (
                tokenize_and_group(
                    validation_texts, tokenizer, args.max_seq_length, args.preprocessing_num_workers, args.line_by_line
                )
                if validation_texts is not None
                else None
            )
        if len(train_dataset) == 0:
            raise ValueError(
                f"the training text is shorter than one sequence of --max-seq-length {args.max_seq_length} tokens; "
                "give more text or a smaller --max-seq-length"
            )
        held_out = eval_dataset
        if held_out is None:
            train_dataset, held_out = split_held_out(train_dataset, args.validation_split_percentage, args.seed)
        logger.info(
            "%d documents -> %d sequences of %d tokens%s",
            len(train_texts),
            len(train_dataset),
            args.max_seq_length,
            f" (+ {len(held_out)} held out for the final check)" if eval_dataset is None and held_out else "",
        )
        if training_args.process_index == 0:
            print(describe_recipe(default_recipe(args), training_args.max_steps), flush=True)

        trainer = PretrainingTrainer(
            model=module,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=PaddingCollator(tokenizer),
        )
        trainer.add_callback(WrapCheck())  # FSDP: a wrap policy that parts a table from its reader fails clearly
        checkpoint = training_args.resume_from_checkpoint
        if checkpoint is None and Path(training_args.output_dir).is_dir():
            checkpoint = get_last_checkpoint(training_args.output_dir)  # continue an interrupted run
            if checkpoint:
                logger.info("resuming from %s", checkpoint)
        result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
        if eval_dataset is not None and training_args.do_eval:
            trainer.save_metrics("eval", trainer.evaluate())
        verdict = final_check(trainer, held_out, args.objective, args.seed)
        if verdict is not None and trainer.is_world_process_zero():
            trainer.save_metrics("held_out", verdict[0])
            print(verdict[1], flush=True)

        if is_sharded(trainer):  # every process hands its shard in; the main process saves the whole objective
            module = unsharded_copy(trainer, lambda: build_objective(args, tokenizer))
        if trainer.is_world_process_zero():
            facts = {
                "documents": len(train_texts),
                "sequences": len(train_dataset),
                "tokens": sum(map(len, train_dataset["input_ids"]))
                if args.line_by_line
                else len(train_dataset) * args.max_seq_length,
                "steps": trainer.state.global_step,
                "tokens_seen": trainer.state.global_step
                * training_args.per_device_train_batch_size
                * training_args.gradient_accumulation_steps
                * training_args.world_size
                * args.max_seq_length,
                "loss": f"{result.training_loss:.4f}",
            }
            save_outputs(module, tokenizer_files, Path(training_args.output_dir), args, facts)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def split_held_out(dataset, percentage: float, seed: int):
    """(training, held-out) sequences: `percentage` percent of them held out (none below 20 sequences or at 0%)."""
    if not 0 <= percentage < 100:
        raise ValueError(f"--validation-split-percentage must be in [0, 100), got {percentage}")
    count = int(len(dataset) * percentage / 100)
    if count == 0 or len(dataset) < 20:
        return dataset, None
    parts = dataset.train_test_split(test_size=count, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def final_check(trainer, held_out, objective: str, seed: int) -> tuple[dict, str] | None:
    """Held-out figures and the run's last line: did the discriminator learn (ROC-AUC against 0.5)? For MLM, the
    model's accuracy on masked held-out tokens. None without held-out sequences."""
    import torch

    from . import LEARNED_AUC

    if held_out is None or len(held_out) == 0:
        if objective == "rtd":
            logger.warning("no held-out text (--validation-file or --validation-split-percentage): no final check")
        return None
    state = torch.random.get_rng_state()
    torch.manual_seed(seed + 1)  # the same masks and samples for every run with this seed
    try:
        figures = trainer.evaluate(eval_dataset=held_out, metric_key_prefix="held_out")
    finally:
        torch.random.set_rng_state(state)
    if objective == "mlm":
        accuracy = figures.get("held_out_masked_accuracy", float("nan"))
        return figures, f"held-out check: accuracy on masked tokens {accuracy:.3f} ({len(held_out)} sequences)"
    auc = figures.get("held_out_discriminator_auc", float("nan"))
    learned = auc >= LEARNED_AUC
    line = (
        f"held-out check: the discriminator {'learned' if learned else 'did NOT learn'}: ROC-AUC {auc:.3f} on the "
        f"generator's replacements in {len(held_out)} held-out sequences (0.5 = no better than a guess; "
        f"learned = at least {LEARNED_AUC}); the generator's accuracy on masked tokens "
        f"{figures.get('held_out_generator_accuracy', float('nan')):.3f}"
    )
    if not learned:
        line += "; see docs/pretraining.md, 'A discriminator that does not learn'"
    return figures, line


def save_outputs(module, tokenizer_files, output_dir: Path, args, facts: dict) -> None:
    """DIR/discriminator and DIR/generator (rtd), or the model in DIR (mlm); each written whole to a scratch folder
    beside it first, so that a failure leaves no half-written model folder."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.objective == "mlm":
        models = {"masked-LM model": (module.export_model(), output_dir)}
    else:
        models = {
            "discriminator": (module.export_discriminator(), output_dir / "discriminator"),
            "generator": (module.export_generator(), output_dir / "generator"),
        }
    for role, (model, folder) in models.items():
        scratch = output_dir / f".{folder.name}.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        write_model_folder(model, tokenizer_files, scratch, model_card(role, model, args, facts))
        if folder == output_dir:  # mlm: the files go beside the checkpoints
            for item in scratch.iterdir():
                item.replace(output_dir / item.name)
            scratch.rmdir()
        else:
            shutil.rmtree(folder, ignore_errors=True)
            scratch.rename(folder)
        logger.info("saved the %s to %s", role, folder)
