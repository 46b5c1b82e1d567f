"""The GPU anchors `benchmarks.run --device cuda` times ours against: FlashDeBERTa and disentangled-flash.

Both are benchmark baselines, never dependencies of the package: `pip install -e ".[gpu-bench]"` installs
flashdeberta==0.0.8 and disentangled-flash==1.1.1 (on a device machine without a registry, their wheels are carried:
see benchmarks/device_check.py). Neither is imported until an anchor is built, and `build_anchor` returns
(None, why) when the package is missing, the device is not CUDA or the package refuses the shape, so the benchmark
prints why a column is empty instead of failing.

Each anchor is built the way its README tells a user to, from transformers' DeBERTa-v2 model of the same run, so it
has the same config and the same weights (on the same device, in the same dtype):

- FlashDeBERTa ships drop-in model classes: `FlashDebertaV2Model` is transformers' DebertaV2Model whose
  self-attention calls its Triton kernels. Built from the reference's config, then the reference's state_dict is
  loaded with strict=True.
- disentangled-flash swaps the encoder of a transformers DeBERTa-v2 backbone in place (a copy of the reference here):
  `enable_deberta_inference(model, sequence_lengths=[length])` prepares its kernels for one length (it refuses more
  than 8192 tokens), `enable_deberta_training(model)` keeps every parameter trainable. Where its Triton backend cannot
  run it leaves transformers' encoder in place without a word; the builder checks that the swap happened.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata

import torch
from torch import nn

# benchmark name -> (import name, the version pinned in pyproject's gpu-bench extra)
ANCHORS = {
    "flashdeberta": ("flashdeberta", "0.0.8"),
    "disentangled-flash": ("disentangled_flash", "1.1.1"),
}


def version(name: str) -> str | None:
    """The installed version of anchor `name` (its distribution's metadata; nothing is imported), None if absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_flashdeberta(package, reference: nn.Module, training: bool, length: int) -> nn.Module:
    """`FlashDebertaV2Model` on the reference's config and weights; one model serves every length."""
    config = package.FlashDebertaV2Model.config_class.from_dict(reference.config.to_dict())
    with torch.device(reference.device):  # initialised where it runs, then overwritten by the reference's weights
        model = package.FlashDebertaV2Model(config)
    model.load_state_dict(reference.state_dict(), strict=True)
    return model.to(dtype=reference.dtype).train(training)


def build_disentangled_flash(package, reference: nn.Module, training: bool, length: int) -> nn.Module:
    """A copy of the reference with disentangled-flash's encoder swapped in, for inference at `length` tokens or for
    training (any length)."""
    model = copy.deepcopy(reference).train(training)
    if training:
        package.enable_deberta_training(model, backend="triton")
    else:
        package.enable_deberta_inference(model, backend="triton", sequence_lengths=[length])
    if type(model.encoder) is type(reference.encoder):
        raise RuntimeError("it kept transformers' encoder (its Triton backend does not take this model here)")
    return model


BUILDERS = {"flashdeberta": build_flashdeberta, "disentangled-flash": build_disentangled_flash}


def build_anchor(name: str, reference: nn.Module, *, training: bool, length: int) -> tuple[nn.Module | None, str]:
    """Anchor `name` with `reference`'s config, weights, device and dtype (transformers' DebertaV2Model), and "";
    or None and the reason it is left out: not installed, not on CUDA, or the package refused the shape."""
    module_name, pinned = ANCHORS[name]
    try:
        package = importlib.import_module(module_name)
    except ImportError as error:
        return None, f"{name} is not installed ({error}): pip install '{name}=={pinned}' (the gpu-bench extra)"
    except Exception as error:  # not ours: whatever its import raises is the reason it is left out
        return None, f"{name} failed to import: {type(error).__name__}: {error}"
    if reference.device.type != "cuda":
        return None, f"{name} runs its Triton kernels on CUDA only, not on {reference.device.type}"
    try:
        return BUILDERS[name](package, reference, training, length), ""
    except (ValueError, RuntimeError, TypeError, NotImplementedError) as error:
        return None, f"{name} refused {'training' if training else 'inference'} at {length} tokens: {error}"
    except Exception as error:  # an API this version does not have, say: reported, never fatal to the benchmark
        return None, f"{name} could not be built: {type(error).__name__}: {error}"
