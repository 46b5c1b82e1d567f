"""disentangled: DeBERTa's disentangled attention as a first-class Hugging Face Transformers architecture.

`import disentangled` registers `DisentangledConfig` and every head with transformers' Auto classes;
`disentangled.accelerate(model)` and `disentangled.enable()` run our attention inside transformers' own DeBERTa models.
"""

from .acceleration import accelerate, disable, enable
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
    "accelerate",
    "enable",
    "disable",
    "explain_attention",
    "explain_texts",
    "quantize_dynamic",
]
