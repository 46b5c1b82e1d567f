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
