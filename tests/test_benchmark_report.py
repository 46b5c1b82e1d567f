"""The performance page, the README's table and the figures are what `python -m benchmarks.report` makes from the
committed records: a stale page or figure fails here, and so does a hand edit inside a generated section."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from benchmarks import report
from benchmarks.records import RECORDS, append_record, latest_per_processor, read_records


def test_committed_pages_and_figures_match_the_records():
    texts, figures = report.generate()
    for path, text in texts.items():
        assert (report.ROOT / path).read_text() == text, f"{path} is stale: run python -m benchmarks.report"
    for path, data in figures.items():
        assert report.figure_digest(report.ROOT / path) == report.digest(data), f"{path} is stale"
    assert report.main(["--check"]) == 0


def test_a_new_record_changes_the_page_and_the_figure(tmp_path):
    """A newer record of a processor replaces its figures; the committed page no longer matches."""
    shutil.copytree(RECORDS, tmp_path / "records")
    newest = copy.deepcopy(report.latest(read_records("run", tmp_path / "records"), "cases")[0])
    newest["figures"]["cases"][0]["ours_over_bert"] = {"median": 0.5, "min": 0.4, "max": 0.6}
    with (tmp_path / "records" / "run.jsonl").open("a") as out:
        out.write(json.dumps(newest) + "\n")
    texts, figures = report.generate(tmp_path / "records")
    page = texts[report.Path("docs/performance.md")]
    assert "| 0.50 (0.40-0.60) |" in page and page != (report.ROOT / "docs/performance.md").read_text()
    speed = report.Path("docs/performance/speed.png")
    assert report.digest(figures[speed]) != report.figure_digest(report.ROOT / speed)


def test_latest_is_per_processor_and_dtype(tmp_path):
    figures = {"dtype": "float32", "cases": [{"case": "infer 8x128"}]}
    append_record("run", figures, command=["first"], folder=tmp_path)
    append_record("run", figures, command=["second"], folder=tmp_path)
    append_record("run", dict(figures, dtype="bfloat16"), command=["third"], folder=tmp_path)
    append_record("run", dict(figures, cases=[]), command=["memory only"], folder=tmp_path)
    records = read_records("run", tmp_path)
    assert [record["command"] for record in report.latest(records, "cases")] == ["third", "second"]
    assert latest_per_processor(records)[records[0]["processor"]]["command"] == "memory only"


def test_a_page_without_its_section_is_refused():
    with pytest.raises(ValueError, match="no generated section 'summary'"):
        report.replace_section("# a page\n", "summary", "body")
    text = f"a\n{report.BEGIN.format(name='x')}\nold\n{report.END}\nb\n"
    assert report.replace_section(text, "x", "new") == f"a\n{report.BEGIN.format(name='x')}\nnew\n{report.END}\nb\n"


def test_transfer_tables_take_each_corpus_from_its_newest_run(tmp_path):
    """A rerun of one corpus of studies.pretrain replaces that corpus's table and bars only."""

    def corpus(accuracy: float) -> dict:
        test = {"mean": accuracy, "std": 0.0, "min": accuracy, "max": accuracy, "seeds": [accuracy]}
        arm = {"test": test, "probe_cls": test, "probe_mean": test, "learning_rates": [1e-3]}
        return {"seeds": [0], "tasks": {"task": {"none": arm, "mlm": arm}}, "pretraining": {"mlm": {}}}

    settings = {"steps": 3, "batch": 2, "tiny_learning_rate": 1e-3, "epochs": 1, "learning_rates": [1e-3]}
    both = {"settings": settings, "arms": ["none", "mlm"], "corpora": {"real": corpus(0.1), "generated": corpus(0.2)}}
    append_record("pretrain", both, command=["both"], folder=tmp_path)
    append_record("pretrain", both | {"corpora": {"generated": corpus(0.3)}}, command=["rerun"], folder=tmp_path)
    chosen = report.newest_per_corpus(read_records("pretrain", tmp_path))
    assert [(r["command"], list(r["figures"]["corpora"])) for r in chosen] == [
        ("both", ["real"]),
        ("rerun", ["generated"]),
    ]
    bars = {task: rows for record in chosen for task, rows in report.transfer_data(record).items()}
    assert bars == {
        "real: task": [("none", 0.1, 0.1, 0.1), ("mlm", 0.1, 0.1, 0.1)],
        "generated: task": [("none", 0.3, 0.3, 0.3), ("mlm", 0.3, 0.3, 0.3)],
    }


def gpu_record(folder, gpu: str = "NVIDIA H200") -> dict:
    """A synthetic `benchmarks.run --device cuda` record, written only in the test's folder."""
    times = {"ours-sdpa": 0.020, "bert-sdpa": 0.010, "transformers-deberta": 0.300, "flashdeberta": 0.030}
    long = {"ours-sdpa": 0.200, "bert-sdpa": 0.100, "flashdeberta": 0.150}
    figures = {
        "device": "cuda",
        "dtype": "bfloat16",
        "layers": 12,
        "repeats": 10,
        "processes": 1,
        "gpu": gpu,
        "versions": {
            "torch": "2.14.0",
            "cuda": "13.0",
            "triton": "3.8.0",
            "transformers": "5.25.0",
            "flashdeberta": "0.0.8",
            "disentangled-flash": "1.1.1",
        },
        "parity": "passed",
        "not_started": ["train 4x2048 (12 layers)"],
        "cases": [
            {
                "case": "infer 32x512",
                "mode": "infer",
                "batch": 32,
                "length": 512,
                "layers": 12,
                "times": [times],
                "ours_over_bert": {"median": 2.0, "min": 2.0, "max": 2.0},
                "transformers_over_ours": {"median": 15.0, "min": 15.0, "max": 15.0},
                "target": 2.5,
                "over_ours": {
                    "flashdeberta": {"median": 1.5, "min": 1.5, "max": 1.5},
                    "transformers-deberta": {"median": 15.0, "min": 15.0, "max": 15.0},
                },
                "peak_gib": [{"ours-sdpa": 0.5, "bert-sdpa": 0.25, "transformers-deberta": 6.0, "flashdeberta": 1.0}],
                "failed": {"disentangled-flash": "disentangled-flash is not installed"},
                "faster_than": ["flashdeberta", "disentangled-flash"],
                "peak_gib_target": None,
            },
            {
                "case": "infer 1x16384",
                "mode": "infer",
                "batch": 1,
                "length": 16384,
                "layers": 12,
                "times": [long],
                "ours_over_bert": {"median": 2.0, "min": 2.0, "max": 2.0},
                "transformers_over_ours": None,
                "target": None,
                "over_ours": {"flashdeberta": {"median": 0.75, "min": 0.75, "max": 0.75}},
                "peak_gib": [{"ours-sdpa": 1.5, "bert-sdpa": 0.5, "flashdeberta": 3.0}],
                "failed": {"transformers-deberta": "CUDA out of memory"},
                "faster_than": ["flashdeberta"],
                "peak_gib_target": 1.0,
            },
        ],
    }
    command = ["python", "-m", "benchmarks.run", "--device", "cuda"]
    return append_record("run", figures, command=command, folder=folder, commit="c235d78")  # a clean commit: shown


def test_a_gpu_record_makes_the_gpu_table_and_figure_beside_the_cpu_ones(tmp_path):
    """With a CUDA record the GPU section shows its times, memory, ratios and targets, and gpu.png is drawn from it;
    the CPU results and the README stay as the CPU records make them. Without one the section says where it comes
    from."""
    shutil.copytree(RECORDS, tmp_path / "records")
    before, before_figures = report.generate(tmp_path / "records")
    page = before[report.Path("docs/performance.md")]
    gpu_part = page.split("## Results on GPUs", 1)[1].split("## Older records", 1)[0]
    assert "No GPU results yet: nothing on this page was measured on a GPU" in gpu_part
    assert "has not yet run on a GPU" in gpu_part and "(#on-a-gpu)" in gpu_part
    assert report.Path("docs/performance/gpu.png") not in before_figures

    gpu_record(tmp_path / "records")
    texts, figures = report.generate(tmp_path / "records")
    page = texts[report.Path("docs/performance.md")]
    cpu_part, gpu_part = page.split("## Results on GPUs", 1)
    gpu_part, after = gpu_part.split("## Older records", 1)
    assert cpu_part == before[report.Path("docs/performance.md")].split("## Results on GPUs", 1)[0]
    assert after == before[report.Path("docs/performance.md")].split("## Older records", 1)[1]
    assert texts[report.Path("README.md")] == before[report.Path("README.md")]
    assert "### NVIDIA H200, bfloat16" in gpu_part and "flashdeberta 0.0.8, disentangled-flash 1.1.1" in gpu_part
    assert "Parity before the timings: passed." in gpu_part and "Not started (time budget): train 4x2048" in gpu_part
    header = "| case | ours-sdpa | bert-sdpa | transformers-deberta | flashdeberta | disentangled-flash |"
    assert gpu_part.count(header) == 1
    assert "| infer 32x512 | 20.0 | 10.0 | 300.0 | 30.0 | left out |" in gpu_part
    assert "| infer 1x16384 | 1.50 | 0.50 | left out | 3.00 | - |" in gpu_part  # peak GiB
    assert (
        "| infer 32x512 | 2.00 (2.00-2.00) | 15.00x (15.00-15.00) | 1.50x (1.50-1.50) | - | ours / BERT at most 2.50: "
        "met; faster than flashdeberta: met; faster than disentangled-flash: not measured |"
    ) in gpu_part
    assert "faster than flashdeberta: NOT met; at most 1 GiB above the model: NOT met |" in gpu_part
    assert "- infer 1x16384, transformers-deberta: CUDA out of memory" in gpu_part
    gpu_png = report.Path("docs/performance/gpu.png")
    assert figures[gpu_png]["NVIDIA H200, bfloat16"]["flashdeberta"][1] == ("infer 1x16384", 150.0, 3.0)
    assert figures[gpu_png]["NVIDIA H200, bfloat16"]["disentangled-flash"][0] == ("infer 32x512", None, None)
    report.draw(gpu_png.name, figures[gpu_png], tmp_path / "gpu.png")
    assert report.figure_digest(tmp_path / "gpu.png") == report.digest(figures[gpu_png])
    for path, data in before_figures.items():  # the CPU figures are drawn from the CPU records alone
        assert figures[path] == data


def test_a_record_with_forced_kernels_is_its_own_machine(tmp_path):
    """One processor measured twice, its CPU kernels on their best set and forced to a lower one
    (DISENTANGLED_CPU_ISA): two machines on the page, each the newest of its kind, the forced one named so."""
    from benchmarks import machine

    figures = {"dtype": "float32", "cases": [{"case": "infer 8x128"}]}
    extensions = ["avx2", "fma", "avx512f"]
    for name, forced in (("avx512", False), ("avx2", True), ("avx512", False)):
        record = append_record("run", figures, command=[name], folder=tmp_path)
        record |= {"extensions": extensions, "instruction_set": {"name": name, "forced": forced, "built": True}}
        lines = (tmp_path / "run.jsonl").read_text().splitlines()
        (tmp_path / "run.jsonl").write_text("\n".join([*lines[:-1], json.dumps(record)]) + "\n")
    records = read_records("run", tmp_path)
    labels = [machine.label(record) for record in records]
    assert labels[0] == labels[2] != labels[1]
    assert labels[1].endswith("(AVX-512; AVX2 kernels forced)")
    assert [record["command"] for record in report.latest(records, "cases")] == ["avx512", "avx2"]
    assert "our CPU kernels: AVX2, forced" in report.processor_line(records[1])


def test_the_results_lead_with_the_current_kernels_and_show_committed_code_only():
    """The CPU results first show records of code with the kernels its processor runs now; the older records come
    below, each saying which kernels its code lacked; a record of uncommitted or unnamed code is shown nowhere."""
    texts, figures = report.generate()
    page = texts[report.Path("docs/performance.md")]
    reading = page.index("## Reading the results")
    results = page.split("## Results on CPUs", 1)[1].split("## Results on GPUs", 1)[0]
    older = page.split("## Older records", 1)[1].split("## Running the benchmarks", 1)[0]
    assert reading < page.index("## Results on CPUs") < page.index("## Older records")
    assert "with changes not committed" not in page and "commit not recorded" not in page
    assert "Code from before" not in results and results.count("Code with the current kernels") >= 4
    assert "commit 833d477" in older and "Code from before" in older and "commit 833d477" not in results
    for label in figures[report.Path("docs/performance/speed.png")]:  # the headline figure names clean commits
        assert "+dirty" not in label and "commit " in label


def test_a_record_is_dated_by_the_kernels_its_processor_runs():
    """Which kernels a record's code lacked depends on its processor and calls: AVX2 needs the AVX2 build, AVX-512
    without AMX the build that fixed it there; a memory record (inference) needs no training kernel."""
    avx2 = {"extensions": ["avx2", "fma"], "commit": "2aca68d", "figures": {"memory": {}}}
    no_amx = {"extensions": ["avx2", "fma", "avx512f"], "commit": "cc7143c", "figures": {"cases": [{"case": "x"}]}}
    amx = {"extensions": ["avx2", "fma", "avx512f", "amx_bf16"], "commit": "a343b26", "figures": {}}
    assert [change.commit for change in report.lacks(avx2) if change.kernel] == ["037e116"]
    assert report.current(no_amx, {"inference", "training"}) and not report.current(dict(no_amx, commit="833d477"))
    assert "d115b7c" in [change.commit for change in report.lacks(dict(no_amx, commit="833d477"))]
    assert report.current(amx, {"inference"}) and not report.current(amx, {"training"})  # before the training kernel
    assert report.dated(amx, {"training"}).startswith("Code from before the training kernel (1b0de8c)")
    assert not report.current(dict(amx, commit="c235d78", instruction_set={"name": "none", "built": False}))
    assert not report.clean({"commit": "a153355+dirty"}) and not report.clean({"commit": "unknown"})
    with pytest.raises(ValueError, match="whole history"):
        report.has_commit("0000000", "12a0401")
