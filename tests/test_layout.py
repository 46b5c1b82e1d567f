"""The package's modules import each other in one direction: no module imports, at any depth or inside a function,
a module that imports it back. Each shared name has one home (e.g. conversion/tasks.py, explain/terms.py)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JOBS = ("pretraining", "explain", "serving", "integrations", "demo", "environment")  # src/disentangled's subpackages
PACKAGES = {  # package name -> folder, as pyproject's package-dir maps them
    "disentangled": REPO / "src" / "disentangled",
    **{f"disentangled.{room}": REPO / "src" / "disentangled" / room for room in JOBS},
    "disentangled.configuration": REPO / "configuration",
    "disentangled.modeling": REPO / "modeling",
    "disentangled.conversion": REPO / "conversion",
}


def modules() -> dict[str, Path]:
    """Every module of the package except the packages' __init__ files (which only re-export)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.glob("*.py"):
            if path.stem not in ("__init__", "__main__"):
                found[f"{package}.{path.stem}"] = path
    return found


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (top level or inside functions)."""
    package = name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `.x` from package p is p.x; `..x` is the parent's x
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)  # `from package import module`
    return {target for target in targets if target in known and target != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = "open"
        for child in sorted(graph[node]):
            if state.get(child) == "open":
                return stack[stack.index(child) :] + [child]
            if child not in state and (cycle := visit(child, [*stack, child])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_import_cycles_between_modules():
    known = modules()
    graph = {name: imported_modules(name, path, known) for name, path in known.items()}
    assert graph["disentangled.conversion.convert"] >= {"disentangled.conversion.tasks"}  # the graph is read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_the_old_circles():
    """The two circles this layout removed, as they were: convert <-> model_card and explain <-> plots."""
    graph = {"convert": {"model_card"}, "model_card": {"convert", "sources"}, "sources": set()}
    assert find_cycle(graph) == ["convert", "model_card", "convert"]
    assert find_cycle({"explain": {"plots"}, "plots": {"explain"}}) == ["explain", "plots", "explain"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_model_file_imports_every_modeling_sibling_itself():
    """transformers 4.57 copies a local folder's remote code by the model file's own relative imports only (not by
    theirs in turn): a bundled sibling that only another sibling imports is missing when the bundle loads there."""
    from disentangled.conversion.bundle import MODELING_FILES

    known = modules()
    model_file = "disentangled.modeling.modeling_disentangled"
    siblings = {f"disentangled.modeling.{name.removesuffix('.py')}" for name in MODELING_FILES} - {model_file}
    missing = siblings - imported_modules(model_file, known[model_file], known)
    assert len(siblings) >= 5 and not missing, sorted(missing)


def test_the_package_root_holds_the_public_surface_and_one_folder_per_job():
    """src/disentangled/ reads as the list of jobs: the public surface at the top, each job a subpackage that JOBS
    names and pyproject installs (a folder missing there is missing from the wheel)."""
    root = PACKAGES["disentangled"]
    surface = {"__init__", "__main__", "cli", "registration", "qa"}
    assert {path.stem for path in root.glob("*.py")} == surface
    folders = {path.parent.name for path in root.glob("*/__init__.py")}
    assert folders == set(JOBS)
    packages = (REPO / "pyproject.toml").read_text().split("packages = [", 1)[1].split("]", 1)[0]  # tomllib: 3.11+
    assert not [room for room in JOBS if f'"disentangled.{room}"' not in packages]
    for room in JOBS:
        assert ast.get_docstring(ast.parse((root / room / "__init__.py").read_text())), f"{room}/__init__.py"


ARCHITECTURE = REPO / "docs" / "internals" / "architecture.md"


def load_diagrams():
    """docs/internals/diagrams.py, which is not part of the package: the Architecture page's pictures as data."""
    spec = importlib.util.spec_from_file_location("architecture_diagrams", REPO / "docs" / "internals" / "diagrams.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_the_architecture_diagrams_name_only_files_that_exist():
    diagrams = load_diagrams()
    named = [name for diagram in diagrams.DIAGRAMS for name in diagrams.named_files(diagram)]
    assert "modeling/sdpa_attention.py" in named and "src/disentangled/serving/quantization.py" in named  # read
    assert "modeling/position_bias.c" in named  # a file in backticks, in the box's folder
    missing = sorted({name for name in named if not (REPO / name).exists()})
    assert not missing, f"docs/internals/diagrams.py names what does not exist: {missing}"


def test_the_diagram_reader_sees_a_missing_file():
    diagrams = load_diagrams()
    picture = diagrams.Diagram(
        "test",
        "a test",
        [
            [diagrams.Box("a", "modeling/gone.py", ["x"])],
            diagrams.Group(
                "demo", [[diagrams.Box("b", "demo/", ["`remote.py`, `data.py`"], "folder")]], "src/disentangled/"
            ),
        ],
        [("a", "b", "")],
    )
    assert diagrams.named_files(picture) == [
        "modeling/gone.py",
        "src/disentangled/demo/",
        "src/disentangled/demo/remote.py",
        "src/disentangled/demo/data.py",
    ]
    assert not (REPO / "modeling/gone.py").exists()


def test_the_architecture_page_shows_every_diagram_and_each_is_current():
    """Each picture is on the page, and its SVG was drawn from the data and code as they are (a box added without
    `python docs/internals/diagrams.py` fails here). The page draws nothing at view time: no Mermaid, no script."""
    diagrams = load_diagrams()
    page = ARCHITECTURE.read_text()
    assert [f"(architecture/{diagram.name}.svg)" in page for diagram in diagrams.DIAGRAMS] == [True] * 3
    assert "```mermaid" not in page and "<script" not in page
    assert diagrams.stale() == [], "run: python docs/internals/diagrams.py"


def test_a_diagram_too_wide_or_with_an_arrow_through_a_box_is_refused():
    diagrams = load_diagrams()
    wide = diagrams.Diagram("w", "w", [[diagrams.Box(str(n), "modeling/" + "x" * 30 + ".py") for n in range(4)]], [])
    with pytest.raises(ValueError, match="px wide"):
        diagrams.svg(wide)
    rows = [[diagrams.Box("a", "a.py")], [diagrams.Box("b", "b.py")], [diagrams.Box("c", "c.py")]]
    with pytest.raises(ValueError, match="the arrow a -> c runs through b"):
        diagrams.svg(diagrams.Diagram("t", "t", rows, [("a", "c", "")]))
    assert "<svg" in diagrams.svg(diagrams.Diagram("t", "t", rows, [("a", "b", ""), ("b", "c", "")]))


def test_a_diagram_whose_labels_overlap_is_refused():
    """Two arrows that cross between the same rows put their labels on one spot (the call picture's "flex_attention"
    and "asks" once did): refused, and so is a label drawn over a box."""
    diagrams = load_diagrams()
    rows = [
        [diagrams.Box("a", "a.py"), diagrams.Box("b", "b.py")],
        [diagrams.Box("c", "c.py"), diagrams.Box("d", "d.py")],
    ]
    crossing = [("a", "d", "flex_attention"), ("b", "c", "asks")]
    with pytest.raises(ValueError, match="the labels 'flex_attention' and 'asks' overlap"):
        diagrams.svg(diagrams.Diagram("t", "t", rows, crossing))
    assert "<svg" in diagrams.svg(diagrams.Diagram("t", "t", rows, [("a", "c", "down"), ("b", "d", "down too")]))


def test_the_rooms_picture_shows_the_serving_operator_s_files():
    diagrams = load_diagrams()
    named = diagrams.named_files(diagrams.ROOMS)
    serving = "src/disentangled/serving/"
    assert {serving + name for name in ("ort_attention.c", "ort_operator.py", "onnx_attention.py")} <= set(named)
    assert "position_bias.h" in " ".join(line for _, box in diagrams.boxes(diagrams.ROOMS) for line in box.lines)


def test_the_reporting_page_lists_every_environment_variable_the_package_reads():
    """The switches a user can set are all on docs/reporting.md's table, and the table names none that the code
    does not read: every `DISENTANGLED_*` string of the product's sources against the table's first column."""
    import re

    sources = [path for folder in PACKAGES.values() for path in folder.glob("*.py")]
    sources += [*(REPO / "modeling").glob("*.c"), *(REPO / "src" / "disentangled" / "serving").glob("*.c")]
    read = {name for path in sources for name in re.findall(r"[\"'`](DISENTANGLED_[A-Z0-9_]+)", path.read_text())}
    page = (REPO / "docs" / "reporting.md").read_text()
    listed = set(re.findall(r"^\| `(DISENTANGLED_[A-Z0-9_]+)`", page, flags=re.MULTILINE))
    assert len(read) >= 10 and read == listed, (sorted(read - listed), sorted(listed - read))
