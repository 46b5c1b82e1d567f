"""The benchmark command runs end to end on its quick shapes (1 layer) and reports every model in every case.

No timing is asserted: the numbers come from `python -m benchmarks.run` runs, recorded in benchmarks/records/
(docs/performance.md is generated from them).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import types
from pathlib import Path

import pytest
import torch

from benchmarks import machine, run
from benchmarks.records import read_records
from disentangled import environment


def summary_rows(printed: str, processes: int, case: str) -> dict[str, tuple[tuple[float, float, float], ...]]:
    """The per-process summary (`benchmarks.run.print_ratio_medians`) of one case: {name: ((median, lowest, highest)
    of the ratio to each reference)}."""
    summary = printed.split(f"{processes} processes: medians over the processes")[1]
    rows = {}
    for line in summary.splitlines():
        if line.startswith("| ") and case not in line and not line.startswith("|---"):
            name, *cells = (cell.strip() for cell in line.strip("| ").split(" | "))
            ratios = []
            for median, span in zip(cells[::2], cells[1::2]):
                low, high = span.split("-")
                ratios.append((float(median), float(low), float(high)))
            rows[name] = tuple(ratios)
    return rows


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[Path, str]:
    """`python -m benchmarks.run --quick` at 1 layer, with the two GPU anchors asked for (on the CPU each sits out):
    its output folder (also its records folder) and what it printed. Run once for the tests that read it."""
    out = tmp_path_factory.mktemp("quick")
    arguments = ["--quick", "--layers", "1", "--repeats", "1", "--anchors", "flashdeberta", "disentangled-flash"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run.main([*arguments, "--out", str(out), "--records", str(out)])
    return out, printed.getvalue()


def test_quick_benchmark_reports_every_case_and_model(quick_run):
    tmp_path = quick_run[0]
    report = json.loads((tmp_path / "benchmark-quick.json").read_text())
    cases = [row["case"] for row in report["inference"] + report["training"]]
    assert cases == ["infer 8x128 (1 layers)", "infer 2x512 (1 layers)", "train 2x128 (1 layers)"]
    for row in report["inference"] + report["training"]:
        assert set(row["times"]) == {"ours-eager", "ours-sdpa", "transformers-deberta", "bert-sdpa"}
        assert all(seconds > 0 for seconds in row["times"].values())
    assert "| infer 2x512 (1 layers) |" in report["markdown"]
    assert f"Processor: {report['processor']}" in report["markdown"]
    (record,) = read_records("run", tmp_path)  # one record, in the schema the manual's tables are made from
    figures = record["figures"]
    assert {key: figures[key] for key in ("device", "dtype", "layers", "repeats", "processes")} == {
        "device": "cpu",
        "dtype": "float32",
        "layers": 1,
        "repeats": 1,
        "processes": 1,
    }
    assert [case["case"] for case in figures["cases"]] == ["infer 8x128", "infer 2x512", "train 2x128"]
    first = figures["cases"][0]
    assert (first["mode"], first["batch"], first["length"], first["target"]) == ("infer", 8, 128, 1.10)
    assert first["times"] == [report["inference"][0]["times"]] and figures["cases"][1]["target"] is None
    ratio = first["times"][0]["ours-sdpa"] / first["times"][0]["bert-sdpa"]
    assert first["ours_over_bert"] == {"median": ratio, "min": ratio, "max": ratio}
    assert set(first["transformers_over_ours"]) == {"median", "min", "max"} and "memory" not in figures


def test_benchmark_in_fresh_processes_prints_the_median_and_range_of_each_ratio(tmp_path, capsys):
    """--processes times the chosen cases in child processes and summarizes each ratio over them."""
    arguments = ["--quick", "--layers", "1", "--repeats", "1", "--no-eager", "--cases", "infer-8x128", "train-2x128"]
    arguments += ["--threads", "1"]
    run.main([*arguments, "--processes", "2", "--out", str(tmp_path), "--records", str(tmp_path)])
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "processes.json").read_text())
    assert len(summary["processes"]) == 2
    assert all(
        [row["case"] for row in report["inference"] + report["training"]]
        == ["infer 8x128 (1 layers)", "train 2x128 (1 layers)"]
        for report in summary["processes"]
    )
    rows = [line.strip(" |").split(" | ") for line in printed.splitlines() if line.startswith(("| infer", "| train"))]
    assert [cells[0] for cells in rows] == ["infer 8x128 (1 layers)", "train 2x128 (1 layers)"]
    assert all(re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", cells[1]) for cells in rows)
    assert rows[0][3] == "1.10" and re.fullmatch(r"[0-2] of 2", rows[0][4])
    assert rows[1][3:] == ["-", "-"]  # 2x128 has no target
    (record,) = read_records("run", tmp_path)  # the parent's record only, with each process's times
    case = record["figures"]["cases"][0]
    assert record["figures"]["processes"] == 2 and len(case["times"]) == 2 and record["threads"] == 1
    ratios = [times["ours-sdpa"] / times["bert-sdpa"] for times in case["times"]]
    assert case["ours_over_bert"]["min"] == min(ratios) and case["ours_over_bert"]["max"] == max(ratios)
    with pytest.raises(SystemExit, match="infer-3x3: not among"):
        run.main(["--quick", "--cases", "infer-3x3", "--out", str(tmp_path)])


def test_processor_names_the_model_and_its_vector_extensions(monkeypatch, tmp_path):
    """The processor line reads the model name and only the listed vector flags from /proc/cpuinfo."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Example Xeon\nflags\t\t: fpu sse avx2 avx512f avx512bw amx_int8 vme\n")
    real_open = open
    monkeypatch.setattr(
        environment.gather,  # `disentangled env` reads the processor; benchmarks.machine prints it
        "open",
        lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k),
        raising=False,
    )
    assert machine.processor() == ("Example Xeon", ["avx2", "avx512f", "amx_int8"])
    assert machine.describe().startswith("Example Xeon (avx2 avx512f amx_int8; torch uses ")


def test_benchmark_memory_child_and_low_precision(tmp_path):
    """bfloat16 timings and one memory point (a capped subprocess) run and report."""
    run.main(
        ["--quick", "--layers", "1", "--repeats", "1", "--dtype", "bfloat16", "--no-eager", "--out", str(tmp_path)]
        + ["--records", str(tmp_path)]
    )
    report = json.loads((tmp_path / "benchmark-quick.json").read_text())
    assert "bfloat16" in report["machine"] and len(report["inference"]) == 2 and len(report["training"]) == 1
    (record,) = read_records("run", tmp_path)
    amx = "amx_bf16" in record["extensions"]  # bfloat16's targets with AMX, float32's without
    assert record["figures"]["dtype"] == "bfloat16" and record["figures"]["cases"][0]["target"] == (
        1.25 if amx else 1.10
    )
    folder = tmp_path / "checkpoint"
    run.build_models(1, folder, [], False)
    result = run.memory_case("ours-sdpa", 256, 16.0, folder, 300.0, "cpu", "float32")
    assert result["ok"] and result["peak_gib"] >= result["baseline_gib"] > 0


def test_profile_command_prints_the_operator_table(capsys):
    from benchmarks import profile

    profile.main(["--model", "ours-sdpa", "--batch", "1", "--length", "64", "--train"])
    printed = capsys.readouterr().out
    assert "ours-sdpa, train 1x64, 1 layer(s)" in printed and "BlockedAttention" in printed


def test_profile_command_with_shapes_prints_the_input_shapes_of_each_row(capsys):
    from benchmarks import profile

    profile.main(["--model", "ours-sdpa", "--batch", "2", "--length", "48", "--shapes", "--rows", "40"])
    printed = capsys.readouterr().out
    assert "ours-sdpa, infer 2x48, 1 layer(s)" in printed and "Input Shapes" in printed
    assert "[2, 48, 768]" in printed  # the hidden states entering a linear layer


def test_device_check_passes_on_the_cpu_and_catches_a_wrong_term(monkeypatch, switch, capsys):
    """The prepared accelerator check, run on the CPU (flex through its dense reference): it passes, and a
    backend that drops the p2c term fails it."""
    from benchmarks import device_check
    from disentangled.modeling import disentangled_attention, modeling_disentangled

    switch(FLEX_COMPILED=False)
    with pytest.raises(SystemExit) as passed:
        device_check.main(["--device", "cpu", "--no-benchmark"])
    printed = capsys.readouterr().out
    # float32: each sdpa variant (Triton kernel on and off where the checkout has it) and flex; bfloat16: sdpa's;
    # transformers' DebertaV2Model accelerated in place
    assert passed.value.code == 0 and printed.count(": ok") == 2 * len(device_check.sdpa_variants()) + 2
    assert "[float32 parity: " in printed and "[bfloat16 parity: " in printed and "[anchors: " in printed
    assert "accelerate(transformers' DebertaV2Model): " in printed and "[accelerate parity: " in printed

    sdpa = modeling_disentangled.DISENTANGLED_ATTENTION_FUNCTIONS["sdpa"]

    def without_p2c(module, query, key, value, attention_mask, scaling, dropout=0.0, position_scores=None, **kwargs):
        if position_scores is not None:
            position_scores = disentangled_attention.PositionScores(
                query, key, position_scores.pos_key, None, position_scores.p2p, position_scores.positions
            )
        return sdpa(module, query, key, value, attention_mask, scaling, dropout, position_scores, **kwargs)

    monkeypatch.setitem(modeling_disentangled.DISENTANGLED_ATTENTION_FUNCTIONS, "sdpa", without_p2c)
    with pytest.raises(SystemExit) as failed:
        device_check.main(["--device", "cpu", "--no-benchmark"])
    assert failed.value.code == 1 and "FAIL" in capsys.readouterr().out


def test_the_gpu_checks_refuse_a_machine_without_one(monkeypatch):
    """device_check and self_check name the missing GPU (the tuner: tests/test_kernel_resources.py); self_check's
    interpreter route needs TRITON_INTERPRET=1 from the start."""
    from benchmarks import device_check, self_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU here"):
        device_check.main(["--device", "cuda", "--no-benchmark"])
    with pytest.raises(ValueError, match="CUDA GPU; --device cuda has none here"):
        self_check.main(["--device", "cuda"])
    if not self_check.triton_attention.INTERPRETED:
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            self_check.main(["--device", "cpu", "--interpret"])


def test_device_check_writes_its_lines_and_stage_times_under_the_out_dir(switch, tmp_path):
    """--out-dir (a device run's $OUT) receives the check's lines and each stage's seconds; the anchors, absent or off
    CUDA, are reported with the reason and do not fail the check."""
    from benchmarks import device_check

    switch(FLEX_COMPILED=False)
    with pytest.raises(SystemExit) as passed:
        device_check.main(["--device", "cpu", "--no-benchmark", "--out-dir", str(tmp_path)])
    summary = json.loads((tmp_path / "device_check.json").read_text())
    assert passed.value.code == 0 and summary["ok"] and summary["device"] == "cpu"
    assert set(summary["seconds"]) == {"float32 parity", "bfloat16 parity", "accelerate parity", "anchors"}
    anchors = [line for line in summary["lines"] if "not checked: " in line and "flex" not in line]
    assert len(anchors) == 2 and all("not installed" in line or "CUDA only" in line for line in anchors)


def test_device_check_install_command_matches_its_docstring_and_the_wheels_fit(monkeypatch, tmp_path):
    """The documented device command is the one `install_command` builds, and --prepare-wheels downloads the pure
    wheels once and the binary ones per Python and platform, refusing a folder the device run could not carry."""
    from benchmarks import device_check

    docstring = re.sub(r"\s*\\\n\s*", " ", device_check.__doc__)
    assert device_check.install_command() in docstring
    page = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    lines = re.sub(r"\s*\\\n\s*", " ", page).splitlines()  # the page's commands, one per line, for a folder `wheels`
    assert [part in lines for part in device_check.install_command("wheels").split(" && ")] == [True, True]
    calls = []

    def download(command, check):
        calls.append(command)
        (tmp_path / f"wheel{len(calls)}.whl").write_bytes(b"x" * 1024)

    monkeypatch.setattr(device_check.subprocess, "run", download)
    sizes = device_check.prepare_wheels(tmp_path)
    pure = [name for name, binary in device_check.WHEELS if not binary]
    assert calls[0][-len(pure) :] == pure and "--python-version" not in calls[0]
    versions = [command[command.index("--python-version") + 1] for command in calls[1:]]
    assert sorted(set(versions)) == device_check.PYTHONS and len(calls) == 1 + 4 * len(device_check.PLATFORMS)
    assert len(sizes) == len(calls) and all(size == 1024 for _, size in sizes)
    monkeypatch.setattr(device_check, "CARRY_LIMIT_MIB", 0)
    with pytest.raises(SystemExit, match="more than the 0 MiB"):
        device_check.prepare_wheels(tmp_path)


def test_gpu_cases_and_targets():
    """On CUDA the cases and targets are issue 38's; the CPU's are unchanged; no targets on CUDA in float32."""
    assert run.GPU_INFERENCE_CASES == [(12, 32, 512), (12, 8, 2048), (12, 1, 8192), (12, 1, 16384), (12, 1, 32768)]
    assert run.GPU_TRAINING_CASES == [(12, 16, 512), (12, 4, 2048)]
    assert run.targets_for("cuda", "bfloat16") == {
        ("infer", 32, 512): 2.5,
        ("infer", 8, 2048): 2.5,
        ("infer", 1, 8192): 2.5,
        ("train", 16, 512): 1.6,
    }
    assert run.targets_for("cuda:0", "float32") == {} and run.targets_for("cpu", "float32") == run.TARGETS
    goals = run.gpu_targets_for("cuda", "bfloat16")
    both = ["flashdeberta", "disentangled-flash"]
    assert goals[("infer", 32, 512)] == {"faster_than": both, "peak_gib_target": None}
    assert goals[("infer", 1, 16384)] == {"faster_than": ["flashdeberta"], "peak_gib_target": 1.0}
    assert goals[("train", 4, 2048)]["faster_than"] == [*both, "transformers-deberta"]
    assert run.gpu_targets_for("cpu", "bfloat16") == {}


class Returns(torch.nn.Module):
    """A stand-in model: its output's last_hidden_state is a function of the inputs, or it raises `error`."""

    def __init__(self, error: Exception | None = None, after: int = 0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.error, self.after = error, after

    def forward(self, input_ids, attention_mask):
        self.after -= 1
        if self.error is not None and self.after < 0:
            raise self.error
        return types.SimpleNamespace(last_hidden_state=input_ids.float()[..., None] * self.weight)


def test_timing_case_leaves_out_a_failing_anchor_but_not_ours():
    """A model other than ours and BERT that raises in its warm-up (out of memory, a refused shape) is left out of
    the case with its reason; ours raising stops the run."""
    models = {
        "ours-sdpa": Returns(),
        "bert-sdpa": Returns(),
        "flashdeberta": Returns(ValueError("too long\nmore")),
        "transformers-deberta": Returns(MemoryError("out of memory"), after=2),  # in the timed calls
    }
    found = {}
    times = run.timing_case(models, 2, 16, True, 3, 1, found=found, optimizers={"ours-sdpa": None})
    assert set(times) == {"ours-sdpa", "bert-sdpa"}
    assert found["failed"] == {"flashdeberta": "too long", "transformers-deberta": "out of memory"}
    assert set(models) == {"ours-sdpa", "bert-sdpa", "flashdeberta", "transformers-deberta"}  # the caller's, as it was
    with pytest.raises(RuntimeError, match="ours broke"):
        run.timing_case({"ours-sdpa": Returns(RuntimeError("ours broke"))}, 1, 8, False, 1, 1)


class FakeReference(Returns):
    """transformers' DeBERTa as the anchor builders see it: on a CUDA device (claimed), with an encoder."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(1, 1)
        self.config = types.SimpleNamespace(to_dict=dict)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda")


def test_anchor_builders_say_why_an_anchor_is_left_out(monkeypatch):
    """Not installed, not on CUDA, refused (disentangled-flash above 8192 tokens), or its encoder not swapped in:
    each gives (None, reason); a package that swaps the encoder gives the model. Nothing is imported before."""
    import sys

    from benchmarks import gpu_anchors

    cpu_model = Returns()
    cpu_model.device = torch.device("cpu")
    for name, (module, pinned) in gpu_anchors.ANCHORS.items():
        monkeypatch.setitem(sys.modules, module, None)  # import fails: not installed
        model, why = gpu_anchors.build_anchor(name, cpu_model, training=False, length=512)
        assert model is None and "not installed" in why and f"{name}=={pinned}" in why
        monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
        model, why = gpu_anchors.build_anchor(name, cpu_model, training=False, length=512)
        assert model is None and why.endswith("CUDA only, not on cpu")

    def refuse(model, backend, sequence_lengths):
        raise ValueError("the bounded Triton kernel family supports sequence lengths up to 8192")

    package = types.SimpleNamespace(enable_deberta_inference=refuse)
    monkeypatch.setitem(sys.modules, "disentangled_flash", package)
    model, why = gpu_anchors.build_anchor("disentangled-flash", FakeReference(), training=False, length=16384)
    assert model is None and why.startswith("disentangled-flash refused inference at 16384 tokens: the bounded")
    package.enable_deberta_training = lambda model, backend: model  # Triton missing: the encoder stays
    model, why = gpu_anchors.build_anchor("disentangled-flash", FakeReference(), training=True, length=512)
    assert model is None and "kept transformers' encoder" in why

    def swap(model, backend):
        model.encoder = torch.nn.Identity()

    package.enable_deberta_training = swap
    model, why = gpu_anchors.build_anchor("disentangled-flash", FakeReference(), training=True, length=512)
    assert isinstance(model.encoder, torch.nn.Identity) and why == "" and model.training


def test_record_figures_of_a_gpu_run():
    """A CUDA record names the GPU, the versions (the anchors' included) and parity, and per case each model's time
    over ours, the peak memory, why a model sat the case out, and the targets; a ratio no process measured is None."""
    args = argparse.Namespace(device="cuda", dtype="bfloat16", layers=None, processes=1, parity="passed")
    times = {"ours-sdpa": 0.02, "bert-sdpa": 0.01, "transformers-deberta": 0.2, "flashdeberta": 0.03}
    rows = [
        {
            "case": "infer 32x512 (12 layers)",
            "layers": 12,
            "times": [times],
            "peak_gib": [{"ours-sdpa": 0.5}],
            "failed": {"disentangled-flash": "refused"},
        },
        {"case": "infer 1x32768 (12 layers)", "layers": 12, "times": [{"ours-sdpa": 0.3, "bert-sdpa": 0.1}]},
    ]
    figures = run.record_figures(args, rows, 10)
    assert figures["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda")
    assert set(figures["versions"]) == {"torch", "cuda", "triton", "transformers", "flashdeberta", "disentangled-flash"}
    assert figures["parity"] == "passed" and figures["layers"] == 12 and figures["repeats"] == 10
    first, last = figures["cases"]
    assert first["over_ours"]["flashdeberta"]["median"] == pytest.approx(1.5) and first["target"] == 2.5
    assert first["ours_over_bert"]["median"] == pytest.approx(2.0)
    assert first["failed"] == {"disentangled-flash": "refused"}
    assert first["faster_than"] == ["flashdeberta", "disentangled-flash"] and first["peak_gib"] == [{"ours-sdpa": 0.5}]
    assert last["transformers_over_ours"] is None and last["over_ours"] == {}
    assert last["faster_than"] == ["flashdeberta"] and last["peak_gib_target"] is None
    cpu = run.record_figures(argparse.Namespace(**{**vars(args), "device": "cpu"}), rows[:1], 10)
    assert "gpu" not in cpu and "over_ours" not in cpu["cases"][0]  # a CPU record keeps its fields


def test_benchmark_budget_starts_no_case_once_spent(tmp_path, capsys):
    """--budget-s 0: every case is reported as not started, and no record is written."""
    run.main(["--quick", "--budget-s", "0", "--out", str(tmp_path), "--records", str(tmp_path)])
    report = json.loads((tmp_path / "benchmark-quick.json").read_text())
    assert report["skipped"] == ["infer 8x128 (12 layers)", "infer 2x512 (12 layers)", "train 2x128 (12 layers)"]
    assert "Not started (budget of 0 s spent)" in capsys.readouterr().out and read_records("run", tmp_path) == []


def test_benchmark_names_why_an_anchor_sat_out(quick_run):
    """--anchors on the CPU: each anchor is left out of each case with its reason (not installed, or CUDA only); ours
    still run (the quick run of `quick_run`, which asks for both anchors)."""
    tmp_path, printed = quick_run
    report = json.loads((tmp_path / "benchmark-quick.json").read_text())
    rows = report["inference"] + report["training"]
    assert printed.count("not installed") + printed.count("CUDA only") == 2 * len(rows)
    assert all(set(row["times"]) == {"ours-eager", "ours-sdpa", "transformers-deberta", "bert-sdpa"} for row in rows)


def test_pretraining_benchmark_reports_every_arm(tmp_path):
    """`python -m studies.pretrain --quick`: on both corpora, every mode is pretrained and every arm (no
    pretraining included) fine-tuned at each learning rate and probed; the chosen rate is the best on validation, the
    summaries agree with the per-seed figures, the table names every arm, and --speed times an RTD step against its
    two models' steps alone (the numbers are not asserted)."""
    from studies import pretrain

    report = pretrain.main(["--quick", "--seeds", "0", "--workers", "1", "--speed", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "pretrain-quick.json").read_text())
    assert saved["arms"] == ["none", "mlm", "rtd-none", "rtd-es", "rtd-gdes"] == report["arms"]
    assert set(saved["corpora"]) == {"generated", "real"}
    assert set(saved["corpora"]["generated"]["tasks"]) == {"sentiment", "capitals"}
    assert set(saved["corpora"]["real"]["tasks"]) == {"topics"}
    for job in saved["jobs"]:
        for task, arms in job["tasks"].items():
            assert list(arms) == saved["arms"]
            for arm, result in arms.items():
                tried = {float(rate): scores for rate, scores in result["tried"].items()}
                assert set(tried) == set(pretrain.QUICK["learning_rates"])
                assert tried[result["learning_rate"]][0] == max(scores[0] for scores in tried.values())
                assert result["test"] == tried[result["learning_rate"]][1]
                assert all(0.0 <= result["probe"][kind] <= 1.0 for kind in ("cls", "mean"))
                for token in ("cls", "sep"):  # a figure per layer of the tiny shape, each a probability
                    assert len(result["probe"]["sinks"][token]) == 4
                    assert all(0.0 <= value <= 1.0 for value in result["probe"]["sinks"][token])
                summary = saved["corpora"][job["corpus"]]["tasks"][task][arm]["test"]
                assert summary["seeds"] == [result["test"]] and summary["std"] == 0.0
        for mode, figures in job["pretraining"].items():
            assert 0.0 <= figures["masked_accuracy"] <= 1.0
            if mode != "mlm":
                assert 0.0 <= figures["auc"] <= 1.0 and 0.0 <= figures["random_auc"] <= 1.0
        # es shares one table: the generator's and discriminator's embedding of a token are the same vector
        assert abs(job["pretraining"]["rtd-es"]["embeddings"]["between"] - 1.0) < 1e-5
    for arm in ("no pretraining", "mlm", "rtd-none", "rtd-es", "rtd-gdes"):
        assert saved["markdown"].count(f"| {arm} |") == 4  # a row in each corpus's two tables (scores, sinks)
    assert saved["markdown"].count("Attention sinks on the") == 2
    assert set(saved["speed"]["ratio"]) == {"rtd-none", "rtd-es", "rtd-gdes"}
    assert all(tokens_per_s > 0 for tokens_per_s in saved["speed"]["pipeline"].values())


def test_pretrain_memory_benchmark_reports_every_loop(tmp_path):
    """`python -m benchmarks.pretrain_memory` on tiny sizes: ours as at HEAD (from its own tree), ours and ELECTRA,
    each in a fresh process; the record holds every loop's peak and the sampler's timing (HEAD's sampler draws the
    same tokens), and the pretraining page's table names every loop. The figures themselves are not asserted."""
    from benchmarks import pretrain_memory

    tiny = ["--batch", "2", "--length", "16", "--vocab-size", "300", "--layers", "1", "--steps", "0"]
    pretrain_memory.main([*tiny, "--baseline", "HEAD", "--records", str(tmp_path)])
    (record,) = read_records("pretrain_memory", tmp_path)
    figures = record["figures"]
    assert list(figures["loops"]) == ["ours at HEAD", "ours", "electra"]
    for loop in figures["loops"].values():
        assert loop["peak_gib"] > 0 and loop["optimizer_state_gib"] > 0 and loop["loss"] > 0
    assert figures["masked"] > 0 and figures["sampler"]["masked"] == figures["masked"]
    assert figures["sampler"]["same_draws"]
    assert pretrain_memory.section([record]).startswith("No record yet")  # the page shows the real vocabulary only
    full = json.loads(json.dumps(record))
    full["figures"]["vocab_size"] = 128100
    page = pretrain_memory.section([record, full])
    for name in figures["loops"]:
        assert f"| {pretrain_memory.loop_label(name)} |" in page


def test_balanced_accuracy_against_hand_computed():
    """The transfer benchmark's score: the mean over classes of each class's recall, whatever the class sizes."""
    from studies.pretrain import balanced_accuracy

    gold = [0, 0, 0, 0, 1, 1, 2, 2]
    predicted = [0, 0, 0, 1, 1, 0, 2, 2]  # recalls 3/4, 1/2, 2/2
    assert balanced_accuracy(predicted, gold) == pytest.approx((0.75 + 0.5 + 1.0) / 3)


def test_int8_benchmark_reports_every_path(tmp_path):
    """`python -m benchmarks.int8 --quick`: every path timed, every int8 path's agreement reported, the processor named."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from benchmarks import int8

    int8.main(["--quick", "--repeats", "1", "--steps", "2", "--texts", "16", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "int8-quick.json").read_text())
    assert [row["case"] for row in report["timing"]] == ["8x128 (1 layers)"]
    assert set(report["timing"][0]["times"]) == set(int8.PATHS)
    assert all(seconds > 0 for seconds in report["timing"][0]["times"].values())
    assert set(report["agreement"]) == {"classifier", "fill-mask"}
    for result in report["agreement"].values():
        int8_graphs = ("onnxruntime-int8", "onnxruntime-int8-per-channel")
        assert set(result["accuracy"]) == {"ours-float32", "ours-torch-int8", "onnxruntime-float32", *int8_graphs}
        for name in ("ours-torch-int8", "onnxruntime-float32", *int8_graphs):
            assert 0.0 <= result[name]["agreement"] <= 1.0 and result[name]["max_prob_diff"] >= 0.0
    assert "onnxruntime-int8" in report["markdown"] and report["machine"].split(" (")[0] in report["markdown"]


def test_cpu_inference_variants_run_and_restore_the_module_constants(capsys):
    """Every variant runs (and is checked equal to the model as it stands inside the command); the constants it
    changes are restored; the held buffers are reported."""
    from benchmarks import cpu_inference

    names = (
        "KEEP_WORKSPACE",
        "ADD_CHUNK_KEYS",
        "BAND_TABLE_KEYS",
        "PRODUCT_COLUMNS_MULTIPLE",
        "CPU_KERNEL",
        "KERNEL_SPLIT_LENGTH",
        "CPU_FUSED",
        "_attend_by_distance",
    )
    before = {name: getattr(cpu_inference.HOMES[name], name) for name in names}
    arguments = ["--cases", "2x96", "--layers", "1", "--repeats", "1", "--held-lengths", "96", "--baseline", "HEAD"]
    cpu_inference.main(arguments)
    printed = capsys.readouterr().out
    assert all(f"| {variant} |" in printed for variant in [*cpu_inference.VARIANTS, "at-HEAD"])
    assert "| 96 |" in printed and " MiB |" in printed
    assert before == {name: getattr(cpu_inference.HOMES[name], name) for name in before}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_inference_bias_cost_prints_sdpa_with_each_bias_and_the_kernel(capsys, dtype):
    """--bias-cost times SDPA without a bias, with a key bias and with a dense one, the kernel where it runs, and the
    fused attention where it runs in that dtype (bfloat16 on AMX, float32 with the kernel), with both terms and with
    each alone."""
    from benchmarks import cpu_inference
    from disentangled.modeling import native

    cpu_inference.main(["--bias-cost", "--cases", "1x96", "2x64", "--repeats", "1", "--dtype", dtype])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1x96 |", "| 2x64 |"))]
    assert len(rows) == 2
    fused = native.attend_available(getattr(torch, dtype))
    assert all(row.count(" ms |") == 3 + native.available() + 3 * fused for row in rows)  # fused: both, c2p, p2c


def test_cpu_inference_products_print_both_layouts_for_each_shape(capsys):
    from benchmarks import cpu_inference

    cpu_inference.main(["--products", "--repeats", "1"])
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ") and " x " in line and "ms |" in line]
    assert [row.split(" |")[0] for row in rows] == [f"| {r} x {c}" for r, c in cpu_inference.PRODUCT_SHAPES]
    assert all(row.count(" ms |") == 2 for row in rows)


def test_cpu_inference_far_calls_print_the_causal_call_and_the_calls_by_block(capsys):
    """--far-calls times the far keys as one causal call and as calls by block; a length within the band has none."""
    from benchmarks import cpu_inference

    cpu_inference.main(["--far-calls", "1100", "640", "--repeats", "1"])
    printed = capsys.readouterr().out
    rows = {line.split(" |")[0]: line for line in printed.splitlines() if line.startswith("| ") and line[2].isdigit()}
    reach = cpu_inference.v3_positions(1100).near[1]
    assert rows["| 1100"].startswith(f"| 1100 | {1100 - reach} |")
    assert rows["| 1100"].count(" ms |") == 1 + len(cpu_inference.FAR_BLOCK_ROWS)
    assert "no far keys" in rows["| 640"]


def test_cpu_inference_in_fresh_processes_prints_the_median_and_range_of_each_ratio(capsys):
    """--processes runs the comparison in child processes (only the chosen variants) and summarizes their ratios."""
    from benchmarks import cpu_inference

    arguments = ["--cases", "2x96", "--layers", "1", "--repeats", "1", "--variants", "unpadded-products"]
    cpu_inference.main([*arguments, "--processes", "2"])
    rows = summary_rows(capsys.readouterr().out, 2, "2x96")
    assert list(rows) == ["as-is", "unpadded-products", "bert-sdpa"]
    assert rows["bert-sdpa"][0] == (1.0, 1.0, 1.0)  # BERT against itself, in every process
    assert rows["as-is"][1] == (1.0, 1.0, 1.0)  # the model against itself


def test_train_step_times_the_baseline_and_restores_the_sdpa_function(capsys):
    """--baseline times the sdpa path of a git revision beside the model as it stands, after checking that their
    gradients agree; the registered sdpa function is the current one afterwards."""
    from benchmarks import train_step
    from disentangled.modeling import modeling_disentangled, sdpa_attention

    for dtype in ("float32", "bfloat16"):
        arguments = ["--cases", "2x48", "--layers", "1", "--repeats", "1", "--no-eager", "--baseline", "HEAD"]
        train_step.main([*arguments, "--dtype", dtype])
        printed = capsys.readouterr().out
        rows = [line.split(" | ")[0] for line in printed.splitlines() if line.startswith("| ") and " ms |" in line]
        assert rows == ["| ours-sdpa", "| transformers-deberta", "| bert-sdpa", "| ours-sdpa at HEAD"]
        assert f"; {dtype};" in printed
    assert re.search(r"Buffers ours-sdpa keeps between steps at 2x48: \d+ MiB", printed)
    assert "| page faults per step |" in printed
    assert modeling_disentangled.DISENTANGLED_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention.sdpa_disentangled


def test_train_step_refuses_a_baseline_whose_gradients_differ(monkeypatch):
    """A baseline that drops the p2c term is caught before anything is timed."""
    import types

    from benchmarks import train_step
    from disentangled.modeling import disentangled_attention, modeling_disentangled, sdpa_attention

    def without_p2c(module, query, key, value, attention_mask, scaling, dropout=0.0, position_scores=None, **kwargs):
        position_scores = disentangled_attention.PositionScores(
            position_scores.query, position_scores.key, position_scores.pos_key, None, None, position_scores.positions
        )
        return sdpa_attention.sdpa_disentangled(
            module, query, key, value, attention_mask, scaling, dropout, position_scores
        )

    monkeypatch.setattr(
        train_step, "baseline_backends", lambda *_: types.SimpleNamespace(sdpa_disentangled=without_p2c)
    )
    with pytest.raises(SystemExit, match="gradient of .* differs at 2x48"):
        train_step.main(["--cases", "2x48", "--layers", "1", "--repeats", "1", "--no-eager", "--baseline", "HEAD"])
    assert modeling_disentangled.DISENTANGLED_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention.sdpa_disentangled


def test_train_step_in_fresh_processes_prints_the_median_and_range_of_each_ratio(capsys):
    from benchmarks import train_step

    arguments = ["--cases", "2x48", "--layers", "1", "--repeats", "1", "--no-eager", "--back-to-back"]
    train_step.main([*arguments, "--processes", "2"])
    rows = summary_rows(capsys.readouterr().out, 2, "2x48")
    assert list(rows) == ["ours-sdpa", "transformers-deberta", "bert-sdpa"]
    assert rows["bert-sdpa"][0] == (1.0, 1.0, 1.0)  # BERT against itself, in every process
    assert rows["ours-sdpa"][1] == (1.0, 1.0, 1.0)  # the model against itself


def test_pretraining_diagnosis_smoke(tmp_path):
    """`python -m studies.pretrain_diagnosis` on a few steps: every curve is written, AUCs within [0, 1]."""
    from studies import pretrain_diagnosis

    output = tmp_path / "diagnosis.json"
    arguments = ["--variants", "old", "zero-delta", "--steps", "2", "--batch", "2", "--length", "32", "--eval-every",
                 "2", "--eval-sequences", "4", "--vocab-size", "400", "--output", str(output), "--no-record"]  # fmt: skip
    assert pretrain_diagnosis.main(arguments) == 0
    results = json.loads(output.read_text())
    assert set(results) == {"old", "zero-delta"} and results["old"]["settings"]["delta"] == "difference"
    for result in results.values():
        assert result["curve"]["step"] == [2]
        assert all(0.0 <= result["curve"][key][0] <= 1.0 for key in ("auc", "random_auc", "generator_accuracy"))
    assert output.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def test_attention_sinks_against_hand_computed():
    """The transfer benchmark's sinks: the attention that ordinary tokens (not [CLS], [SEP] or padding) give [CLS]
    and the text's own [SEP], averaged over every such query of every text, per layer."""
    import torch

    from studies.pretrain import sinks

    ids = torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0]])  # [CLS]=1, [SEP]=2, padding 0
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    special = ((ids == 1) | (ids == 2)).long()
    layer = torch.zeros(2, 2, 4, 4)  # [B, H, L, L]; the heads average to these rows
    layer[0, :, 1] = torch.tensor([0.5, 0.2, 0.2, 0.1])
    layer[0, :, 2] = torch.tensor([[0.2, 0.4, 0.2, 0.2], [0.4, 0.2, 0.2, 0.2]])  # heads: mean [0.3, 0.3, 0.2, 0.2]
    layer[1, :, 1] = torch.tensor([0.1, 0.2, 0.7, 0.0])
    layer[:, :, 0] = layer[:, :, 3] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # special queries: not counted
    attentions = (layer, layer.roll(1, dims=-1))
    # the same texts as one batch and as two batches of one: a mean over queries, not over batches
    for batches in (
        [(attentions, mask, special)],
        [((a[:1] for a in attentions), mask[:1], special[:1]), ((a[1:] for a in attentions), mask[1:], special[1:])],
    ):
        found = sinks([(tuple(a), m, s) for a, m, s in batches])
        assert found["cls"][0] == pytest.approx((0.5 + 0.3 + 0.1) / 3)
        assert found["sep"][0] == pytest.approx((0.1 + 0.2 + 0.7) / 3)
        # second layer, every row shifted one key to the right: [CLS] gets what the last key had, [SEP] the one before
        assert found["cls"][1] == pytest.approx((0.1 + 0.2 + 0.0) / 3)
        assert found["sep"][1] == pytest.approx((0.2 + 0.2 + 0.2) / 3)


def test_train_step_times_pytorchs_dropout_draws_beside_the_kernels(monkeypatch, capsys):
    """--pytorch-dropout adds the sdpa model with dropout's decisions drawn by PyTorch's generator: those steps run
    with the switch off (no kernel call), the others with it on, and the switch is on afterwards."""
    from benchmarks import train_step
    from disentangled.modeling import cpu_training, dispatch, native

    if not native.available():
        pytest.skip(f"the kernel does not run here: {native.why_unavailable()}")
    drawn = []  # for each dropout mask: whether the kernel drew it
    function = cpu_training.dropout_keep_mask
    monkeypatch.setattr(
        cpu_training, "dropout_keep_mask", lambda *args: drawn.append(dispatch.DROPOUT_KERNEL) or function(*args)
    )
    monkeypatch.setattr(train_step.modeling_disentangled, "dropout_keep_mask", cpu_training.dropout_keep_mask)
    train_step.main(["--cases", "2x48", "--layers", "1", "--repeats", "1", "--no-eager", "--pytorch-dropout"])
    printed = capsys.readouterr().out
    rows = [line.split(" | ")[0] for line in printed.splitlines() if line.startswith("| ") and " ms |" in line]
    assert rows == ["| ours-sdpa", "| transformers-deberta", "| bert-sdpa", f"| {train_step.PYTORCH_DROPOUT}"]
    assert True in drawn and False in drawn and dispatch.DROPOUT_KERNEL


def test_the_serving_latency_tables_are_narrow_and_divide_the_medians():
    """`benchmarks.onnx_runtime --per-request`'s tables (the serving page's): float32 and int8 milliseconds apart from
    the ratios, five columns at most, each ratio the quotient of the two medians (not of the fastest calls). The
    benchmark itself takes minutes even at one layer (12-layer exports and quantization aside), so it is not run here."""
    from benchmarks import onnx_runtime

    row = {"case": "1x128", "threads": 1, "min": {}, "median": {}}
    for number, name in enumerate(onnx_runtime.LATENCY_COLUMNS, 1):
        row["median"][name], row["min"][name] = number / 100, number / 1000
    text = onnx_runtime.latency_markdown({"repeats": 5, "cases": [row]})
    tables = [block for block in text.split("\n\n") if block.startswith("|")]
    assert len(tables) == 3 and all(block.count("|") <= 6 * 3 for block in tables)
    assert "| 1x128 | 1 | 10.0 (1.0) | 20.0 (2.0) | 30.0 (3.0) |" in tables[0]
    assert "| 1x128 | 1 | 40.0 (4.0) | 50.0 (5.0) |" in tables[1]
    assert "| 1x128 | 1 | 0.50 | 1.50 | 0.80 |" in tables[2]
