"""Fine-tune transformers' own DeBERTa-v3-shaped classifier, accelerated in place (`disentangled.accelerate`), with
Trainer: the job tests/test_sharded.py runs on one process and sharded. Dropout off; 16 fixed examples; 3 steps.

    python accelerated_finetune_job.py OUTPUT_DIR PER_DEVICE_BATCH
"""

from __future__ import annotations

import sys

import torch
from deberta_shapes import V3_COMMON
from transformers import DebertaV2Config, DebertaV2ForSequenceClassification, Trainer, TrainingArguments

import disentangled
from disentangled.integrations import is_accelerated
from disentangled.integrations.sharding import WrapCheck


def main(output_dir: str, batch: int) -> None:
    config = DebertaV2Config(
        **{**V3_COMMON, "position_buckets": 32},
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = disentangled.accelerate(DebertaV2ForSequenceClassification(config))
    draws = torch.Generator().manual_seed(1)
    examples = [
        {"input_ids": torch.randint(3, 100, (12,), generator=draws), "labels": index % 2} for index in range(16)
    ]
    args = TrainingArguments(
        output_dir=output_dir, max_steps=3, per_device_train_batch_size=batch, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        # transformers' DeBERTa heads take **kwargs, so Trainer reads them as normalising by num_items_in_batch and
        # multiplies their mean loss by the number of processes; ours declare accepts_loss_kwargs = False
        average_tokens_across_devices=False,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=examples, callbacks=[WrapCheck()])
    trainer.train()
    assert is_accelerated(trainer.model)  # still our attention after sharding
    if trainer.is_fsdp_enabled:  # the saved folder holds the whole model
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
