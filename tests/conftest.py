import contextlib
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of the processes of `-n 2` (pyproject's addopts): they share the cores.
    # More threads than cores make each of torch's parallel regions wait for a thread that has none (a float64
    # gradcheck took ten times as long); the processes a test starts inherit the count unless it sets its own.
    threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` a test file runs in one process, so that its module-scoped fixtures (trained models,
    exported graphs, compiled kernels) are built once; a test marked with its own `xdist_group` (the demo's seeds)
    runs wherever a process is free."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


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
