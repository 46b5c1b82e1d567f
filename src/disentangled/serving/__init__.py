"""Serving: a trained model made cheaper to run, and checked against itself (docs/serving.md).

- `quantization.py`: int8 in PyTorch, `quantize_dynamic(model)` (oneDNN's int8 products where the CPU has AMX) and
  `default_engine()`;
- `onnx_export.py`: `disentangled export-onnx`, a model folder to ONNX (float32, or int8 with every matrix product
  quantized), checked against PyTorch with onnxruntime;
- `onnx_attention.py`: the kernel graph that `export-onnx --kernel` writes (our operator, one node per layer), and
  `graph(kind)`, the graph an export writes (the fused one by default: `modeling/onnx_fused.py`);
- `forking.py`: a process forked after the model ran (a preloading server's workers) runs torch on one thread, where
  GNU OpenMP's threads would hang it.

Exports `quantize_dynamic` and `default_engine`; the package root exports `quantize_dynamic` too, and
`disentangled.quantization` names `quantization.py` there.
"""

from . import forking  # noqa: F401  (forked children on one thread)
from .quantization import default_engine, quantize_dynamic

__all__ = ["quantize_dynamic", "default_engine"]
