"""The manual speaks to its readers, and builds with what the `docs` extra installs.

- No words of the project's own workflow in README.md, model_card.md or docs/ (generated sections and the pictures'
  text included): a reader has no issue tracker of ours to follow, no scratch folder, no uncommitted tree, no machine
  of ours with its output folder. A record keeps such things; a page shows the command a reader reruns.
- No words of the project's own making in the pages' prose (code and commands aside): the names of our CI's virtual
  environments, our benchmarks' word "anchors", the keys a benchmark gives its columns; a page says what they are.
- The build needs neither torch nor transformers nor the package: the API reference is read from the sources.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.records import RECORDS, read_records

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "model_card.md", *sorted((REPO / "docs").rglob("*.md"))]
PICTURES = sorted((REPO / "docs").rglob("*.svg"))
WORKFLOW = {  # pattern -> what it is, for the failure message
    r"\$OUT\b|(?<![\w-])OUT/": "a device tool's output folder ($OUT): name the reader's own output folder",
    r"\.device-wheels": "our wheel folder: the reader's folder of wheels is theirs to name",
    r"\bdevice machine|\b(?:GPU|device) session\b": "our machines and sessions: say 'a GPU machine'",
    r"\bissues? #?\d+|\(issue\b|\bthis issue\b|\bthe issue's\b|\bissue behind\b": "our issue numbers and threads",
    r"/tmp/": "a scratch path of one run: the page shows the command without it",
    r"\+dirty\b": "a commit with uncommitted changes: say so in words, or rerun at a commit",
    r"\bREV\b": "a placeholder of our device runs",
    r"farm[- ]studio": "the name of our tooling",
}


def workflow_words(text: str) -> list[str]:
    """Each workflow word found in `text`, with what it is."""
    found = []
    for pattern, what in WORKFLOW.items():
        found += [f"{match[0]!r} ({what})" for match in re.finditer(pattern, text)]
    return found


def test_the_checker_finds_the_words_the_manual_once_had():
    """Sentences the manual carried before: each one is caught."""
    old = [
        "A device machine reaches no package registry, and its image has torch",
        "the results, the record and the check's own lines land under `$OUT`",
        "then copy `OUT/triton_tiles.json` to `modeling/triton_tiles.json` here",
        "into the git-ignored `.device-wheels/`, which the device run carries",
        "The targets (issue 38): inference faster than both anchors",
        "The issue behind this page: on real text",
        "takes the random-replacement AUC from 0.66 (the code before this issue) to 0.90",
        "Command: `python -m benchmarks.run --no-timing --out /tmp/s35/mem-f32b`",
        "commit 7cc91eb+dirty, 2026-12-04",
        "the whole GPU session in one command",
    ]
    assert [bool(workflow_words(sentence)) for sentence in old] == [True] * len(old)
    fine = "Open an issue on the repository with the output of `disentangled env`; onnxruntime's InferenceSession."
    assert workflow_words(fine) == []


@pytest.mark.parametrize("path", PAGES + PICTURES, ids=lambda path: str(path.relative_to(REPO)))
def test_the_manual_has_no_workflow_words(path):
    found = [
        f"line {number}: {word}"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for word in workflow_words(line)
    ]
    assert not found, f"{path.relative_to(REPO)} speaks of our own workflow:\n" + "\n".join(found)


# pattern -> what to write instead; checked over the prose of the pages (fenced blocks, inline code and HTML comments
# removed: a command or a file name is written as it is)
PROJECT_WORDS = {
    r"\.venv\w*": "a virtual environment of our CI: say what environment the reader needs",
    r"\.ci/": "our CI's script: only the contributors' page names it",
    r"\banchors?\b": "our benchmarks' word for the other GPU implementations: name them (FlashDeBERTa, disentangled-flash)",
    r"\bours-onnx[\w-]*|\bours-pytorch\b|\bdeberta-onnx\b|\bbert-onnx[\w-]*|\bbert-(?:dynamo|torchscript)\b": (
        "a benchmark's key for a column: say what the model or graph is"
    ),
    r"\bat or under it\b": "the benchmark's wording: say 'processes meeting it'",
}
CONTRIBUTORS = {"docs/contributing.md": {r"\.ci/"}}  # the page for people who change the project names its CI


def prose(text: str) -> str:
    """The text a reader reads as sentences: fenced blocks, HTML comments and inline code blanked, lines kept."""
    blank = lambda match: "\n" * match[0].count("\n")  # noqa: E731
    text = re.sub(r"^```.*?^```", blank, text, flags=re.DOTALL | re.MULTILINE)
    text = re.sub(r"<!--.*?-->", blank, text, flags=re.DOTALL)
    return re.sub(r"`[^`\n]+`", "", text)


def project_words(text: str, allowed: set[str] = frozenset()) -> list[str]:
    found = []
    for pattern, what in PROJECT_WORDS.items():
        if pattern not in allowed:
            found += [f"{match[0]!r} ({what})" for match in re.finditer(pattern, text)]
    return found


def test_the_checker_finds_the_project_s_words_the_manual_once_had():
    old = [
        "cases run in a second Python environment (`--python PATH`; by default\n`.venv457suite/bin/python`, which "
        "`.ci/run` makes)",
        "a venv of its own (.venv457suite)",
        "then the benchmark, beside the anchors: inference faster than both anchors",
        "| case | ours-pytorch | ours-onnx-before | ours-onnx |",
        "| bert-onnx-optimized (bert-dynamo-optimized) | 1.39 |",
        "| case | ratio | target | processes at or under it |",
    ]
    assert [bool(project_words(prose(sentence))) for sentence in old] == [False, True, True, True, True, True]
    assert project_words("by default .venv457suite/bin/python, which .ci/run makes")  # outside code it is caught
    fine = "`--anchors` (which of those), `benchmarks/gpu_anchors.py`, ```\npython -m benchmarks.onnx_runtime\n```"
    assert project_words(prose(fine)) == []


@pytest.mark.parametrize("path", PAGES, ids=lambda path: str(path.relative_to(REPO)))
def test_the_manual_speaks_the_reader_s_words(path):
    name = str(path.relative_to(REPO))
    found = [
        f"line {number}: {word}"
        for number, line in enumerate(prose(path.read_text()).splitlines(), 1)
        for word in project_words(line, CONTRIBUTORS.get(name, set()))
    ]
    assert not found, f"{name} uses the project's own words:\n" + "\n".join(found)


def test_the_generator_shows_a_reader_s_command(tmp_path):
    """A record made with a scratch folder: the pages show the command without the folder, the record keeps it. A
    record of a tree with uncommitted changes is not shown on the performance page; the same at a commit is."""
    assert report.shown_command("python -m benchmarks.run --no-timing --out /tmp/s35/mem --threads 2") == (
        "python -m benchmarks.run --no-timing --threads 2"
    )
    assert report.shown_command("python -m benchmarks.kernel_resources --json=/tmp/x.jsonl") == (
        "python -m benchmarks.kernel_resources"
    )
    assert report.shown_command("python -m benchmarks.kernel_resources --python /tmp/v38/bin/python --json x") == (
        "python -m benchmarks.kernel_resources --python PYTHON_WITH_ANOTHER_TRITON"
    )
    assert report.shown_commit("c819abc+dirty") == "c819abc with changes not committed"
    assert report.shown_commit("unknown") == "not recorded"
    records = tmp_path / "records"
    shutil.copytree(RECORDS, records)
    newest = copy.deepcopy(report.latest(read_records("run", records), "cases")[-1])
    newest["figures"]["cases"][0]["ours_over_bert"] = {"median": 0.5, "min": 0.4, "max": 0.6}
    newest["command"] = "python -m benchmarks.run --out /tmp/scratch/run"
    for commit, shown in (("abc1234+dirty", False), ("c235d78", True)):  # a tree with changes is not shown
        with (records / "run.jsonl").open("a") as out:
            out.write(json.dumps(newest | {"commit": commit}) + "\n")
        texts, _ = report.generate(records)
        page = texts[Path("docs/performance.md")]
        assert ("| 0.50 (0.40-0.60) |" in page) == shown and "abc1234" not in page
    assert "commit c235d78: `python -m benchmarks.run`" in page
    assert "Code with the current kernels and every later change in the list above." in page
    for path, text in texts.items():
        assert workflow_words(text) == [], path
    assert read_records("run", records)[-1]["command"].endswith("--out /tmp/scratch/run")  # the record keeps it


def test_home_points_each_reader_to_a_page():
    """Home's "Where to start" has a row for each way in, accelerating a model another library built and reporting a
    problem included, and each row's page is in the manual."""
    table = (REPO / "docs" / "index.md").read_text().split("## Where to start", 1)[1]
    pages = re.findall(r"\]\(([\w/.-]+\.md)\)", table)
    assert {"libraries.md", "reporting.md", "performance.md", "getting-started.md"} <= set(pages)
    assert all((REPO / "docs" / page).exists() for page in pages)


def test_the_docs_extra_is_what_docs_requirements_installs():
    """`pip install -r docs/requirements.txt` builds the manual without the package; the extra lists the same."""
    extra = re.search(r"^docs = \[(.*)\]", (REPO / "pyproject.toml").read_text(), re.MULTILINE)[1]  # tomllib: 3.11+
    extra = re.findall(r'"([^"]+)"', extra)
    lines = (REPO / "docs" / "requirements.txt").read_text().splitlines()
    assert sorted(extra) == sorted(line for line in lines if line and not line.startswith("#"))


def test_the_manual_builds_without_torch_transformers_or_the_package(tmp_path):
    """The strict build, in a process where torch, transformers and disentangled cannot be imported: what the `docs`
    requirements install is enough (the API reference comes from the sources, read by griffe)."""
    blocked = "import sys; [sys.modules.__setitem__(name, None) for name in ('torch', 'transformers', 'disentangled')]"
    build = f"{blocked}; from mkdocs.__main__ import cli; cli(['build', '--strict', '--quiet', '--site-dir', {str(tmp_path)!r}])"
    done = subprocess.run(
        [sys.executable, "-c", build],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "api" / "index.html").read_text()
    assert "DisentangledForMaskedLM" in api and "answer_question" in api  # the reference was read, not left empty
