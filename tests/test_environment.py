"""`disentangled env` (`src/disentangled/environment/`): what it reports is what the dispatcher does. The path it
names for a kind of call is the path such a call takes; change a fact or a switch and both change. The same facts go
into every benchmark record. (Its GPU rows against a kernel call: tests/test_triton_attention.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.records import append_record, read_records
from disentangled import cli, environment
from disentangled.modeling import cpu_inference, cpu_training, native, sdpa_attention
from disentangled.modeling.disentangled_attention import PositionScores, RelativePositions, head_scaling

CPU = [{"device": "cpu"}]


def reported(rows: list[dict], dtype: str, mode: str) -> str:
    (row,) = [row for row in rows if row["dtype"] == dtype and row["mode"] == mode]
    return row["path"]


def path_taken(monkeypatch, dtype: torch.dtype, training: bool, p2p: bool = False) -> str:
    """The path a DeBERTa-v3-base attention call of `REPORTED_CALL`'s kind (12 heads of 64, 512 tokens, a key mask,
    c2p + p2c, 256 log buckets; dropout 0.1 in training) takes, seen at the functions each path runs."""
    ran = []
    by_distance, fused, blocked, apply = (
        cpu_inference._attend_by_distance,
        cpu_inference._attend_fused,
        sdpa_attention.blocked_attention,
        cpu_training.BlockedAttention.apply,
    )
    monkeypatch.setattr(
        cpu_inference, "_attend_by_distance", lambda *a, path, **k: ran.append(path) or by_distance(*a, path=path, **k)
    )
    monkeypatch.setattr(cpu_inference, "_attend_fused", lambda *a: ran.append("cpu-fused") or fused(*a))
    monkeypatch.setattr(sdpa_attention, "blocked_attention", lambda *a: ran.append("sdpa-blocked") or blocked(*a))
    monkeypatch.setattr(
        cpu_training.BlockedAttention,
        "apply",
        lambda *a: ran.append("cpu-training-kernel" if a[-1] else "cpu-training") or apply(*a),
    )
    generator = torch.Generator().manual_seed(0)
    positions = RelativePositions.build(512, 256, 256, 512, "cpu")
    scaling = head_scaling(64, 4 if p2p else 3)
    query, key, value = (torch.randn(1, 12, 512, 64, generator=generator).to(dtype) for _ in range(3))
    pos_key, pos_query = (torch.randn(12, positions.width, 64, generator=generator).to(dtype) for _ in range(2))
    for tensor in (query, key, value, pos_key, pos_query):
        tensor.requires_grad_(training)
    p2p_term = torch.zeros(12, 2 * 512 - 1, dtype=dtype) if p2p else None
    mask = torch.ones(1, 1, 1, 512, dtype=torch.bool)
    mask[..., 400:] = False
    with torch.set_grad_enabled(training):
        scores = PositionScores(query, key, pos_key, pos_query, p2p_term, positions)
        context, _ = sdpa_attention.sdpa_disentangled(
            None, query, key, value, mask, scaling, 0.1 if training else 0.0, scores
        )
    if training:
        context.float().sum().backward()
    monkeypatch.undo()
    (path,) = ran
    return path


def test_the_report_names_the_path_each_kind_of_call_takes(monkeypatch, switch):
    """Each CPU row of the report against a real call of its kind; then with a fact changed (the p2p term) and with
    the compiled kernels switched off: the report and the calls change together."""
    rows = environment.paths(CPU)
    assert {(row["dtype"], row["mode"]) for row in rows} == {
        (dtype, mode) for dtype in ("float32", "bfloat16") for mode in ("inference", "training")
    } | {("float32", f"onnx {graph}") for graph in ("fused", "kernel", "portable")}
    for dtype in (torch.float32, torch.bfloat16):
        for training in (False, True):
            name, mode = str(dtype).removeprefix("torch."), "training" if training else "inference"
            assert reported(rows, name, mode) == path_taken(monkeypatch, dtype, training), (name, mode)
    with_p2p = environment.paths(CPU, terms=("c2p", "p2c", "p2p"))
    assert reported(with_p2p, "float32", "inference") == path_taken(monkeypatch, torch.float32, False, p2p=True)
    assert reported(with_p2p, "float32", "inference") == "sdpa-blocked" != reported(rows, "float32", "inference")
    switch(CPU_KERNEL=False, TRAINING_KERNEL=False)
    off = environment.paths(CPU)
    assert reported(off, "float32", "inference") == path_taken(monkeypatch, torch.float32, False) == "cpu-by-distance"
    assert reported(off, "float32", "training") == path_taken(monkeypatch, torch.float32, True) == "cpu-training"
    if native.available():  # where the kernels build, switching them off changes the path (and the report)
        assert reported(rows, "float32", "inference") != "cpu-by-distance"
        assert reported(rows, "float32", "training") == "cpu-training-kernel"


def test_env_command_prints_the_report_and_its_json(capsys):
    assert cli.main(["env"]) == 0
    printed = capsys.readouterr().out
    for heading in ("## Versions", "## Processor", "## Compiled CPU kernel", "## GPUs", "## Switches",
                    "## Triton self-check verdicts", "## Attention paths"):  # fmt: skip
        assert heading in printed
    assert f"- torch: {torch.__version__}" in printed and "debug logger: disentangled.dispatch" in printed
    row = environment.paths(CPU)[0]
    assert f"| cpu | float32 | inference | {row['path']} | {row['reason']}" in printed
    assert cli.main(["env", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert set(found) == {"versions", "cpu", "native", "gpus", "switches", "self_checks", "paths"}
    assert found["native"]["built"] == native.available() and found["paths"] == environment.paths(CPU)
    assert found["switches"]["module"]["TRITON"] in ("0", "1", "check")


def test_python_dash_m_runs_the_same_command():
    result = subprocess.run(
        [sys.executable, "-m", "disentangled", "env", "--json"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["versions"]["torch"] == torch.__version__


def test_every_benchmark_record_carries_the_report(tmp_path):
    record = append_record("example", {"x": 1}, command=["python", "-m", "benchmarks.example"], folder=tmp_path)
    (read,) = read_records("example", folder=tmp_path)
    assert read == record
    processor, extensions = environment.processor()
    assert record["processor"] == processor and record["extensions"] == extensions
    assert record["environment"]["paths"] == environment.paths(CPU)
    assert record["commit"] == record["environment"]["versions"]["commit"] != ""


@pytest.mark.parametrize("value", ["0", "1", "check"])
def test_the_report_shows_the_switches_users_set(monkeypatch, value):
    monkeypatch.setenv("DISENTANGLED_TRITON", value)
    assert environment.switches()["environment"]["DISENTANGLED_TRITON"] == value
