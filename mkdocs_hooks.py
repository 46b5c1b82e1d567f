"""MkDocs hook: lay the package out as it is installed, for mkdocstrings.

pyproject maps `configuration/`, `modeling/` and `conversion/` under the `disentangled` package, which griffe (the
API reference's reader) cannot follow from the source tree (it also resolves links to their targets). Before any
page renders, this copies the sources into `.api-src/disentangled/` (git-ignored) as they are installed, and the python
handler reads them there (`paths: [.api-src]` in mkdocs.yml).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent
SUBPACKAGES = ("configuration", "modeling", "conversion")


@event_priority(100)  # before mkdocstrings reads `paths`: on a fresh clone .api-src does not exist yet
def on_config(config, **kwargs):
    package = ROOT / ".api-src" / "disentangled"
    shutil.rmtree(package.parent, ignore_errors=True)
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "src" / "disentangled", package, ignore=skip)
    for name in SUBPACKAGES:
        shutil.copytree(ROOT / name, package / name, ignore=skip)
    return config
