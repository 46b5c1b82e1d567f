"""Every command a reader can copy from README.md and docs/**/*.md runs, on tiny settings, offline.

Each fenced `bash`/`sh`/`shell`/`python` block needs a mark on the line before it (docs/contributing.md, "Every
command is run"):

    <!-- run -->                      run as written, in a fresh folder holding the names the pages use
    <!-- run: tiny -->                the same, with the options that set a run's size made small (`TINY`)
    <!-- run: inputs-only -->         in a folder without the converted models (the command writes one)
    <!-- run: isolated, 4.57 -->      Python where `import disentangled` is blocked, also on transformers 4.57
    <!-- run: in-repo -->             in the repository itself (the command reads its files and writes none)
    <!-- covered: tests/F.py::T -->   run on small settings by the named test, which must exist
    <!-- skip: REASON -->             needs the Hub, a GPU, several machines or a network install

An unmarked command block, an unknown mark, or a fenced block without a language fails `test_every_block_is_marked`,
so nobody adds a command that no test runs. The blocks are read when the module is collected, so new pages and
blocks are picked up as they come.

Python blocks run in a child forked from a process that has imported torch and transformers but not this package, so
each starts as a reader's fresh interpreter would (a missing `import disentangled` or `trust_remote_code=True` fails),
without paying torch's import each time. `disentangled` command lines run through `disentangled.cli.main`, the console
script's entry point, in this process (logging levels, threads and random state put back after); other shell lines
run in bash with this environment's `bin/` first on PATH. A block fails when it exits non-zero or prints transformers'
"Do you wish to run the custom code?" question.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import datasets
import pytest
import torch
import transformers
from conversion_sources import hub_v3_discriminator_cases
from finetune_helpers import sentiment_files
from isolated import PYTHON_4_57, run_isolated, system_python
from spm_fixture import corpus_lines, write_deberta_v3_tokenizer_files
from tiny_models import spm_model

from disentangled import cli

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]  # docs/internals/ included
COMMAND_LANGUAGES = {"bash", "sh", "shell", "python"}
RUN_OPTIONS = {"tiny", "inputs-only", "isolated", "4.57", "in-repo"}
PROMPT = "Do you wish to run the custom code"
# The options that set a run's size -> the value a test run uses (None: the flag is dropped)
TINY = {
    "--max-steps": "2",
    "--max_steps": "2",
    "--num_train_epochs": "1",
    "--config": "tiny",
    "--max-seq-length": "32",
    "--max_seq_length": "32",
    "--per-device-train-batch-size": "4",
    "--per_device_train_batch_size": "4",
    "--vocab-size": "120",
    "--generator-layers": "1",
    "--bf16": None,
}
MODELS = ["deberta-v3-base-disentangled", "deberta-v3-base-rtd", "you", "path"]  # what inputs-only leaves out


@dataclass
class Block:
    page: str
    line: int
    language: str
    code: str
    kind: str | None  # run, covered, skip, or None (no mark)
    detail: str  # run's options, covered's test, skip's reason

    @property
    def options(self) -> set[str]:
        return {option.strip() for option in self.detail.split(",") if option.strip()} if self.kind == "run" else set()

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def read_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a page, each with the mark on the nearest non-blank line before it."""
    lines = path.read_text().splitlines()
    blocks, number = [], 0
    while number < len(lines):
        opening = re.match(r"^```(\S*)", lines[number])
        if not opening:
            number += 1
            continue
        end = next(i for i in range(number + 1, len(lines)) if lines[i].startswith("```"))
        before = next((lines[i] for i in range(number - 1, -1, -1) if lines[i].strip()), "")
        mark = re.fullmatch(r"\s*<!--\s*(run|covered|skip)\s*(?::\s*(.*?))?\s*-->\s*", before)
        blocks.append(
            Block(
                page=str(path.relative_to(REPO)),
                line=number + 1,
                language=opening[1],
                code="\n".join(lines[number + 1 : end]) + "\n",
                kind=mark[1] if mark else None,
                detail=(mark[2] or "") if mark else "",
            )
        )
        number = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in read_blocks(page)]
RUN_BLOCKS = [block for block in BLOCKS if block.kind == "run"]


def problems_of(block: Block) -> list[str]:
    if not block.language:
        return ["a fenced block without a language: `bash` or `python` for commands, `text` for output"]
    if block.language not in COMMAND_LANGUAGES:
        return [f"a {block.language} block is not run: it cannot carry a run mark"] if block.kind == "run" else []
    if block.kind is None:
        return ["a command block without a mark (<!-- run -->, <!-- covered: ... -->, <!-- skip: REASON -->)"]
    if block.kind == "run" and not block.options <= RUN_OPTIONS:
        return [f"unknown run options {sorted(block.options - RUN_OPTIONS)} (known: {sorted(RUN_OPTIONS)})"]
    if block.kind == "run" and block.language != "python" and block.options & {"isolated", "4.57"}:
        return ["isolated and 4.57 apply to python blocks"]
    if block.kind == "skip" and not block.detail:
        return ["a skip mark needs its reason: <!-- skip: needs the Hub -->"]
    if block.kind == "covered":
        target = re.match(r"(tests/\w+\.py)::(\w+)", block.detail)
        if not target:
            return ["a covered mark names its test: <!-- covered: tests/test_x.py::test_y (why) -->"]
        file = REPO / target[1]
        tree = ast.parse(file.read_text()) if file.exists() else ast.Module(body=[], type_ignores=[])
        names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        if target[2] not in names:
            return [f"{target[1]}::{target[2]} does not exist"]
    return []


def test_every_block_is_marked():
    problems = [f"{block}: {problem}" for block in BLOCKS for problem in problems_of(block)]
    assert not problems, "\n".join(problems)


def test_the_reader_sees_the_marks_it_needs():
    """The parser finds what the pages hold: commands in README.md and the manual, of every kind."""
    kinds = {block.kind for block in BLOCKS if block.language in COMMAND_LANGUAGES}
    assert {"run", "covered", "skip"} <= kinds
    assert any(block.page == "README.md" for block in RUN_BLOCKS)
    assert {"docs/pretraining.md", "docs/conversion.md"} <= {block.page for block in RUN_BLOCKS}
    sample = Block("x.md", 1, "bash", "disentangled pretrain --max-steps 9000 --bf16 --config small\n", "run", "tiny")
    assert tiny(sample.code) == "disentangled pretrain --max-steps 2 --config tiny\n"
    assert problems_of(Block("x.md", 1, "bash", "ls\n", None, ""))  # unmarked: refused
    assert problems_of(Block("x.md", 1, "", "ls\n", None, ""))  # no language: refused
    assert problems_of(Block("x.md", 1, "bash", "ls\n", "covered", "tests/test_layout.py::no_such_test"))


def test_the_readme_is_a_front_page():
    """What it is, install, one usage block, one results table and figure, links: no run diary. (The generated
    results table dates each row: when a record was measured is part of it.)"""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    written = re.sub(r"<!-- generated by .*?<!-- end of generated section -->", "", readme, flags=re.DOTALL)
    assert "| machine, dtype, threads, layers, date |" in readme and "| machine," not in written  # the cut is read
    assert not re.search(r"our reading|\b20\d\d-\d\d-\d\d\b", written, re.IGNORECASE)


def tiny(code: str) -> str:
    for option, value in TINY.items():
        if value is None:
            code = re.sub(rf"[ \t]+{re.escape(option)}(?=\s)", "", code)
        else:
            code = re.sub(rf"(?<=\s){re.escape(option)}[ =]\S+", f"{option} {value}", code)
    return code


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The names the pages use: text files, CSVs, `examples/`, a local `microsoft/deberta-v3-base` (a tiny model laid
    out as that repo is: both heads, the generator, SentencePiece files) and folders converted from it."""
    root = tmp_path_factory.mktemp("documented")
    work = root / "work"
    work.mkdir()
    for name, count, seed in (("corpus.txt", 400, 0), ("held-out.txt", 100, 1), ("domain.txt", 200, 2)):
        (work / name).write_text("\n".join(corpus_lines(count, seed=seed)) + "\n")
    train, validation = sentiment_files(root / "csv", train=32, validation=16)
    shutil.copy(train, work / "train.csv")
    shutil.copy(validation, work / "dev.csv")
    source = hub_v3_discriminator_cases(root / "sources")[0].source
    write_deberta_v3_tokenizer_files(source, spm_model())
    config = json.loads((source / "config.json").read_text())
    for key in ("id2label", "label2id"):  # as microsoft/deberta-v3-base's config.json: no labels, so 2 by default
        config.pop(key, None)
    (source / "config.json").write_text(json.dumps(config))
    shutil.copytree(REPO / "examples", work / "examples")  # readers run the commands from the checkout
    shutil.copytree(source, work / "microsoft" / "deberta-v3-base")
    with contextlib.redirect_stdout(io.StringIO()) as log:
        converted = work / "deberta-v3-base-disentangled"
        assert cli.main(["convert", str(source), str(converted)]) == 0, log.getvalue()
        rtd = ["convert", str(source), str(work / "deberta-v3-base-rtd"), "--task", "replaced-token-detection"]
        assert cli.main(rtd) == 0, log.getvalue()
    for alias in ("you/deberta-v3-base-disentangled", "path/to/model"):
        shutil.copytree(converted, work / alias)
    return work


def folder_for(block: Block, workspace: Path, tmp_path: Path) -> Path:
    if "in-repo" in block.options:
        return REPO
    leave_out = MODELS if "inputs-only" in block.options else []
    folder = tmp_path / "work"
    shutil.copytree(workspace, folder, ignore=lambda directory, names: [n for n in names if n in leave_out])
    return folder


def command_lines(code: str) -> list[str]:
    """Shell lines with their continuations joined and comments removed."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


@contextlib.contextmanager
def working_directory(folder: Path):
    """contextlib.chdir, which Python 3.10 lacks."""
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def in_process(folder: Path, out: io.StringIO):
    """Run a block here as in a fresh process: in `folder`, output to `out`, and the global state a command may set
    (logging levels and handlers, torch's threads and random state) put back afterwards."""
    root = logging.getLogger()
    saved = (root.level, list(root.handlers), transformers.logging.get_verbosity(), torch.get_num_threads())
    datasets_verbosity = datasets.utils.logging.get_verbosity()
    try:
        with working_directory(folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            with torch.random.fork_rng():
                yield
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        transformers.logging.set_verbosity(saved[2])
        torch.set_num_threads(saved[3])
        datasets.utils.logging.set_verbosity(datasets_verbosity)


def run_shell(code: str, folder: Path) -> str:
    lines = command_lines(code)
    if all(line.startswith("disentangled ") for line in lines):
        out = io.StringIO()
        for line in lines:
            with in_process(folder, out):
                status = cli.main(shlex.split(line)[1:])
            assert status in (0, None), f"{line}\n{out.getvalue()[-3000:]}"
        return out.getvalue()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return output


# A Python process that has imported torch and transformers, and nothing of this package, forks a child per block: the
# child starts as a fresh interpreter would after those two imports, so a block that forgets `import disentangled` (or
# `trust_remote_code=True`) fails here as it would for a reader, without paying torch's import for every block.
FORK_SERVER = """
import json, os, runpy, sys, traceback
import torch, transformers
from transformers import AutoModel, AutoTokenizer, pipeline  # loads the modules every block needs, once
for request in sys.stdin:
    script, output = json.loads(request)
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            with open(output, "w") as out, open(os.devnull) as nothing:
                os.dup2(nothing.fileno(), 0)
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                os.chdir(os.path.dirname(script))
                sys.argv = [script]
                try:
                    runpy.run_path(script, run_name="__main__")
                except BaseException:
                    traceback.print_exc()
                    status = 1
                sys.stdout.flush()
                sys.stderr.flush()
        finally:
            os._exit(status)
    _, code = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(code)), flush=True)
"""


@pytest.fixture(scope="module")
def fork_server():
    server = subprocess.Popen(
        [sys.executable, "-c", FORK_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    yield server
    server.stdin.close()
    server.wait(timeout=60)


def run_python(code: str, folder: Path, server: subprocess.Popen) -> str:
    script, output = folder / "documented_block.py", folder / "documented_block.out"
    script.write_text(code)
    server.stdin.write(json.dumps([str(script), str(output)]) + "\n")
    server.stdin.flush()
    status = json.loads(server.stdout.readline())
    printed = output.read_text()
    assert status == 0, printed[-3000:]
    return printed


def run_params() -> list:
    params = []
    for block in RUN_BLOCKS:
        params.append(pytest.param(block, "here", id=str(block)))
        if "4.57" in block.options:
            no_457 = pytest.mark.skipif(not PYTHON_4_57.exists(), reason=f"no transformers 4.57 at {PYTHON_4_57}")
            params.append(pytest.param(block, "4.57", id=f"{block}-transformers-4.57", marks=no_457))
    return params


@pytest.mark.parametrize("block, where", run_params())
def test_documented_block_runs(block: Block, where: str, workspace: Path, fork_server, tmp_path: Path):
    folder = folder_for(block, workspace, tmp_path)
    code = tiny(block.code) if "tiny" in block.options else block.code
    if block.language != "python":
        output = run_shell(code, folder)
    elif "isolated" in block.options or where == "4.57":
        script = folder / "documented_block.py"
        script.write_text(code)
        python = PYTHON_4_57 if where == "4.57" else system_python()
        result = run_isolated(python, script, [], env={"HF_HUB_OFFLINE": "1"}, timeout=300, cwd=folder)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-3000:]
    else:
        output = run_python(code, folder, fork_server)
    assert PROMPT not in output, output[-3000:]
