"""Forked workers that answer: a child process limits torch to one intra-op thread.

PyTorch's Linux wheels run their CPU threads on GNU OpenMP, whose thread pool does not survive `fork()`: a child
forked after the parent ran a parallel region (any forward of a model) hangs in its first parallel region of its own
(pytorch/pytorch#49555). Servers fork exactly then: gunicorn `--preload`, `multiprocessing` with the fork start
method, a pre-forking server that loaded the model and warmed it up. `torch.set_num_threads(1)` in the child, before
its first call, avoids the hang, and keeps the memory that the preloaded model shares with its parent.

Importing `disentangled` registers `limit_child_threads` with `os.register_at_fork`: in every child forked from then
on, where torch runs on OpenMP with more than one thread, torch is set to one thread, and one log line says so and how
to choose otherwise (DISENTANGLED_FORK_THREADS=keep leaves torch's setting, for a child that will not run torch, or a
torch built without GNU OpenMP). A worker that wants several threads is started with the spawn method instead
(`multiprocessing.get_context("spawn")`, gunicorn without `--preload`): it loads its own copy of the model.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)
KEEP = "keep"


def uses_openmp() -> bool:
    """Whether torch's intra-op threads are OpenMP's (the Linux wheels: GNU OpenMP)."""
    lines = torch.__config__.parallel_info().splitlines()
    return any(line.startswith("ATen parallel backend:") and "OpenMP" in line for line in lines)


_OPENMP = uses_openmp()


def limit_child_threads() -> None:
    """In a forked child: torch to one intra-op thread where OpenMP runs them (see the module's docstring)."""
    if not _OPENMP or os.environ.get("DISENTANGLED_FORK_THREADS", "").strip().lower() == KEEP:
        return
    threads = torch.get_num_threads()
    if threads <= 1:
        return
    torch.set_num_threads(1)
    logger.warning(
        "disentangled: forked process %d runs torch on 1 thread instead of %d (GNU OpenMP threads hang after fork, "
        "pytorch/pytorch#49555); for several threads per worker start workers with 'spawn', or set "
        "DISENTANGLED_FORK_THREADS=keep to leave torch's setting",
        os.getpid(),
        threads,
    )


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=limit_child_threads)
