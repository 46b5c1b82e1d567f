"""disentangled: DeBERTa's disentangled attention as a first-class Hugging Face Transformers architecture.

`import disentangled` registers `DisentangledConfig` and every head with transformers' Auto classes.
"""

from .configuration import DisentangledConfig
from .explain import explain_attention, explain_texts
from .modeling import (
    DisentangledForMaskedLM,
    DisentangledForMultipleChoice,
    DisentangledForQuestionAnswering,
    DisentangledForReplacedTokenDetection,
    DisentangledForSequenceClassification,
    DisentangledForTokenClassification,
    DisentangledModel,
    DisentangledPreTrainedModel,
)
from .quantization import quantize_dynamic
from .registration import register

register()

__version__ = "0.1.0"

__all__ = [
    "DisentangledConfig",
    "DisentangledPreTrainedModel",
    "DisentangledModel",
    "DisentangledForMaskedLM",
    "DisentangledForReplacedTokenDetection",
    "DisentangledForSequenceClassification",
    "DisentangledForTokenClassification",
    "DisentangledForQuestionAnswering",
    "DisentangledForMultipleChoice",
    "register",
    "explain_attention",
    "explain_texts",
    "quantize_dynamic",
]
