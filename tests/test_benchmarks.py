"""The benchmark command runs end to end on its quick shapes (1 layer) and reports every model in every case.

No timing is asserted: the numbers come from `python -m benchmarks.run` on an idle machine (README, Performance).
"""

from __future__ import annotations

import json

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
