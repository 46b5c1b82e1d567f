"""`python -m benchmarks.accelerate` runs on a tiny model and writes a well-formed record; the report makes
docs/libraries.md's table from a record; the page's library blocks run on tiny local models saved under the names
they load.

No timing is asserted: the page's figures come from recorded runs of the benchmark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from deberta_shapes import V3_COMMON
from test_documented_commands import read_blocks
from tiny_models import TINY_SIZES, spm_model

from benchmarks import accelerate, report
from benchmarks.records import append_record, read_records
from disentangled.integrations.tokenization import SPM_TOKENIZER_CONFIG

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "libraries.md"
THIS = "tests/test_benchmark_accelerate.py::test_libraries_page_blocks_run"
IN_CI = bool(os.environ.get("CI"))  # .ci/run installs the libraries and the transformers 4.57 venv: missing one fails


def unavailable(reason: str) -> None:
    (pytest.fail if IN_CI else pytest.skip)(reason)


@pytest.fixture
def verbosity():
    """main() quiets transformers' logging, as a command does; put it back for the next test."""
    level = transformers.logging.get_verbosity()
    yield
    transformers.logging.set_verbosity(level)


def test_quick_run_writes_a_record(tmp_path, capsys, verbosity):
    cases = ["gliner-1x48", "gliner2-2x48", "crossencoder-2x48"]
    accelerate.main(["--quick", "--cases", *cases, "--records", str(tmp_path)])
    printed = capsys.readouterr().out
    (record,) = read_records("accelerate", tmp_path)
    figures = record["figures"]
    assert {key: figures[key] for key in ("device", "dtype", "layers", "quick", "repeats")} == {
        "device": "cpu",
        "dtype": "float32",
        "layers": 2,
        "quick": True,
        "repeats": 1,
    }
    assert record["command"] == "python -m benchmarks.accelerate --quick --cases " + " ".join(
        cases
    ) + " --records " + str(tmp_path)
    ran = {case["case"] for case in figures["cases"]}
    assert {case["library"] for case in figures["cases"]} | set(figures["skipped"]) == {c.split("-")[0] for c in cases}
    assert ran == {c.replace("-", " ") for c in cases if c.split("-")[0] not in figures["skipped"]}
    assert "crossencoder 2x48" in ran  # sentence-transformers is a dev dependency: never skipped
    for case in figures["cases"]:
        assert case["library"] in accelerate.LIBRARIES and (case["batch"], case["tokens"]) in ((1, 48), (2, 48))
        assert case["encoder_input"][0] == case["batch"] and case["encoder_input"][1] > 0
        assert set(case["times"]) == {"transformers", "accelerated"} and all(
            len(t) == 1 for t in case["times"].values()
        )
        assert case["speedup"] == pytest.approx(case["median"]["transformers"] / case["median"]["accelerated"])
        assert case["target"] is None  # no targets for the tiny model
        assert case["max_abs_diff"] < 1e-4  # the accelerated encoder computed the same at the real tokens
        assert case["versions"]["torch"] == torch.__version__ and case["versions"]["transformers"]
        assert f"| {case['case']} | {case['batch']}x{case['encoder_input'][1]} |" in printed
    gliner = [case for case in figures["cases"] if case["library"] == "gliner"]
    if gliner:  # run in the transformers 4.57 environment
        assert gliner[0]["versions"]["transformers"].startswith("4.57.") and "gliner" in gliner[0]["versions"]
    elif IN_CI:
        pytest.fail(f"gliner was skipped: {figures['skipped']}")
    page = accelerate.markdown(record)
    assert "tiny (--quick) shape, 2 layers" in page and "| crossencoder 2x48 | 2x" in page


def test_cases_and_targets():
    with pytest.raises(SystemExit, match="gliner-3x3: not among"):
        accelerate.main(["--quick", "--cases", "gliner-3x3", "--no-record"])
    assert accelerate.target_for("gliner", 2048, "cpu", "float32", quick=False) == 3.0
    assert accelerate.target_for("crossencoder", 512, "cpu", "float32", quick=False) == 1.5
    assert accelerate.target_for("gliner", 128, "cpu", "float32", quick=False) == 1.0
    assert accelerate.target_for("gliner", 2048, "cpu", "bfloat16", quick=False) is None
    assert accelerate.target_for("gliner", 2048, "cuda", "float32", quick=False) is None


def synthetic_case(library: str, batch: int, tokens: int, plain: float, fast: float) -> dict:
    return {
        "case": f"{library} {batch}x{tokens}",
        "library": library,
        "batch": batch,
        "tokens": tokens,
        "encoder_input": [batch, tokens],
        "times": {"transformers": [plain], "accelerated": [fast]},
        "median": {"transformers": plain, "accelerated": fast},
        "speedup": plain / fast,
        "target": accelerate.TARGETS.get(tokens),
        "max_abs_diff": 1e-6,
        "versions": {"python": "3.11.7", "torch": "2.13.0", "transformers": "4.57.6", "gliner": "0.2.29"},
    }


def test_report_renders_the_table_from_a_record(tmp_path):
    """One table per library and machine, a column per (dtype, layers), each cell from the newest record of that
    case; a case under its target says so, a slower one says "slower" in the cell and in a line under the table."""
    figures = {
        "device": "cpu",
        "dtype": "float32",
        "layers": 12,
        "quick": False,
        "repeats": 3,
        "cases": [synthetic_case("gliner", 8, 2048, 12.0, 3.0), synthetic_case("gliner", 1, 512, 1.0, 0.8)],
        "skipped": {"gliner2": "gliner2 is not installed"},
    }
    append_record("accelerate", figures, command=["python", "-m", "benchmarks.accelerate"], folder=tmp_path)
    append_record("accelerate", figures | {"quick": True}, command=["quick"], folder=tmp_path)  # not on the page
    two_layer_cases = [synthetic_case("crossencoder", 1, 128, 0.1, 0.2), synthetic_case("gliner", 1, 512, 1.0, 0.8)]
    two_layers = figures | {"layers": 2, "cases": two_layer_cases}
    append_record("accelerate", two_layers, command=["two", "layers"], folder=tmp_path)  # a column of its own
    newer = figures | {"cases": [synthetic_case("gliner", 1, 512, 1.0, 0.5)], "repeats": 5}
    append_record("accelerate", newer, command=["newer"], folder=tmp_path)  # replaces one case of the first
    texts, _ = report.generate(tmp_path)
    page = texts[Path("docs/libraries.md")]
    section = page.split(report.BEGIN.format(name="libraries"))[1].split(report.END)[0]
    gliner, crossencoder = section.split("### Speed of GLiNER\n")[1].split("### Speed of sentence-transformers")
    assert "| input | float32, 12 layers | float32, 2 layers |\n" in gliner
    assert "| 1x512 | 2.00x (1.000 s / 0.500 s) | 1.25x (1.000 s / 0.800 s) |" in gliner  # no target at 2 layers
    assert "2 layers against 12, float32: a lower speed-up at 1x512 (1.25x against 2.00x)." in gliner
    assert "| 8x2048 | 4.00x (12.000 s / 3.000 s) | - |" in gliner and "under" not in gliner
    assert "gliner 0.2.29" in gliner and "transformers 4.57.6" in gliner and "Faster accelerated than not" in gliner
    assert "`python -m benchmarks.accelerate`" in gliner and "`newer`" in gliner and "`quick`" not in section
    assert "| input | float32, 2 layers |" in crossencoder
    assert "| 1x128 | **0.50x, slower** (0.100 s / 0.200 s) |" in crossencoder
    assert "Slower accelerated than not: 1x128 in float32 with 2 layers (0.50x)." in crossencoder
    assert "Not run in some records: gliner2 (gliner2 is not installed)." in section
    under = dict(synthetic_case("gliner", 1, 512, 1.0, 0.8))
    assert accelerate.cell(under) == "1.25x, under 1.5x (1.000 s / 0.800 s)"
    assert accelerate.cell(under, targeted=False) == "1.25x (1.000 s / 0.800 s)"  # a depth the targets are not for
    assert accelerate.section([]) == "No record yet: `python -m benchmarks.accelerate` writes one."


# ---------------------------------------------------------------------------------------------------------------
# The page's blocks that load Hub models: tiny local models saved under those names, each block in a fresh process

TINY = dict(V3_COMMON, **TINY_SIZES, position_buckets=32)  # deberta-v3's attention fields at a tiny size
GLINER_SCRIPT = """
import sys
from gliner import GLiNER, GLiNERConfig
import torch
torch.manual_seed(0)
config = GLiNERConfig(model_name=sys.argv[1], max_width=4, hidden_size=32, max_len=64)
GLiNER.from_config(config, backbone_from_pretrained=True, local_files_only=True).save_pretrained(sys.argv[2])
"""


def save_deberta(folder: Path, class_name: str, seed: int, **config) -> Path:
    torch.manual_seed(seed)
    tokenizer_files = {"spm.model": spm_model().read_bytes(), "tokenizer_config.json": SPM_TOKENIZER_CONFIG}
    model_config = transformers.DebertaV2Config(**TINY, vocab_size=200, **config)
    getattr(transformers, class_name)(model_config).save_pretrained(folder)
    (folder / "spm.model").write_bytes(tokenizer_files["spm.model"])
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_files["tokenizer_config.json"]))
    return folder


def labels(names: list[str]) -> dict:
    return {"id2label": dict(enumerate(names)), "label2id": {name: index for index, name in enumerate(names)}}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The Hub names the page loads, as tiny local folders (GLiNER's is made by the test that needs it)."""
    work = tmp_path_factory.mktemp("libraries")
    backbone = save_deberta(work / "microsoft" / "deberta-v3-base", "DebertaV2Model", 0)
    save_deberta(work / "mixedbread-ai" / "mxbai-rerank-base-v1", "DebertaV2ForSequenceClassification", 1, num_labels=1)
    nli = labels(["entailment", "not_entailment"])
    save_deberta(
        work / "MoritzLaurer" / "deberta-v3-base-zeroshot-v2.0", "DebertaV2ForSequenceClassification", 2, **nli
    )
    ner = labels(["O", "B-PER", "I-PER", "B-LOC", "I-LOC"])
    save_deberta(work / "deberta-v3-base-ner", "DebertaV2ForTokenClassification", 3, **ner)
    try:
        from gliner2 import ExtractorConfig, GLiNER2
    except ImportError:
        pass
    else:
        torch.manual_seed(4)
        GLiNER2(ExtractorConfig(model_name=str(backbone), max_width=4)).save_pretrained(
            work / "fastino" / "gliner2-base-v1"
        )
    return work


def covered_blocks() -> list:
    blocks = [block for block in read_blocks(PAGE) if block.kind == "covered" and block.detail.startswith(THIS)]
    return [pytest.param(block, id=f"{block.page}:{block.line}") for block in blocks]


def test_the_page_blocks_are_all_found():
    """Five library blocks are covered here; the rest of the page's command blocks are run or covered elsewhere."""
    assert len(covered_blocks()) == 5
    assert {block.kind for block in read_blocks(PAGE) if block.language in ("python", "bash")} == {"run", "covered"}


@pytest.mark.parametrize("block", covered_blocks())
def test_libraries_page_blocks_run(block, workspace, tmp_path):
    python = sys.executable
    if "from gliner import" in block.code:
        python = str(accelerate.VENV_PYTHON)
        if not accelerate.has_library(python, "gliner"):
            unavailable(f"gliner is not installed in {python} (.ci/run makes that environment)")
        gliner = workspace / "urchade" / "gliner_medium-v2.1"
        if not gliner.exists():
            built = subprocess.run(
                [python, "-c", GLINER_SCRIPT, str(workspace / "microsoft" / "deberta-v3-base"), str(gliner)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert built.returncode == 0, built.stderr[-3000:]
    elif "from gliner2 import" in block.code and not (workspace / "fastino" / "gliner2-base-v1").exists():
        unavailable("gliner2 is not installed (the dev extra installs it)")
    script = tmp_path / "block.py"
    script.write_text(block.code)
    done = subprocess.run(
        [python, str(script)],
        cwd=workspace,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.strip(), "the block printed nothing"
