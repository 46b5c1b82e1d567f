"""Capture the pre-softmax scores of the model's own eager attention, as ground truth for recomputed terms."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from disentangled.modeling import modeling_disentangled


@contextmanager
def eager_scores():
    """Within the block, each call of the eager attention function appends its softmax input, [B, H, L, L].

    The eager function is wrapped in `DISENTANGLED_ATTENTION_FUNCTIONS` (the model looks it up there at each call,
    and output_attentions=True routes there); during that call only, `torch.softmax` records its input. A
    function that softmaxes query rows in chunks has its chunks put back together. That input is the score
    after the model's mask: masked pairs hold finfo.min, every other pair the score itself.
    """
    functions = modeling_disentangled.DISENTANGLED_ATTENTION_FUNCTIONS
    eager = functions["eager"]
    softmax = torch.softmax
    captured: list[torch.Tensor] = []

    def recording_eager(*args, **kwargs):
        chunks = []

        def recording_softmax(scores, *softmax_args, **softmax_kwargs):
            chunks.append(scores.detach().clone())
            return softmax(scores, *softmax_args, **softmax_kwargs)

        torch.softmax = recording_softmax
        try:
            return eager(*args, **kwargs)
        finally:
            torch.softmax = softmax
            assert chunks, "the eager attention function did not call torch.softmax"
            captured.append(torch.cat(chunks, dim=-2))

    functions["eager"] = recording_eager
    try:
        yield captured
    finally:
        functions["eager"] = eager
