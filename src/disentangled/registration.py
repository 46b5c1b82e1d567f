"""Registration of the architecture with transformers' Auto classes."""

from __future__ import annotations

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForPreTraining,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration import DisentangledConfig
from .modeling import (
    DisentangledForMaskedLM,
    DisentangledForMultipleChoice,
    DisentangledForQuestionAnswering,
    DisentangledForReplacedTokenDetection,
    DisentangledForSequenceClassification,
    DisentangledForTokenClassification,
    DisentangledModel,
)

# Auto class name -> our class; the converter writes the same table into config.json's auto_map.
AUTO_CLASSES = {
    "AutoModel": (AutoModel, DisentangledModel),
    "AutoModelForMaskedLM": (AutoModelForMaskedLM, DisentangledForMaskedLM),
    "AutoModelForSequenceClassification": (AutoModelForSequenceClassification, DisentangledForSequenceClassification),
    "AutoModelForTokenClassification": (AutoModelForTokenClassification, DisentangledForTokenClassification),
    "AutoModelForQuestionAnswering": (AutoModelForQuestionAnswering, DisentangledForQuestionAnswering),
    "AutoModelForMultipleChoice": (AutoModelForMultipleChoice, DisentangledForMultipleChoice),
    # what transformers loads ELECTRA-style discriminators with
    "AutoModelForPreTraining": (AutoModelForPreTraining, DisentangledForReplacedTokenDetection),
}


def register() -> None:
    """Register the config and every head; safe to call more than once."""
    AutoConfig.register(DisentangledConfig.model_type, DisentangledConfig, exist_ok=True)
    for auto_class, model_class in AUTO_CLASSES.values():
        auto_class.register(DisentangledConfig, model_class, exist_ok=True)
