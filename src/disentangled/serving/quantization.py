"""int8 inference in PyTorch: `disentangled.quantize_dynamic(model)`.

Dynamic quantization: every `nn.Linear` (the query / key / value / output projections, the feed-forward
layers and the heads' dense layers) stores int8 weights, one scale per output channel, and quantizes its input
per batch at run time; everything else (embeddings, LayerNorm, softmax, the c2p / p2c position terms) stays in
float32. CPU only, inference only.

It calls `torch.ao.quantization.quantize_dynamic`, which torch 2.13 still ships but marks deprecated in favour
of the `torchao` package. The equivalent there is

    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    quantize_(model, Int8DynamicActivationInt8WeightConfig())

(`pip install torchao`; not a dependency of this package). For serving, see also `disentangled export-onnx
MODEL_DIR model.onnx --quantize int8` (docs/serving.md).

The int8 products run in the kernels of the quantized engine that packed the weights. On a CPU with AMX int8
tiles (Intel Xeon from Sapphire Rapids on) the weights are packed for oneDNN, whose int8 products use the
tiles (faster there than torch's default x86 engine, which packs for FBGEMM: docs/serving.md); elsewhere
torch's current engine packs them, as torch would.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn


def default_engine() -> str:
    """The engine `quantize_dynamic` packs with: oneDNN on a CPU with AMX int8 tiles (where torch has it), else
    torch's current quantized engine."""
    has_amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if has_amx and "onednn" in torch.backends.quantized.supported_engines:
        return "onednn"
    return torch.backends.quantized.engine


def quantize_dynamic(model: nn.Module, inplace: bool = False, engine: str | None = None) -> nn.Module:
    """`model` with int8 dynamically quantized linear layers (per-channel weights), in eval mode, on the CPU.

    Returns a copy unless `inplace`. The quantized model runs forward only; its linear layers hold packed
    int8 weights (no gradients, no `.to(device)`). `engine` is the quantized engine that packs them, one of
    `torch.backends.quantized.supported_engines` (default: `default_engine()`); torch's global engine setting
    is left as it was.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"quantize_dynamic takes a torch.nn.Module, got {type(model).__name__}")
    devices = {parameter.device.type for parameter in model.parameters()}
    if devices - {"cpu"}:
        raise ValueError(f"quantize_dynamic runs on the CPU; the model is on {sorted(devices)}: call model.cpu() first")
    dtypes = {parameter.dtype for parameter in model.parameters()}
    if dtypes - {torch.float32}:
        raise ValueError(f"quantize_dynamic takes a float32 model, got {sorted(map(str, dtypes))}: call model.float()")
    engine = engine or default_engine()
    if engine not in torch.backends.quantized.supported_engines:
        supported = ", ".join(repr(name) for name in torch.backends.quantized.supported_engines)
        raise ValueError(f"quantize_dynamic: engine {engine!r} is not one this torch has; use one of {supported}")
    from torch.ao.quantization import per_channel_dynamic_qconfig
    from torch.ao.quantization import quantize_dynamic as torch_quantize_dynamic

    model = model if inplace else copy.deepcopy(model)
    model.eval()
    with warnings.catch_warnings():
        # torch.ao's deprecation notice (see the module docstring) and that of quantized tensors, which it
        # builds internally: both name torch's migration, nothing the caller can act on here.
        warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated")
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel")
        previous, torch.backends.quantized.engine = torch.backends.quantized.engine, engine
        try:
            return torch_quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, inplace=True)
        finally:
            torch.backends.quantized.engine = previous
