"""The architecture: the model, its heads and the attention backends, flat because the Hub bundle is these files (all
but `native.py` and `kernel_check.py`, which are the package's: `conversion/bundle.py` lists what runs there).

The files are layered, each computing what the one below it computes (the tests hold each to the reference):

1. the reference: `disentangled_attention.py`, the formula, the bookkeeping of relative positions every backend
   shares, and `eager_disentangled` (a dense bias);
2. the PyTorch backends: `sdpa_attention.py` (the default, the bias one block of query rows at a time) and
   `flex_attention.py` (a compiled `score_mod` over the same tables);
3. the CPU kernels, which sdpa calls: `cpu_inference.py` (inference by distance), `native.py` (the kernels of
   `position_bias.c`, compiled on first use) and `workspace.py` (their buffers);
4. the GPU kernel, which sdpa calls on CUDA: `triton_attention.py`, its tiles per GPU (`triton_tiles.py`) and its
   self-check on first use (`kernel_check.py`).

Which of them serves a call is decided in one place, `dispatch.py`, which the model and sdpa ask on every call and
which reads the switches. Above them, `modeling_disentangled.py` holds the model, the encoder, the heads and the
dispatch table (`ALL_ATTENTION_FUNCTIONS.get_interface`); beside them, `validation.py` checks every forward's inputs.
Picture: docs/internals/architecture.md.
"""

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
