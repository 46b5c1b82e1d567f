"""`python -m disentangled` is the `disentangled` console command: same parser, same exit codes, same errors."""

from __future__ import annotations

import os
import subprocess
import sys

from disentangled import cli


def run_module(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "disentangled", *argv]
    env = {**os.environ, "COLUMNS": "100"}  # argparse wraps help to the terminal width
    return subprocess.run(command, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=env)


def test_python_dash_m_prints_the_console_commands_help(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    result = run_module("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout == cli.build_parser(None).format_help()
    assert result.stdout.startswith("usage: disentangled ")


def test_python_dash_m_runs_a_command_and_returns_its_exit_code(tmp_path):
    # a real command end to end: the error path of `convert` (missing source) exits 2 with the command's message
    result = run_module("convert", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("disentangled convert: error: ")
    assert not (tmp_path / "out").exists()


def test_python_dash_m_without_a_command_is_a_usage_error():
    result = run_module()
    assert result.returncode == 2
    assert "the following arguments are required: COMMAND" in result.stderr


def test_a_finished_command_tears_down_the_process_group_a_launcher_set_up(monkeypatch, tmp_path):
    """Left to interpreter exit, Gloo's threads can abort a finished process under torchrun; the command destroys the
    default group once it has run (here a one-process gloo group and a stand-in command)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(cli, "_command_function", lambda module, name, command: lambda args: 0)
    try:
        assert dist.is_initialized()
        assert cli.main(["demo"]) == 0
        assert not dist.is_initialized()
    finally:  # a failure here must not leave the group to the tests that follow in this process
        if dist.is_initialized():
            dist.destroy_process_group()
