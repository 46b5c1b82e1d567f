from .modeling_disentangled import (
    DisentangledForMaskedLM,
    DisentangledForMultipleChoice,
    DisentangledForQuestionAnswering,
    DisentangledForReplacedTokenDetection,
    DisentangledForSequenceClassification,
    DisentangledForTokenClassification,
    DisentangledModel,
    DisentangledPreTrainedModel,
)

__all__ = [
    "DisentangledPreTrainedModel",
    "DisentangledModel",
    "DisentangledForMaskedLM",
    "DisentangledForReplacedTokenDetection",
    "DisentangledForSequenceClassification",
    "DisentangledForTokenClassification",
    "DisentangledForQuestionAnswering",
    "DisentangledForMultipleChoice",
]
