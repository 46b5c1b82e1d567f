"""Pretraining: DeBERTa's own objectives around the package's models, the data they read, and `disentangled pretrain`.

- `objectives.py`: replaced-token detection with embedding sharing (GDES), masked LM, the masking collator, the
  running metrics and the `Trainer` that logs them;
- `data.py`: text files and tokenizers read as transformers' `run_mlm.py` reads them (tokenize once, group into full
  sequences);
- `sequence_draws.py`: masks and generator samples drawn per sequence, and losses as means over every process's
  tokens, so that a run draws and trains alike on any number of processes (docs/multi-gpu.md);
- `command.py`: the `disentangled pretrain` command (docs/pretraining.md);
- `memory.py`: the training state per GPU under DDP and under FSDP2 / ZeRO-3, fine-tuning and RTD (docs/multi-gpu.md).

Exports the objectives' public names, so `from disentangled.pretraining import MaskingCollator` reads as the manual
shows it.
"""

from .objectives import (
    AUC_WARNING_MARGIN,
    IGNORE_INDEX,
    LEARNED_AUC,
    SHARING_MODES,
    WARNING_AFTER_STEPS,
    MaskedLMPretraining,
    MaskingCollator,
    PaddingCollator,
    PretrainingMetrics,
    PretrainingOutput,
    PretrainingTrainer,
    ReplacedTokenDetectionPretraining,
    SharedEmbedding,
    check_mask_token,
    check_sharing,
    gather_variable,
    generator_config,
    random_replacement_auc,
    roc_auc,
    share_embeddings,
)

__all__ = [
    "AUC_WARNING_MARGIN",
    "IGNORE_INDEX",
    "LEARNED_AUC",
    "SHARING_MODES",
    "WARNING_AFTER_STEPS",
    "MaskedLMPretraining",
    "MaskingCollator",
    "PaddingCollator",
    "PretrainingMetrics",
    "PretrainingOutput",
    "PretrainingTrainer",
    "ReplacedTokenDetectionPretraining",
    "SharedEmbedding",
    "check_mask_token",
    "check_sharing",
    "gather_variable",
    "generator_config",
    "random_replacement_auc",
    "roc_auc",
    "share_embeddings",
]
