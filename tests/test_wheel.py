"""The wheel a user installs (docs/getting-started.md, "A wheel with its kernels"), made as the page says on a copy of
the checkout: `disentangled build-kernels modeling/prebuilt`, then `python -m build --wheel` (offline here:
--no-isolation, this environment's setuptools). The wheel holds the package `disentangled` alone and the prebuilt
libraries; installed into a fresh virtual environment (torch and transformers from this one's site-packages, the
checkout not importable: no editable finder, the commands run from an empty folder), with no compiler on PATH, no CC
and an empty cache, `disentangled env` reports the wheel's library and the compiled path, and `disentangled demo`
runs on a small budget. One slow test: the kernels and the wheel are built once."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from disentangled.modeling import native

REPO = Path(__file__).resolve().parents[1]
PACKAGE_FILES = ["pyproject.toml", "README.md", "src", "modeling", "configuration", "conversion"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(native._compiler() is None, reason="no C compiler here to build the kernels with"),
    pytest.mark.skipif(importlib.util.find_spec("build") is None, reason="pip install build (the dev extra has it)"),
]


def page_commands() -> list[list[str]]:
    """The command lines of the page's block that this test covers, comments dropped."""
    page = (REPO / "docs" / "getting-started.md").read_text()
    mark = r"<!-- covered: tests/test_wheel.py::test_the_wheel_carries_its_kernels_and_runs_without_a_compiler[^\n]*\n"
    block = re.search(mark + r"```bash\n(.*?)```", page, re.S)
    assert block, "docs/getting-started.md's wheel block"
    return [shlex.split(line, comments=True) for line in block[1].splitlines() if line.strip()]


def run(command: list[str], **options) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, **options)
    assert result.returncode == 0, f"{command}: {result.stdout[-2000:]} {result.stderr[-3000:]}"
    return result


def test_the_wheel_carries_its_kernels_and_runs_without_a_compiler(tmp_path):
    build_kernels, build_wheel, install = page_commands()
    assert build_kernels == ["disentangled", "build-kernels", "modeling/prebuilt"]
    assert build_wheel == ["python", "-m", "build", "--wheel"] and install[:2] == ["pip", "install"]
    checkout = tmp_path / "checkout"  # the files git keeps (and those it would), not the build outputs
    listed = run(["git", "ls-files", "-z", "-co", "--exclude-standard", "--", *PACKAGE_FILES], cwd=REPO).stdout
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            (checkout / name).write_bytes((REPO / name).read_bytes())
    run([sys.executable, "-m", "disentangled", *build_kernels[1:]], cwd=checkout)
    run([sys.executable, *build_wheel[1:], "--no-isolation"], cwd=checkout)
    wheel = checkout / install[2]
    assert wheel.is_file(), sorted(path.name for path in (checkout / "dist").iterdir())

    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"disentangled", "disentangled-0.1.0.dist-info"}
    version = native.kernels_version()
    machine = native.machine_kind()
    carried = {name.rsplit("/", 1)[1] for name in names if name.startswith("disentangled/modeling/prebuilt/")}
    expected = {native.prebuilt_name(machine, name, version) for name in native.MACHINE_SETS[machine]}
    assert expected | {f"disentangled_attention_{machine}.so", "disentangled_kernels.json"} <= carried

    environment = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(environment)])
    python = environment / "bin" / "python"
    # torch, transformers and the rest from this environment's site-packages, listed after the venv's own: a path
    # line of a .pth file runs none of the .pth files in it, so the checkout's editable install is not seen (unlike
    # --system-site-packages, this works from inside a virtual environment too, as CI's)
    own = run([str(python), "-c", "import site; print(site.getsitepackages()[0])"]).stdout.strip()
    (Path(own) / "test_wheel_parent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # --ignore-installed: the checkout's own install, whose metadata pip sees there, is left alone
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", str(wheel)])

    elsewhere, cache = tmp_path / "elsewhere", tmp_path / "cache"
    elsewhere.mkdir()
    cache.mkdir()
    removed = ("CC", native.KERNELS, "PYTHONPATH", "DISENTANGLED_CPU_ISA", "DISENTANGLED_NATIVE")
    env = {name: value for name, value in os.environ.items() if name not in removed}
    env |= {"PATH": str(environment / "bin"), "DISENTANGLED_CACHE": str(cache)}
    where = run([str(python), "-c", "import disentangled; print(disentangled.__file__)"], cwd=elsewhere, env=env)
    assert Path(where.stdout.strip()).is_relative_to(environment), where.stdout
    assert not any((environment / "bin" / name).exists() for name in ("cc", "gcc", "clang"))

    report = json.loads(
        run([str(environment / "bin" / "disentangled"), "env", "--json"], cwd=elsewhere, env=env).stdout
    )
    chosen = native.instruction_set()[0]
    library = Path(report["native"]["library"])
    assert report["native"]["built"] and report["native"]["library_from"] == "the wheel"
    assert library.is_relative_to(environment) and library.name == native.prebuilt_name(machine, chosen, version)
    (row,) = [row for row in report["paths"] if (row["dtype"], row["mode"]) == ("float32", "inference")]
    assert row["path"] in ("cpu-fused", "cpu-bias-kernel")
    if importlib.util.find_spec("onnxruntime"):  # the operator library for the package's own sessions: the wheel's
        operator = "from disentangled.serving import ort_operator; print(ort_operator.library_path())"
        found = Path(run([str(python), "-c", operator], cwd=elsewhere, env=env).stdout.strip())
        assert found.is_relative_to(environment) and found.name == f"disentangled_attention_{machine}.so"

    demo = [str(environment / "bin" / "disentangled"), "demo", "--pretrain-steps", "5", "--train-size", "32"]
    out = run([*demo, "--eval-size", "32", "--epochs", "1"], cwd=elsewhere, env=env).stdout
    assert re.search(r"demo done in \d+ s", out), out[-2000:]
    assert not any(cache.glob("*.so"))  # nothing was compiled: the wheel's kernels ran
