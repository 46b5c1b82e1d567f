"""examples/finetune.py on 2 CPU processes (DDP over gloo), launched by torchrun and by accelerate launch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from finetune_helpers import QUIET, SCRIPT, fresh_process_check, pretrained_folder, sentiment_files

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
    "accelerate": [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2", "--num_machines=1",
        "--mixed_precision=no", "--dynamo_backend=no",
    ],
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    "launcher", ["torchrun", pytest.param("accelerate", marks=pytest.mark.slow)], ids=lambda name: name
)
def test_two_processes_train_and_save_a_model_that_loads(tmp_path, launcher):
    train, validation = sentiment_files(tmp_path, train=256, validation=64)
    output = tmp_path / "out"
    command = [
        *LAUNCHERS[launcher], *(["--main_process_port", str(free_port())] if launcher == "accelerate" else []),
        str(SCRIPT),
        "--model_name_or_path", str(pretrained_folder(tmp_path / "model")), "--trust_remote_code",
        "--train_file", str(train), "--validation_file", str(validation), "--output_dir", str(output),
        "--do_train", "--do_eval", "--num_train_epochs", "3", "--learning_rate", "3e-3",
        "--per_device_train_batch_size", "8", "--logging_steps", "4", "--save_strategy", "no", "--seed", "0",
        "--ddp_find_unused_parameters", "false", *QUIET[:-2], "--log_level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    assert "process 0 of 2" in log and "process 1 of 2" in log  # both ranks ran

    state = json.loads((output / "trainer_state.json").read_text())
    assert state["global_step"] == 3 * 256 // (2 * 8)  # each step took 8 examples on each of 2 processes
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert abs(losses[0] - 0.693) < 0.05  # ln 2: a mean over the examples, not scaled by the world size
    assert losses[-1] < losses[0] - 0.1  # the loss fell

    loaded = subprocess.run(
        [sys.executable, "-c", fresh_process_check(), str(output)], capture_output=True, text=True, timeout=300
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.strip().splitlines()[-1].count("'") == 4  # two predicted labels
