"""The Hub remote-code bundle: the package's configuration and modeling files, flat, and the `auto_map` that names them.

The bundle is built from the installed package sources every time (never a hand-kept copy). The one rewrite is
the import of the configuration, which is one folder up in the package and a sibling in the bundle. Every bundled
file is checked: no import of `disentangled`, and relative imports of siblings only (a single dot).
"""

from __future__ import annotations

import ast
from importlib import resources
from pathlib import Path

CONFIG_FILE = "configuration_disentangled.py"
PACKAGE_CONFIG_IMPORT = "from ..configuration.configuration_disentangled import"
BUNDLE_CONFIG_IMPORT = "from .configuration_disentangled import"
CONFIG_CLASS = "DisentangledConfig"


def _package_sources() -> dict[str, str]:
    """file name -> text: configuration_disentangled.py and every modeling/*.py but __init__.py."""
    configuration = resources.files("disentangled.configuration")
    modeling = resources.files("disentangled.modeling")
    files = {CONFIG_FILE: (configuration / CONFIG_FILE).read_text(encoding="utf-8")}
    for entry in sorted(modeling.iterdir(), key=lambda entry: entry.name):
        if entry.name.endswith(".py") and entry.name != "__init__.py":
            files[entry.name] = entry.read_text(encoding="utf-8")
    return files


def check_bundled_source(name: str, text: str, siblings: set[str]) -> None:
    """Raise ValueError unless `text` imports nothing from `disentangled` and only siblings, relatively, one dot up."""
    for node in ast.walk(ast.parse(text, filename=name)):
        if isinstance(node, ast.Import):
            modules, level = [alias.name for alias in node.names], 0
        elif isinstance(node, ast.ImportFrom):
            modules, level = [node.module or ""], node.level
        else:
            continue
        for module in modules:
            if level == 0 and module.split(".")[0] == "disentangled":
                raise ValueError(f"bundled {name} imports the package itself ({module}); Hub users do not have it")
            if level > 1:
                raise ValueError(f"bundled {name} has a relative import {'.' * level}{module}: only siblings allowed")
            if level == 1 and module and f"{module.split('.')[0]}.py" not in siblings:
                raise ValueError(f"bundled {name} imports .{module}, which is not a bundled file")


def bundle_sources() -> dict[str, str]:
    """The flat remote-code files, file name -> text, checked."""
    files = {}
    for name, text in _package_sources().items():
        files[name] = text.replace(PACKAGE_CONFIG_IMPORT, BUNDLE_CONFIG_IMPORT)
    for name, text in files.items():
        check_bundled_source(name, text, set(files))
    return files


def write_bundle(folder: str | Path) -> list[str]:
    """Write the bundle into `folder`; returns the file names."""
    files = bundle_sources()
    for name, text in files.items():
        (Path(folder) / name).write_text(text, encoding="utf-8")
    return sorted(files)


def auto_map() -> dict[str, str]:
    """config.json's `auto_map`: AutoConfig and every Auto model class the package registers."""
    from disentangled.registration import AUTO_CLASSES

    entries = {"AutoConfig": f"{CONFIG_FILE.removesuffix('.py')}.{CONFIG_CLASS}"}
    for auto_name, (_, model_class) in AUTO_CLASSES.items():  # the file that defines the class, flat
        entries[auto_name] = f"{model_class.__module__.rsplit('.', 1)[-1]}.{model_class.__name__}"
    return entries
