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
    """A rerun of one corpus of benchmarks.pretrain replaces that corpus's table and bars only."""

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
