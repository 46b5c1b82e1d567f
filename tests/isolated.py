"""Run Python where the `disentangled` package cannot be imported, as a Hub user without it would.

The interpreter starts with -I -S: no user site, no PYTHONPATH, and no .pth files, so an editable install's
import hook is never installed. Its usual sys.path is restored by hand, minus any folder that holds a
`disentangled` package; the child then asserts `importlib.util.find_spec("disentangled") is None`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# The transformers 4.57 environment .ci/run creates (over the system's packages: PRELUDE keeps this package out);
# override with the variable.
PYTHON_4_57 = Path(os.environ.get("DISENTANGLED_PYTHON_4_57", REPO / ".venv457" / "bin" / "python"))

PRELUDE = """
import importlib.util, json, sys
sys.path[:] = json.loads({path!r})
assert importlib.util.find_spec("disentangled") is None, "disentangled is importable"
sys.argv = json.loads({argv!r})
"""


def clean_sys_path(python: str | Path) -> list[str]:
    """The interpreter's ordinary sys.path, without folders that hold a `disentangled` package."""
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run(
            [str(python), "-I", "-c", "import json, sys; print(json.dumps(sys.path))"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return [entry for entry in json.loads(out) if entry and not (Path(entry) / "disentangled").exists()]


def run_isolated(
    python: str | Path,
    script: Path,
    args: list[str],
    env: dict | None = None,
    timeout: int = 600,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run `script` with `args` in `cwd` (default: an empty temporary folder)."""
    code = PRELUDE.format(path=json.dumps(clean_sys_path(python)), argv=json.dumps([str(script), *args]))
    code += f"\nexec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))\n"
    with tempfile.TemporaryDirectory() as empty:
        return subprocess.run(
            [str(python), "-I", "-S", "-c", code],
            cwd=cwd or empty,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )


def system_python() -> str:
    return sys.executable
