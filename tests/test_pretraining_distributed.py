"""`disentangled pretrain` on 2 CPU processes under torchrun and accelerate launch (DDP over gloo): generator and
discriminator are one module to Trainer, every parameter receives a gradient (find_unused_parameters off), each
process trains the same SentencePiece tokenizer (--vocab-size), and rank 0 saves both folders."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from pretraining_helpers import pretrain_args
from test_distributed import LAUNCHERS, free_port

VOCAB_SIZE = 120


@pytest.mark.parametrize(
    "launcher", ["torchrun", pytest.param("accelerate", marks=pytest.mark.slow)], ids=lambda name: name
)
def test_rtd_pretraining_on_two_processes(tmp_path, launcher):
    output = tmp_path / "out"
    args = pretrain_args(tmp_path, output, "--logging-steps", "2", "--generator-layers", "1", steps=4)
    args[args.index("--log_level") + 1] = "warning"
    at = args.index("--tokenizer")
    args[at : at + 2] = ["--vocab-size", str(VOCAB_SIZE)]
    port = ["--main_process_port", str(free_port())] if launcher == "accelerate" else []
    command = [*LAUNCHERS[launcher], *port, "-m", "disentangled.cli", *args, "--ddp_find_unused_parameters", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    assert "process 0 of 2" in log and "process 1 of 2" in log

    state = json.loads((output / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    logs = [entry for entry in state["log_history"] if "loss" in entry]
    assert len(logs) == 2 and all("discriminator_auc" in entry and "generator_accuracy" in entry for entry in logs)
    for role in ("discriminator", "generator"):
        assert (output / role / "model.safetensors").is_file() and (output / role / "spm.model").is_file()
        assert json.loads((output / role / "config.json").read_text())["vocab_size"] == VOCAB_SIZE + 1  # + [MASK]


def _metrics_on_rank(rank: int, port: int, scores: list, labels: list, results) -> None:
    import torch

    from disentangled.pretraining import PretrainingMetrics

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        metrics = PretrainingMetrics()
        mine = torch.tensor(scores[rank]).view(1, -1)
        metrics.update_discriminator(torch.tensor(0.3), mine, torch.tensor(labels[rank]).view(1, -1))
        results[rank] = metrics.compute()["discriminator_auc"]
    finally:
        torch.distributed.destroy_process_group()


def test_the_auc_is_computed_over_the_tokens_of_every_process():
    """Two processes with different numbers of labelled tokens: each reads the AUC of all of them together, which
    neither process's own AUC (nor their mean) gives."""
    import torch
    import torch.multiprocessing as mp

    from disentangled.pretraining import roc_auc

    scores = [[0.1, 0.2, 0.9], [0.3, 0.8, 0.4, 0.5, 0.05]]
    labels = [[0, 0, 1], [0, 1, 1, 0, 0]]
    expected = roc_auc(torch.tensor(scores[0] + scores[1]), torch.tensor(labels[0] + labels[1]))
    own = [roc_auc(torch.tensor(s), torch.tensor(y)) for s, y in zip(scores, labels)]
    assert abs(expected - sum(own) / 2) > 0.01
    results = mp.Manager().dict()
    mp.spawn(_metrics_on_rank, args=(free_port(), scores, labels, results), nprocs=2, join=True)
    assert results[0] == results[1] == pytest.approx(expected, abs=1e-4)
