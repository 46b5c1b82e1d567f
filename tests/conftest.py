import contextlib
import os
import unittest
from collections import Counter

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
    """Under `--dist loadgroup` the tests of a file that share a fixture wider than a test (a trained model, an
    exported graph, a compiled kernel: scope "module" or "class"; a session's is built in each process anyway) run in
    one process, so that it is built once; every other test goes to whichever process is free, so that a long file
    does not keep one process busy while the other waits. A test marked with its own `xdist_group` (the demo's seeds)
    keeps it. The tests marked slow and the groups that hold one are handed out first, then the other groups, the
    largest first, then the single tests, so that no process is left alone at the end with minutes of work."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None and shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the processes take work in this order: the longest first
        slow, sizes = {group(item) for item in items if item.get_closest_marker("slow")}, Counter(map(group, items))
        items.sort(key=lambda item: (group(item) not in slow, -sizes[group(item)]))


def group(item) -> str:
    marker = item.get_closest_marker("xdist_group")
    return marker.args[0] if marker else item.nodeid


def shares_a_fixture(item) -> bool:
    """Whether the test uses a fixture built once for several tests; a unittest class's `setUpClass` fixture (pytest
    makes one for every class) counts only where the class defines its own."""
    for name, definitions in item._fixtureinfo.name2fixturedefs.items():
        if definitions[-1].scope not in ("class", "module", "package"):
            continue
        if name.startswith("_unittest_setUpClass_fixture_") and not sets_up_once(item.cls):
            continue
        return True
    return False


def sets_up_once(cls) -> bool:
    return any(getattr(cls, name).__func__ is not getattr(unittest.TestCase, name).__func__ for name in UNITTEST_ONCE)


UNITTEST_ONCE = ("setUpClass", "tearDownClass")


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
