"""The Architecture page's pictures, drawn as SVG files that need nothing at view time: `python docs/internals/diagrams.py`.

Each picture is data: rows of boxes, top to bottom, and arrows between boxes. A box names a file or folder of the
repository on its first line (tests/test_layout.py fails when one no longer exists) and says what it does on the
lines below; a name in backticks on those lines is a file too, in the folder the first line names. To add a box,
add a `Box` to a row (a row wider than `WIDTH` is refused: start another row) and an arrow to `arrows`.

The layout is fixed by the rows: each row is centred, an arrow leaves the bottom of its box and enters the top of
the other (or a side, within a row), and an arrow's label sits on its middle. The files are written to
`docs/internals/architecture/NAME.svg` with the digest of the data they were drawn from; `--check` (and the test)
fails when one is missing or stale.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from html import escape
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "architecture"
WIDTH = 720  # the text column of the manual, in CSS pixels: a picture this wide is shown at its own size
MONO = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"
SANS = "-apple-system, 'Segoe UI', Roboto, Helvetica, Arial, 'DejaVu Sans', sans-serif"
PATH_SIZE, TEXT_SIZE, LABEL_SIZE = 13, 12.5, 11.5
LINE = 17  # pixels from one text line to the next
PAD_X, PAD_Y, GAP_X, GAP_Y = 12, 9, 22, 46
GROUP_GAP = 30  # between two groups
GROUP_PAD, GROUP_TITLE = 12, 24


@dataclass
class Box:
    key: str  # how arrows name it
    path: str  # a repository path (a folder ends with "/"; several: "a.py, b.py"), or words for a switch
    lines: list[str] = field(default_factory=list)  # what it does; `name.py` in backticks is a file in `path`
    kind: str = "file"  # "file", "switch" (a decision, not a file) or "folder"


@dataclass
class Group:
    title: str  # drawn at the top left of a frame around its rows
    rows: list[list[Box]]
    folder: str = ""  # the folder its boxes' paths are in (shown once, in the title)


@dataclass
class Diagram:
    name: str  # the file: docs/internals/architecture/NAME.svg
    title: str  # the picture's accessible title
    parts: list[list[Box] | Group]  # rows, or groups of rows, top to bottom
    arrows: list[tuple[str, str, str]]  # (from key, to key, label or "")


CALL = Diagram(
    name="call",
    title="One forward call: from the config to the attention backend that runs it",
    parts=[
        Group(
            "configuration/",
            [[Box("config", "configuration_disentangled.py", ["DisentangledConfig: each field checked when set"])]],
            folder="configuration/",
        ),
        Group(
            "modeling/: the model; the Hub bundle carries all but native.py and kernel_check.py",
            [
                [
                    Box(
                        "model",
                        "modeling_disentangled.py",
                        [
                            "DisentangledModel: embeddings, encoder, layers;",
                            "the heads: MLM (with the Enhanced Mask",
                            "Decoder), RTD, sequence, token, QA, choice",
                        ],
                    ),
                    Box("checks", "validation.py", ["each forward's inputs, checked", "(a ValueError naming the fix)"]),
                ],
                [
                    Box(
                        "attention",
                        "disentangled_attention.py",
                        ["the formula: rel_index, pos_key, pos_query,", "scaling; c2p + p2c, the position terms"],
                    )
                ],
                [
                    Box(
                        "dispatch",
                        "ALL_ATTENTION_FUNCTIONS.get_interface",
                        ["attn_implementation picks the backend"],
                        kind="switch",
                    ),
                    Box("decide", "dispatch.py", ["decide(): which path serves a", "call, and why; the switches"]),
                ],
                [
                    Box("eager", "disentangled_attention.py", ["eager: the reference,", "a dense [B, H, L, L] bias"]),
                    Box("sdpa", "sdpa_attention.py", ["sdpa, the default: the bias", "by blocks of rows (blocks.py)"]),
                    Box("flex", "flex_attention.py", ["flex_attention: a", "score_mod over the tables"]),
                ],
                [
                    Box("cpu", "cpu_inference.py", ["CPU inference: fused,", "bias kernel, distance"]),
                    Box("training", "cpu_training.py", ["CPU training: its", "own backward"]),
                    Box("triton", "triton_attention.py", ["CUDA: the fused", "Triton kernel"]),
                    Box("onnx", "onnx_fused.py", ["ONNX export:", "ORT's attention"]),
                ],
                [
                    Box("native", "native.py", ["the CPU kernels", "of `position_bias.c`"]),
                    Box("workspace", "workspace.py", ["buffers the CPU", "paths reuse"]),
                    Box("tiles", "triton_tiles.py", ["the kernel's tiles", "per GPU"]),
                    Box("check", "kernel_check.py", ["its self-check on", "first use"]),
                ],
            ],
            folder="modeling/",
        ),
    ],
    arrows=[
        ("config", "model", ""),
        ("model", "checks", ""),
        ("model", "attention", "each layer"),
        ("attention", "dispatch", ""),
        ("dispatch", "eager", "eager"),
        ("dispatch", "sdpa", "sdpa"),
        ("dispatch", "flex", "flex_attention"),
        ("sdpa", "cpu", "CPU, inference"),
        ("sdpa", "training", "CPU, training"),
        ("sdpa", "triton", "CUDA"),
        ("sdpa", "onnx", "ONNX export"),
        ("cpu", "native", ""),
        ("training", "native", ""),
        ("cpu", "workspace", ""),
        ("triton", "tiles", ""),
        ("triton", "check", ""),
        ("attention", "decide", ""),  # the layer asks it once per call: said in the page's text, no label
    ],
)

ROOMS = Diagram(
    name="rooms",
    title="The package's rooms: the public surface, one folder per job, the architecture and its conversion",
    parts=[
        Group(
            "src/disentangled/: the public surface",
            [
                [
                    Box("root", "__init__.py, registration.py", ["import disentangled: the Auto classes"]),
                    Box("cli", "cli.py", ["the disentangled command"]),
                    Box("qa", "qa.py", ["answer_question", "on transformers 5"]),
                ]
            ],
            folder="src/disentangled/",
        ),
        Group(
            "src/disentangled/: one folder per job (each one a command of cli.py)",
            [
                [
                    Box("environment", "environment/", ["`gather.py`, `report.py`:", "disentangled env"], "folder"),
                ],
                [
                    Box(
                        "explain",
                        "explain/",
                        ["`explanation.py`: each term", "`terms.py`, `plots.py`"],
                        "folder",
                    ),
                    Box(
                        "serving",
                        "serving/",
                        [
                            "`quantization.py`: int8",
                            "`onnx_export.py`: the graphs",
                            "`onnx_attention.py`: the",
                            "operator's node in a graph",
                            "`ort_operator.py` builds",
                            "`ort_attention.c`, the ONNX",
                            "Runtime operator, which",
                            "includes modeling/'s",
                            "position_bias.h",
                            "`prebuilt.py`: build-kernels",
                        ],
                        "folder",
                    ),
                    Box("demo", "demo/", ["`command.py`, `remote.py`,", "`data.py`"], "folder"),
                ],
                [
                    Box(
                        "pretraining",
                        "pretraining/",
                        [
                            "`objectives.py`: RTD with GDES, MLM",
                            "`data.py`, `command.py`: disentangled pretrain",
                            "`sequence_draws.py`: any number of processes",
                            "`memory.py`: training state per GPU",
                        ],
                        "folder",
                    ),
                    Box(
                        "integrations",
                        "integrations/",
                        [
                            "`acceleration.py`: accelerate,",
                            "restore, enable",
                            "`tokenization.py`: 4.57 and 5",
                            "`sharding.py`: FSDP2 and ZeRO-3",
                        ],
                        "folder",
                    ),
                ],
            ],
            folder="src/disentangled/",
        ),
        Group(
            "the architecture (also the Hub bundle's remote code) and its conversion",
            [
                [
                    Box("configuration", "configuration/", ["DisentangledConfig"], "folder"),
                    Box(
                        "modeling",
                        "modeling/",
                        ["the model, its heads and", "backends (the first picture)"],
                        "folder",
                    ),
                    Box("conversion", "conversion/", ["checkpoints in, verified", "folders out (the third)"], "folder"),
                ]
            ],
        ),
    ],
    arrows=[
        ("pretraining", "modeling", "trains"),
        ("integrations", "modeling", "swaps our attention into transformers' DeBERTa"),
        ("conversion", "modeling", "bundles"),
    ],
)

CONVERSION = Diagram(
    name="conversion",
    title="Conversion: a DeBERTa checkpoint in, a verified folder out, and back",
    parts=[
        Group(
            "conversion/: disentangled convert, push and export-transformers (commands.py)",
            [
                [
                    Box("sources", "sources.py", ["a folder or Hub repo, read", "without running its code"]),
                    Box("export", "export.py", ["a converted folder back to", "transformers' DeBERTa-v2"]),
                ],
                [
                    Box("convert", "convert.py", ["rename every key, load strictly,", "parity against transformers"]),
                    Box("tokenizer", "tokenizer_files.py", ["the tokenizer, checked", "to give the same ids"]),
                ],
                [
                    Box("v1", "deberta_v1.py", ["v1's fused projections"]),
                    Box("heads", "heads.py", ["EMD and RTD heads", "recomputed from the source"]),
                    Box("bundle", "bundle.py", ["the flat remote code and", "auto_map; `model_card.py`"]),
                ],
                [Box("hub", "hub.py", ["disentangled push:", "one upload commit"])],
            ],
            folder="conversion/",
        )
    ],
    arrows=[
        ("sources", "convert", ""),
        ("convert", "v1", "v1 layouts"),
        ("convert", "heads", "EMD, RTD"),
        ("convert", "tokenizer", ""),
        ("convert", "bundle", "writes the folder"),
        ("bundle", "hub", ""),
    ],
)

DIAGRAMS = [CALL, ROOMS, CONVERSION]


def text_width(text: str, size: float) -> float:
    """Estimated width in pixels: monospace runs (in backticks) at 0.6 em a character, the rest at 0.55 em (wide
    enough for DejaVu Sans, the widest of the usual sans-serif faces)."""
    width = 0.0
    for number, run in enumerate(text.split("`")):
        width += len(run) * size * (0.6 if number % 2 else 0.55)
    return width


def boxes(diagram: Diagram) -> list[tuple[str, Box]]:
    """(the folder its path is in, box) for every box, top to bottom."""
    found = []
    for part in diagram.parts:
        folder = part.folder if isinstance(part, Group) else ""
        for row in part.rows if isinstance(part, Group) else [part]:
            found += [(folder, box) for box in row]
    return found


def named_files(diagram: Diagram) -> list[str]:
    """The repository paths a diagram's boxes name: each box's path (in its group's folder), and the files in
    backticks in its lines, which lie in the box's folder (or beside its file)."""
    named = []
    for group_folder, box in boxes(diagram):
        if box.kind == "switch":
            continue
        paths = [group_folder + name for name in box.path.split(", ")]
        named += paths
        folder = paths[0] if paths[0].endswith("/") else paths[0].rsplit("/", 1)[0] + "/" if "/" in paths[0] else ""
        for line in box.lines:
            named += [folder + name for name in re.findall(r"`([\w./-]+\.(?:py|c|json))`", line)]
    return named


@dataclass
class Placed:
    box: Box
    x: float
    y: float
    width: float
    height: float
    row: int


def rows_of(diagram: Diagram) -> dict[str, int]:
    """Each box's row number, counted over the whole picture."""
    numbers, row_number = {}, 0
    for part in diagram.parts:
        for row in part.rows if isinstance(part, Group) else [part]:
            numbers.update({box.key: row_number for box in row})
            row_number += 1
    return numbers


def layout(diagram: Diagram) -> tuple[dict[str, Placed], list[tuple[str, float, float, float, float]], float, float]:
    """Each box's place, each group's frame (title, x, y, width, height), and the picture's width and height. Rows
    that an arrow joins are `GAP_Y` apart (room for its label), others closer; two boxes of a row joined by a
    labelled arrow are as far apart as the label is wide."""
    numbers = rows_of(diagram)
    crossed = {
        row for s, t, _ in diagram.arrows for row in range(min(numbers[s], numbers[t]), max(numbers[s], numbers[t]))
    }
    beside = {
        frozenset((s, t)): text_width(label, LABEL_SIZE) + 18
        for s, t, label in diagram.arrows
        if label and numbers[s] == numbers[t]
    }
    placed, frames = {}, []
    y, row_number, bottom = 4.0, 0, 0.0
    inner = WIDTH - 2 * (GROUP_PAD + 2)
    for part in diagram.parts:
        group = isinstance(part, Group)
        rows = part.rows if group else [part]
        top = y
        if group:
            y += GROUP_TITLE
        for row in rows:
            sizes = []
            for box in row:
                width = max(
                    [text_width(f"`{box.path}`", PATH_SIZE)] + [text_width(line, TEXT_SIZE) for line in box.lines]
                )
                sizes.append((width + 2 * PAD_X, 2 * PAD_Y + LINE * (1 + len(box.lines))))
            gaps = [max(GAP_X, beside.get(frozenset((a.key, b.key)), 0)) for a, b in zip(row, row[1:])]
            total = sum(width for width, _ in sizes) + sum(gaps)
            if total > inner:
                names = ", ".join(box.key for box in row)
                raise ValueError(f"{diagram.name}: the row {names} is {total:.0f} px wide, over {inner}: split it")
            height = max(height for _, height in sizes)
            x = (WIDTH - total) / 2
            for box, (width, box_height), gap in zip(row, sizes, [*gaps, 0]):
                placed[box.key] = Placed(box, x, y + (height - box_height) / 2, width, box_height, row_number)
                x += width + gap
            bottom = y + height
            y = bottom + (GAP_Y if row_number in crossed else GAP_X)
            row_number += 1
        if group:
            bottom += GROUP_PAD
            frames.append((part.title, 2.0, top, WIDTH - 4.0, bottom - top))
            y = bottom + GROUP_GAP
    return placed, frames, WIDTH, bottom + 4


def arrow_points(
    diagram: Diagram, placed: dict[str, Placed]
) -> list[tuple[tuple[float, float], tuple[float, float], str, bool]]:
    """(start, end, label, sideways) per arrow. Arrows leaving one box's bottom (or entering one box's top) are spread
    along that side in the order of their other ends, so that they do not cross there."""
    for source, target, _ in diagram.arrows:
        for key in (source, target):
            if key not in placed:
                raise ValueError(f"{diagram.name}: an arrow names {key!r}, which no box has")
    down = [(s, t, label) for s, t, label in diagram.arrows if placed[s].row != placed[t].row]
    leaving, entering = {}, {}
    for source, target, _ in down:
        leaving.setdefault(source, []).append(target)
        entering.setdefault(target, []).append(source)

    def spread(key: str, others: list[str], other: str) -> float:
        box = placed[key]
        order = sorted(others, key=lambda name: placed[name].x)
        return box.x + box.width * (order.index(other) + 1) / (len(order) + 1)

    points = []
    for source, target, label in diagram.arrows:
        a, b = placed[source], placed[target]
        if a.row == b.row:  # side to side
            left, right = (a, b) if a.x < b.x else (b, a)
            y = max(a.y, b.y) + min(a.height, b.height) / 2
            start, end = (left.x + left.width, y), (right.x, y)
            points.append((start, end, label, True) if left is a else (end, start, label, True))
            continue
        start = (spread(source, leaving[source], target), a.y + a.height if b.row > a.row else a.y)
        end = (spread(target, entering[target], source), b.y if b.row > a.row else b.y + b.height)
        for other in placed.values():  # an arrow past a row must not run through one of its boxes
            if min(a.row, b.row) < other.row < max(a.row, b.row):
                middle = other.y + other.height / 2
                x = start[0] + (end[0] - start[0]) * (middle - start[1]) / (end[1] - start[1])
                if other.x - 6 < x < other.x + other.width + 6:
                    raise ValueError(f"{diagram.name}: the arrow {source} -> {target} runs through {other.box.key}")
        points.append((start, end, label, False))
    return points


def svg(diagram: Diagram) -> str:
    """The picture as an SVG document; its first comment holds the digest of the data it was drawn from."""
    placed, frames, width, height = layout(diagram)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
        f'height="{height:.0f}" role="img" aria-labelledby="title">',
        f"<!-- docs/internals/diagrams.py {digest(diagram)} -->",
        f'<title id="title">{escape(diagram.title)}</title>',
        "<defs><marker id='head' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='7' markerHeight='7' "
        "orient='auto-start-reverse'><path d='M0,0 L10,5 L0,10 z' fill='#555'/></marker></defs>",
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>',
    ]
    for _, x, y, frame_width, frame_height in frames:
        out.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{frame_width:.1f}" height="{frame_height:.1f}" rx="8" '
            'fill="#f4f6fb" stroke="#b8c2d8"/>'
        )
    labels = []  # (label, its rectangle): none may overlap another, nor a box
    for start, end, label, sideways in arrow_points(diagram, placed):
        (x1, y1), (x2, y2) = start, end
        if sideways:
            path = f"M{x1:.1f},{y1:.1f} L{x2:.1f},{y2:.1f}"
        else:
            middle = (y1 + y2) / 2
            path = f"M{x1:.1f},{y1:.1f} C{x1:.1f},{middle:.1f} {x2:.1f},{middle:.1f} {x2:.1f},{y2:.1f}"
        out.append(f'<path d="{path}" fill="none" stroke="#555" stroke-width="1.3" marker-end="url(#head)"/>')
        if label:
            centre, baseline = (x1 + x2) / 2, (y1 + y2) / 2 + (-5 if sideways else 4)
            half = text_width(label, LABEL_SIZE) / 2
            labels.append((label, (centre - half, baseline - LABEL_SIZE, centre + half, baseline + 3)))
            out.append(
                f'<text x="{centre:.1f}" y="{baseline:.1f}" text-anchor="middle" font-family="{SANS}" '
                f'font-size="{LABEL_SIZE}" fill="#333" stroke="#ffffff" stroke-width="4" paint-order="stroke">'
                f"{escape(label)}</text>"
            )
    refuse_overlaps(diagram.name, labels, placed)
    for title, x, y, _, _ in frames:  # over the arrows that enter the frame
        out.append(
            f'<text x="{x + 10:.1f}" y="{y + 17:.1f}" font-family="{SANS}" font-size="{TEXT_SIZE}" '
            f'font-style="italic" fill="#3b4a6b" stroke="#f4f6fb" stroke-width="4" paint-order="stroke">'
            f"{escape(title)}</text>"
        )
    colours = {"file": ("#ffffff", "#4a6fa5"), "folder": ("#fffdf3", "#b08a2e"), "switch": ("#f3f9f1", "#4c8a3f")}
    for place in placed.values():
        fill, stroke = colours[place.box.kind]
        out.append(
            f'<rect x="{place.x:.1f}" y="{place.y:.1f}" width="{place.width:.1f}" height="{place.height:.1f}" '
            f'rx="{12 if place.box.kind == "switch" else 5}" fill="{fill}" stroke="{stroke}" stroke-width="1.4"/>'
        )
        x, y = place.x + PAD_X, place.y + PAD_Y + 13
        out.append(
            f'<text x="{x:.1f}" y="{y:.1f}" font-family="{MONO}" font-size="{PATH_SIZE}" font-weight="bold" '
            f'fill="#1d2b45">{escape(place.box.path)}</text>'
        )
        for line in place.box.lines:
            y += LINE
            runs = []
            for number, run in enumerate(line.split("`")):
                if run:
                    font = MONO if number % 2 else SANS
                    runs.append(f'<tspan font-family="{font}">{escape(run)}</tspan>')
            out.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{TEXT_SIZE}" fill="#333">{"".join(runs)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def refuse_overlaps(name: str, labels: list[tuple[str, tuple]], placed: dict[str, Placed]) -> None:
    """A ValueError where an arrow's label overlaps another label or a box: the text would be unreadable."""

    def overlap(a: tuple, b: tuple) -> bool:
        return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]

    for number, (label, area) in enumerate(labels):
        for other, other_area in labels[number + 1 :]:
            if overlap(area, other_area):
                raise ValueError(f"{name}: the labels {label!r} and {other!r} overlap: move a box or drop a label")
        for box in placed.values():
            if overlap(area, (box.x, box.y, box.x + box.width, box.y + box.height)):
                raise ValueError(f"{name}: the label {label!r} overlaps the box {box.box.key}")


def digest(diagram: Diagram) -> str:
    data = {"diagram": asdict(diagram), "source": Path(__file__).read_text()}  # the data and how it is drawn
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def stale() -> list[str]:
    """The pictures whose file is missing or was drawn from other data or code."""
    return [
        str(FOLDER / f"{diagram.name}.svg")
        for diagram in DIAGRAMS
        if not (FOLDER / f"{diagram.name}.svg").is_file()
        or f"docs/internals/diagrams.py {digest(diagram)}" not in (FOLDER / f"{diagram.name}.svg").read_text()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a picture is missing or stale")
    args = parser.parse_args(argv)
    if args.check:
        names = stale()
        print("stale: " + ", ".join(names) if names else "the pictures match their data")
        return 1 if names else 0
    FOLDER.mkdir(exist_ok=True)
    for diagram in DIAGRAMS:
        (FOLDER / f"{diagram.name}.svg").write_text(svg(diagram))
    print("wrote " + ", ".join(f"{FOLDER.name}/{diagram.name}.svg" for diagram in DIAGRAMS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
