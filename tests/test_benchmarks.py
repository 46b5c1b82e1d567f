"""The benchmark command runs end to end on its quick shapes (1 layer) and reports every model in every case.

No timing is asserted: the numbers come from `python -m benchmarks.run` on an idle machine (README, Performance).
"""

from __future__ import annotations

import json

import pytest

from benchmarks import run


def test_quick_benchmark_reports_every_case_and_model(tmp_path):
    run.main(["--quick", "--layers", "1", "--repeats", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmark-quick.json").read_text())
    cases = [row["case"] for row in report["inference"] + report["training"]]
    assert cases == ["infer 8x128 (1 layers)", "infer 2x512 (1 layers)", "train 2x128 (1 layers)"]
    for row in report["inference"] + report["training"]:
        assert set(row["times"]) == {"ours-eager", "ours-sdpa", "transformers-deberta", "bert-sdpa"}
        assert all(seconds > 0 for seconds in row["times"].values())
    assert "| infer 2x512 (1 layers) |" in report["markdown"]
    assert f"Processor: {report['processor']}" in report["markdown"]


def test_processor_names_the_model_and_its_vector_extensions(monkeypatch, tmp_path):
    """The processor line reads the model name and only the vector flags from /proc/cpuinfo."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Example Xeon\nflags\t\t: fpu sse avx2 avx512f avx512bw amx_tile vme\n")
    real_open = open
    monkeypatch.setattr(
        run,
        "open",
        lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k),
        raising=False,
    )
    assert run.processor() == "Example Xeon [amx_tile avx2 avx512bw avx512f]"


def test_benchmark_memory_child_and_low_precision(tmp_path):
    """bfloat16 timings and one memory point (a capped subprocess) run and report."""
    run.main(
        ["--quick", "--layers", "1", "--repeats", "1", "--dtype", "bfloat16", "--no-eager", "--out", str(tmp_path)]
    )
    report = json.loads((tmp_path / "benchmark-quick.json").read_text())
    assert "bfloat16" in report["machine"] and len(report["inference"]) == 2
    folder = tmp_path / "checkpoint"
    run.build_models(1, folder, [], False)
    result = run.memory_case("ours-sdpa", 256, 16.0, folder, 300.0, "cpu", "float32")
    assert result["ok"] and result["peak_gib"] >= result["baseline_gib"] > 0


def test_profile_command_prints_the_operator_table(capsys):
    from benchmarks import profile

    profile.main(["--model", "ours-sdpa", "--batch", "1", "--length", "64", "--train"])
    printed = capsys.readouterr().out
    assert "ours-sdpa, train 1x64, 1 layer(s)" in printed and "BlockedAttention" in printed


def test_device_check_passes_on_the_cpu_and_catches_a_wrong_term(monkeypatch, capsys):
    """The prepared accelerator check, run on the CPU (flex through its dense reference): it passes, and a
    backend that drops the p2c term fails it."""
    from benchmarks import device_check
    from disentangled.modeling import disentangled_attention as backends

    monkeypatch.setattr(backends, "FLEX_COMPILED", False)
    with pytest.raises(SystemExit) as passed:
        device_check.main(["--device", "cpu", "--no-benchmark"])
    assert passed.value.code == 0 and capsys.readouterr().out.count(": ok") == 2

    sdpa = backends.DISENTANGLED_ATTENTION_FUNCTIONS["sdpa"]

    def without_p2c(module, query, key, value, attention_mask, scaling, dropout=0.0, position_scores=None, **kwargs):
        if position_scores is not None:
            position_scores = backends.PositionScores(
                query, key, position_scores.pos_key, None, position_scores.p2p, position_scores.positions
            )
        return sdpa(module, query, key, value, attention_mask, scaling, dropout, position_scores, **kwargs)

    monkeypatch.setitem(backends.DISENTANGLED_ATTENTION_FUNCTIONS, "sdpa", without_p2c)
    with pytest.raises(SystemExit) as failed:
        device_check.main(["--device", "cpu", "--no-benchmark"])
    assert failed.value.code == 1 and "FAIL" in capsys.readouterr().out
