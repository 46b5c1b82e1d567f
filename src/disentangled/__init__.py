"""disentangled: DeBERTa's disentangled attention as a first-class Hugging Face Transformers architecture.

`import disentangled` registers `DisentangledConfig` and every head with transformers' Auto classes;
`disentangled.accelerate(model)` and `disentangled.enable()` run our attention inside transformers' own DeBERTa models
(`disentangled.restore(model)` takes it out again).

The package, one folder per job (docs/internals/architecture.md draws how they connect):

- `configuration/`, `modeling/`: the architecture, which is also the Hub bundle's remote code;
- `conversion/`: DeBERTa checkpoints in, converted folders and Hub repos out (`disentangled convert`, `push`);
- `pretraining/`: RTD with GDES and masked LM, their data, `disentangled pretrain`;
- `explain/`: each attention term, its statistics and figures, `disentangled explain`;
- `serving/`: int8 in PyTorch and ONNX export (`disentangled export-onnx`);
- `integrations/`: our attention in transformers' own DeBERTa models, tokenizers for transformers 4.57 and 5;
- `demo/`: `disentangled demo` and its built-in data;
- `environment/`: `disentangled env`, the machine's facts for a bug report and every benchmark record.

At the top, only the public surface: this file, `cli.py` (the `disentangled` command), `registration.py` (the Auto
classes) and `qa.py` (`disentangled.qa.answer_question`, extractive QA where transformers 5 has no pipeline).
"""

from .configuration import DisentangledConfig
from .explain import explain_attention, explain_texts
from .integrations import accelerate, disable, enable, restore
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
from .registration import register
from .serving import (
    quantization,  # noqa: F401  (`disentangled.quantization.default_engine()`, docs/serving.md)
    quantize_dynamic,
)

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
    "restore",
    "enable",
    "disable",
    "explain_attention",
    "explain_texts",
    "quantize_dynamic",
]
