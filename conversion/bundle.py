"""The Hub remote-code bundle: the package's configuration and modeling files that run there, flat, and the
`auto_map` that names them.

The bundle is built from the installed package sources every time (never a hand-kept copy). The one rewrite is
the import of the configuration, which is one folder up in the package and a sibling in the bundle. Every bundled
file is checked: no import of `disentangled`, and relative imports of siblings only (a single dot); a sibling the
bundle leaves out only as `from . import name` inside `try/except ImportError` (transformers fetches every
`from .name import` it finds in a remote-code file, guarded or not, and does not read `from . import name`).
"""

from __future__ import annotations

import ast
from importlib import resources
from pathlib import Path

CONFIG_FILE = "configuration_disentangled.py"
PACKAGE_CONFIG_IMPORT = "from ..configuration.configuration_disentangled import"
BUNDLE_CONFIG_IMPORT = "from .configuration_disentangled import"
CONFIG_CLASS = "DisentangledConfig"
# The modeling files that run in the bundle, on torch and transformers alone: the model and its heads, the reference,
# the PyTorch backends and the decision between them, and the Triton kernel where triton is installed. The package
# keeps the rest: native.py (the compiled CPU kernels: their C source does not travel) and kernel_check.py (the Triton
# kernel's self-check, which keeps its verdicts under ~/.cache); `dispatch.py` imports them where they are.
MODELING_FILES = (
    "modeling_disentangled.py",
    "disentangled_attention.py",
    "sdpa_attention.py",
    "flex_attention.py",
    "blocks.py",
    "cpu_inference.py",
    "cpu_training.py",
    "onnx_fused.py",
    "dispatch.py",
    "triton_attention.py",
    "triton_tiles.py",
    "validation.py",
    "workspace.py",
)


def _package_sources() -> dict[str, str]:
    """file name -> text: configuration_disentangled.py and the MODELING_FILES."""
    configuration = resources.files("disentangled.configuration")
    modeling = resources.files("disentangled.modeling")
    files = {CONFIG_FILE: (configuration / CONFIG_FILE).read_text(encoding="utf-8")}
    for name in MODELING_FILES:
        files[name] = (modeling / name).read_text(encoding="utf-8")
    return files


def _guarded(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside the body of a `try` that catches ImportError."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(handler.type) for handler in node.handlers):
            guarded.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return guarded


def _catches_import_error(caught: ast.expr | None) -> bool:
    names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
    return any(isinstance(name, ast.Name) and name.id in ("ImportError", "ModuleNotFoundError") for name in names)


def check_bundled_source(name: str, text: str, siblings: set[str]) -> None:
    """Raise ValueError unless `text` imports nothing from `disentangled` and only siblings, relatively, one dot up:
    bundled ones, or others as `from . import name` inside `try/except ImportError`."""
    tree = ast.parse(text, filename=name)
    guarded = _guarded(tree)
    for node in ast.walk(tree):
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
            if level == 1 and not module and id(node) not in guarded:
                for alias in node.names:
                    if f"{alias.name}.py" not in siblings:
                        raise ValueError(
                            f"bundled {name} imports .{alias.name}, which is not a bundled file, outside "
                            "try/except ImportError"
                        )


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
