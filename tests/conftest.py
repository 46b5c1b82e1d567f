import contextlib
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def switch():
    """Set the attention switches (`dispatch.SWITCHES`) for the rest of a test: `switch(CPU_KERNEL=False)`; each call
    goes through `dispatch.switched`, which checks the names, and all are put back when the test ends."""
    from disentangled.modeling import dispatch

    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(dispatch.switched(**values))
