"""The architecture: the model, its heads and the attention backends, flat because the Hub bundle is these files (all
but `native.py` and `kernel_check.py`, which are the package's: `conversion/bundle.py` lists what runs there).

The files are layered, each computing what the one below it computes (the tests hold each to the reference), and
each path of `dispatch.PATHS` runs in the file of its name:

1. the reference: `disentangled_attention.py`, the formula, the bookkeeping of relative positions every backend
   shares, and `eager_disentangled` (a dense bias: path eager);
2. the PyTorch backends: `sdpa_attention.py` (the default: the runners' table, sdpa-dense and sdpa-blocked, over
   `blocks.py`, what the blocked paths share), `cpu_training.py` (cpu-training, cpu-training-kernel: a blocked
   attention with its own backward, and dropout's keep mask), `flex_attention.py` (flex: a compiled `score_mod` over
   the same tables) and `onnx_fused.py` (onnx-fused: the graph an ONNX export writes for ONNX Runtime);
3. the CPU kernels, which sdpa calls: `cpu_inference.py` (cpu-fused, cpu-bias-kernel, cpu-by-distance), `native.py`
   (the kernels of `position_bias.c`, compiled on first use) and `workspace.py` (their buffers);
4. the GPU kernel, which sdpa calls on CUDA: `triton_attention.py` (triton), its tiles per GPU (`triton_tiles.py`)
   and its self-check on first use (`kernel_check.py`).

Which of them serves a call is decided in one place, `dispatch.py`, which the model asks once per attention call and
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
