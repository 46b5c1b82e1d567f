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
