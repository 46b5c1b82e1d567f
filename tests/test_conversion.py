"""Every generation and head: checkpoint -> `disentangled convert` -> loaded as Hub users load it -> same outputs.

The conversions run once per module (through the CLI entry point, in this process). The converted folders are
then loaded by `AutoModelForX.from_pretrained(folder, trust_remote_code=True)` in child processes that cannot
import `disentangled`: on the latest transformers (this interpreter) and on transformers 4.57 (the venv .ci/run
creates), and also here, where the package is imported.
"""

from __future__ import annotations

import io
import json
import os
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import transformers
from conversion_sources import (
    Case,
    hub_deberta_v3_base_case,
    hub_v3_discriminator_cases,
    microsoft_cases,
    transformers_cases,
)
from isolated import PYTHON_4_57, run_isolated, system_python
from safetensors.torch import load_file, save_file
from spm_fixture import train_spm

from disentangled import cli
from disentangled.conversion.bundle import MODELING_FILES, auto_map, bundle_sources, check_bundled_source
from disentangled.conversion.convert import fixed_batch, load_bundled, named_outputs

HERE = Path(__file__).resolve().parent
PACKAGE_ONLY = {"native.py", "kernel_check.py"}  # the compiled CPU kernels and the Triton kernel's self-check
EXTRA_ARGS = {
    "v3-ForSequenceClassification": ("--max-shard-size", "150KB"),  # sharded output with an index
    "mdeberta-ForTokenClassification": ("--dtype", "bfloat16"),
    "v2-ForQuestionAnswering": ("--task", "question-answering"),
}
TOLERANCE = 1e-4  # float32, relative to max(1, max |reference|)
TOLERANCE_BF16 = 5e-2
PACKAGE_TOLERANCE = 1e-5  # the bundle against the package, same weights and dtype: only the paths' rounding differs


def batch_of(case: Case) -> dict:
    return fixed_batch(case.vocab_size, case.reference.config.max_position_embeddings, case.multiple_choice)


def relative_error(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).abs()
    if diff.shape[:2] == mask.shape:
        diff = diff[mask]
    return diff.max().item() / max(1.0, expected.abs().max().item())


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models on a shared machine: one thread is several times faster than oversubscribed cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> list[Case]:
    root = tmp_path_factory.mktemp("conversion")
    spm_model = train_spm(root / "_spm")
    cases = [
        *transformers_cases(root / "sources"),
        hub_deberta_v3_base_case(root / "sources", spm_model),
        *microsoft_cases(root / "sources", spm_model),
        *hub_v3_discriminator_cases(root / "sources"),
    ]
    for case in cases:
        case.output = root / "out" / case.name
        log = io.StringIO()
        with redirect_stdout(log):
            args = (*EXTRA_ARGS.get(case.name, ()), *case.convert_args)
            code = cli.main(["convert", str(case.source), str(case.output), *args])
        case.log = log.getvalue()
        assert code == 0, case.log
        batch = batch_of(case)
        case.inputs = root / "inputs" / f"{case.name}.safetensors"
        case.inputs.parent.mkdir(exist_ok=True)
        save_file(batch, case.inputs)
        with torch.no_grad():
            case.expected = named_outputs(case.reference(**batch))
    return cases


def check_outputs(cases: list[Case], outputs: dict[str, torch.Tensor]) -> dict[str, float]:
    errors = {}
    for case in cases:
        batch = load_file(case.inputs)
        mask = batch["attention_mask"].reshape(-1, batch["attention_mask"].shape[-1]).bool()
        for name, expected in case.expected.items():
            errors[f"{case.name}/{name}"] = relative_error(outputs[f"{case.name}/{name}"], expected, mask)
    bad = {
        key: error
        for key, error in errors.items()
        if error > (TOLERANCE_BF16 if "bfloat16" in EXTRA_ARGS.get(key.split("/")[0], ()) else TOLERANCE)
    }
    assert not bad, bad
    return errors


def load_in_child(python, cases: list[Case], tmp_path: Path) -> tuple[dict, dict]:
    manifest = [
        {
            "name": case.name,
            "folder": str(case.output),
            "auto_class": case.auto_class,
            "inputs": str(case.inputs),
            "text": "Paris is the capital of France." if case.tokenizer else None,
        }
        for case in cases
    ]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    result = run_isolated(
        python,
        HERE / "load_converted.py",
        [str(tmp_path / "manifest.json"), str(tmp_path / "outputs.safetensors")],
        env={
            "HF_MODULES_CACHE": str(tmp_path / "modules"),
            "HF_HUB_OFFLINE": "1",
            "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": "1",
        },
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.rsplit("REPORT ", 1)[1].splitlines()[0])
    return load_file(tmp_path / "outputs.safetensors"), report | {"stdout": result.stdout, "stderr": result.stderr}


def check_the_log(report: dict) -> None:
    """The bundled models (a dozen in one process) said once which paths they lack and how to get them
    (`dispatch.without_the_package`, through transformers' logger)."""
    said = [line for line in report["stderr"].splitlines() if "without the disentangled package" in line]
    assert len(said) == 1, report["stderr"][-2000:]
    for words in ("cpu-fused", "cpu-bias-kernel", "cpu-training-kernel", "triton", "pip install disentangled"):
        assert words in said[0], said[0]


def test_every_conversion_printed_parity_within_tolerance(converted):
    for case in converted:
        figures = re.findall(r"(\w+): max \|diff\| ([0-9.e+-]+) \(tolerance ([0-9.e+-]+)\)", case.log)
        assert figures, case.log
        assert all(float(diff) <= float(tol) for _, diff, tol in figures), case.log
        files = {path.name for path in case.output.iterdir()}
        assert {"config.json", "README.md", *bundle_sources()} <= files and not PACKAGE_ONLY & files, files
        config = json.loads((case.output / "config.json").read_text())
        assert config["model_type"] == "disentangled" and config["auto_map"] == auto_map()
        assert config["architectures"][0].startswith("Disentangled")


def test_outputs_and_shards(converted):
    sharded = next(case for case in converted if case.name == "v3-ForSequenceClassification")
    assert (sharded.output / "model.safetensors.index.json").is_file()
    bf16 = next(case for case in converted if case.name == "mdeberta-ForTokenClassification")
    assert next(iter(load_file(bf16.output / "model.safetensors").values())).dtype == torch.bfloat16
    assert not list(sharded.output.parent.glob(".*")), "a staging folder was left behind"


@pytest.fixture(scope="module")
def latest_child(converted, tmp_path_factory):
    return load_in_child(system_python(), converted, tmp_path_factory.mktemp("latest"))


@pytest.fixture(scope="module")
def child_4_57(converted, tmp_path_factory):
    if not PYTHON_4_57.exists():
        pytest.skip(f"no transformers 4.57 environment at {PYTHON_4_57} (.ci/run creates it)")
    return load_in_child(PYTHON_4_57, converted, tmp_path_factory.mktemp("v457"))


def test_bundle_loads_without_the_package_on_latest_transformers(converted, latest_child):
    outputs, report = latest_child
    assert report["transformers"] == transformers.__version__
    errors = check_outputs(converted, outputs)
    print(f"transformers {report['transformers']}: worst relative error {max(errors.values()):.2e}")
    for case in converted:
        assert report["cases"][case.name]["module"].startswith("transformers_modules."), report["cases"][case.name]
    check_the_log(report)


def test_the_bundle_computes_what_the_package_computes(converted, latest_child):
    """The bundle's PyTorch paths against the package's (its compiled CPU kernels, where they run here) on the same
    folders and batches: the package's model, loaded from the registered classes, and the child's outputs."""
    outputs, _ = latest_child
    errors = {}
    for case in converted:
        batch = load_file(case.inputs)
        mask = batch["attention_mask"].reshape(-1, batch["attention_mask"].shape[-1]).bool()
        model = getattr(transformers, case.auto_class).from_pretrained(case.output).eval()
        assert type(model).__module__.startswith("disentangled."), type(model).__module__
        with torch.no_grad():
            for name, value in named_outputs(model(**batch)).items():
                errors[f"{case.name}/{name}"] = relative_error(outputs[f"{case.name}/{name}"], value, mask)
    print(f"the bundle against the package: worst relative error {max(errors.values()):.2e}")
    assert max(errors.values()) <= PACKAGE_TOLERANCE, errors


def test_bundle_loads_without_the_package_on_transformers_4_57(converted, child_4_57):
    outputs, report = child_4_57
    assert report["transformers"].startswith("4.57."), report["transformers"]
    errors = check_outputs(converted, outputs)
    print(f"transformers {report['transformers']}: worst relative error {max(errors.values()):.2e}")
    assert "newly initialized" not in report["stdout"]
    check_the_log(report)


def source_ids(case: Case) -> list[int]:
    from disentangled.conversion.sources import read_source
    from disentangled.conversion.tokenizer_files import source_tokenizer

    return source_tokenizer(read_source(str(case.source)), "deberta-v2")("Paris is the capital of France.")["input_ids"]


def test_tokenizer_of_hub_layout_sources_gives_the_source_ids(converted, latest_child):
    """spm.model (+ tokenizer_config.json), no tokenizer.json: plain AutoTokenizer, no trust_remote_code."""
    _, report = latest_child
    with_tokenizer = [case for case in converted if case.tokenizer]
    assert {case.name for case in with_tokenizer} == {"hub-v3-base", "ms-v3-mlm"}
    for case in with_tokenizer:
        config = json.loads((case.output / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] == "DebertaV2Tokenizer"
        assert report["cases"][case.name]["ids"] == source_ids(case)
        assert report["cases"][case.name]["ids_declined"] == source_ids(case)
        between = report["stdout"].split(f"TOKENIZER {case.name} BEGIN")[1].split(f"TOKENIZER {case.name} END")[0]
        assert "custom code" not in between, between  # trust_remote_code=False: no prompt, no model code


def test_tokenizer_on_transformers_4_57_same_ids_and_no_prompt(converted, child_4_57):
    """transformers 4.57 reads tokenizer_config.json's tokenizer_class first: no prompt even without the argument."""
    _, report = child_4_57
    assert "Do you wish to run the custom code" not in report["stdout"]
    for case in (case for case in converted if case.tokenizer):
        assert report["cases"][case.name]["tokenizer"].startswith("DebertaV2Tokenizer")
        assert report["cases"][case.name]["ids"] == source_ids(case)


def test_bundle_loads_where_the_package_is_imported(converted):
    """No registration clash: Auto classes and the folder's own remote code both load here, same outputs."""
    for case in converted[::4]:
        batch = load_file(case.inputs)
        mask = batch["attention_mask"].reshape(-1, batch["attention_mask"].shape[-1]).bool()
        auto = getattr(transformers, case.auto_class).from_pretrained(case.output, trust_remote_code=True).eval()
        class_name = json.loads((case.output / "config.json").read_text())["architectures"][0]
        bundled = load_bundled(case.output, class_name)
        assert type(bundled).__module__.startswith("transformers_modules.")
        with torch.no_grad():
            for model in (auto, bundled):
                outputs = named_outputs(model(**batch))
                for name, expected in case.expected.items():
                    limit = TOLERANCE_BF16 if case.name in EXTRA_ARGS and "--dtype" in EXTRA_ARGS[case.name] else 1e-4
                    assert relative_error(outputs[name], expected, mask) <= limit, (case.name, name)


def test_model_card_metadata(converted):
    from huggingface_hub import ModelCard

    hub = next(case for case in converted if case.name == "hub-v3-base")
    card = ModelCard.load(hub.output / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "fill-mask"
    assert {"custom_code", "deberta", "disentangled-attention"} <= set(card.data.tags)
    assert "trust_remote_code=True" in card.text and "| `logits` |" in card.text
    qa = next(case for case in converted if case.name == "v2-ForQuestionAnswering")
    assert ModelCard.load(qa.output / "README.md").data.pipeline_tag == "question-answering"


def test_the_bundle_is_generated_from_the_package():
    """The bundle is the files that run there: every modeling file but the package's own (native.py's C source does
    not travel; kernel_check.py writes under ~/.cache), which the bundled files import only guarded."""
    sources = bundle_sources()
    package = Path(__import__("disentangled.modeling", fromlist=["x"]).__file__).parent
    modeling = {path.name for path in package.glob("*.py") if path.name != "__init__.py"}
    assert set(sources) == {"configuration_disentangled.py", *MODELING_FILES}
    assert modeling - set(MODELING_FILES) == PACKAGE_ONLY and set(MODELING_FILES) <= modeling
    for text in sources.values():
        assert "from ..configuration" not in text and "import disentangled" not in text
    with pytest.raises(ValueError, match="imports the package"):
        check_bundled_source("x.py", "import disentangled.modeling\n", {"x.py"})
    with pytest.raises(ValueError, match="relative import"):
        check_bundled_source("x.py", "from ..configuration import DisentangledConfig\n", {"x.py"})
    with pytest.raises(ValueError, match="not a bundled file"):
        check_bundled_source("x.py", "from .missing import thing\n", {"x.py"})
    guarded = "try:\n    from . import missing\nexcept ImportError:\n    missing = None\n"
    check_bundled_source("x.py", guarded, {"x.py"})  # a sibling the bundle leaves out: transformers does not fetch it
    with pytest.raises(ValueError, match="outside try/except ImportError"):
        check_bundled_source("x.py", "from . import missing\n", {"x.py"})
    with pytest.raises(ValueError, match="not a bundled file"):  # transformers fetches each `from .name import`
        check_bundled_source("x.py", guarded.replace("from . import missing", "from .missing import x"), {"x.py"})


def test_model_card_template_ships_with_the_package():
    from importlib import resources

    text = (resources.files("disentangled") / "model_card.md").read_text()
    assert text == (HERE.parent / "model_card.md").read_text()
    assert os.path.islink(HERE.parent / "src" / "disentangled" / "model_card.md")


EXPORTED = [
    "v1-ForMaskedLM",
    "v1-ForQuestionAnswering",
    "v2-Model",
    "v3-ForMultipleChoice",
    "mdeberta-ForSequenceClassification",
    "mdeberta-ForTokenClassification",  # bfloat16 weights stay bfloat16
    "hub-v3-base",  # legacy=False MLM head
    "ms-v2-base",
]


def test_export_transformers_round_trip(converted, tmp_path):
    """Converted folder -> transformers' DeBERTa-v2 format -> transformers' own classes give the source's outputs."""
    for case in (case for case in converted if case.name in EXPORTED):
        hf_dir = tmp_path / case.name
        log = io.StringIO()
        with redirect_stdout(log):
            assert cli.main(["export-transformers", str(case.output), str(hf_dir)]) == 0
        assert "parity" in log.getvalue()
        config = json.loads((hf_dir / "config.json").read_text())
        assert config["model_type"] == "deberta-v2" and "auto_map" not in config
        assert not list(hf_dir.glob("*.py"))
        native = getattr(transformers, case.auto_class).from_pretrained(hf_dir, dtype=torch.float32).eval()
        assert type(native).__module__.startswith("transformers.models.deberta_v2."), type(native)
        batch = load_file(case.inputs)
        mask = batch["attention_mask"].reshape(-1, batch["attention_mask"].shape[-1]).bool()
        limit = TOLERANCE_BF16 if "--dtype" in EXTRA_ARGS.get(case.name, ()) else TOLERANCE
        with torch.no_grad():
            outputs = named_outputs(native(**batch))
        for name, expected in case.expected.items():
            assert relative_error(outputs[name], expected, mask) <= limit, (case.name, name)


def test_pretraining_heads_convert_with_what_they_use(converted):
    """Microsoft MLM sources and generators get the decoder and their table; RTD sources keep `mask_predictions`;
    the GDES delta and unused tables are listed as not needed; transformers' own MLM layout stays as it was."""
    by_name = {case.name: case for case in converted}
    for name in ("ms-v1-mlm", "ms-v3-mlm", "hub-v3-emd", "hub-v3-generator"):
        config = json.loads((by_name[name].output / "config.json").read_text())
        weights = load_file(by_name[name].output / "model.safetensors")
        assert config["enhanced_mask_decoder"] is True and config["legacy"] is False, name
        assert "deberta.embeddings.position_embeddings.weight" in weights, name
        assert "Enhanced Mask Decoder" in by_name[name].log and "logits" in by_name[name].log, name
    for name in ("ms-v3-rtd", "hub-v3-rtd"):
        config = json.loads((by_name[name].output / "config.json").read_text())
        weights = load_file(by_name[name].output / "model.safetensors")
        assert config["architectures"] == ["DisentangledForReplacedTokenDetection"], name
        assert {f"mask_predictions.{p}" for p in ("dense.weight", "LayerNorm.bias", "classifier.weight")} <= set(
            weights
        ), name
        assert "position_embeddings" not in " ".join(weights), name  # v3 reads no absolute table
    for name in ("hub-v3-rtd", "hub-v3-emd"):
        assert "not needed" in by_name[name].log and "word_embeddings._weight" in by_name[name].log
    assert "not converted (unused by the replaced-token-detection head)" in by_name["hub-v3-rtd"].log
    assert "lm_predictions.lm_head" in by_name["hub-v3-rtd"].log
    assert "generator" in by_name["hub-v3-generator"].log
    plain = json.loads((by_name["hub-v3-base"].output / "config.json").read_text())
    assert plain["enhanced_mask_decoder"] is False  # a transformers source converts as transformers reads it


def test_export_transformers_refuses_the_decoder_and_rtd_or_exports_the_encoder(converted, tmp_path, capsys):
    for case in (case for case in converted if case.name in ("ms-v1-mlm", "ms-v3-rtd", "hub-v3-emd")):
        hf_dir = tmp_path / case.name
        with redirect_stdout(io.StringIO()):
            assert cli.main(["export-transformers", str(case.output), str(hf_dir)]) != 0
        error = capsys.readouterr().err
        assert "--task base" in error and ("Enhanced Mask Decoder" in error or "replaced-token-detection" in error)
        assert not hf_dir.exists() and not list(tmp_path.glob(f".{case.name}.*"))
        with redirect_stdout(io.StringIO()):
            assert cli.main(["export-transformers", str(case.output), str(hf_dir), "--task", "base"]) == 0
        native = transformers.AutoModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
        assert type(native).__name__ == "DebertaV2Model"
        batch = load_file(case.inputs)
        with torch.no_grad():
            expected = case.reference.base(**batch).last_hidden_state
            actual = native(**batch).last_hidden_state
        assert relative_error(actual, expected, batch["attention_mask"].bool()) <= TOLERANCE, case.name


def test_wheel_ships_the_model_card_template(tmp_path):
    """A non-editable install finds model_card.md too: the wheel holds its text, not a dangling link; and the C
    sources compiled on first use."""
    import subprocess
    import sys
    import zipfile

    root = HERE.parent
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    if result.returncode != 0 and "license" in result.stderr:
        pytest.skip("this setuptools cannot build the project (PEP 639 license string)")
    assert result.returncode == 0, result.stderr[-2000:]
    with zipfile.ZipFile(next(tmp_path.glob("*.whl"))) as wheel:
        assert wheel.read("disentangled/model_card.md").decode() == (root / "model_card.md").read_text()
        names = set(wheel.namelist())
    assert {"disentangled/modeling/modeling_disentangled.py", "disentangled/conversion/bundle.py"} <= names
    # the C sources the package compiles at run time: the CPU kernels and ONNX Runtime's operator around them
    from disentangled.modeling import native

    kernels = [native.SOURCE.name, *(header.name for header in native.HEADERS)]
    assert len(kernels) >= 6 and {f"disentangled/modeling/{name}" for name in kernels} <= names
    assert {"disentangled/serving/ort_attention.c", "disentangled/serving/ort_dispatch.c"} <= names


def test_microsoft_mlm_without_a_table_converts_without_the_decoder(converted, tmp_path):
    """Older releases of Microsoft's package kept no absolute table: the plain head, and the log says why."""
    from disentangled.conversion.convert import canonical_checkpoint
    from disentangled.conversion.sources import read_source

    case = next(case for case in converted if case.name == "ms-v3-mlm")
    state_dict = torch.load(case.source / "pytorch_model.bin", weights_only=True)
    del state_dict["deberta.embeddings.position_embeddings.weight"]
    folder = tmp_path / "no-table"
    folder.mkdir()
    torch.save(state_dict, folder / "pytorch_model.bin")
    (folder / "config.json").write_bytes((case.source / "config.json").read_bytes())
    checkpoint = canonical_checkpoint(read_source(str(folder)))
    assert checkpoint.task == "masked-lm" and not checkpoint.enhanced_mask_decoder
    assert any("without the Enhanced Mask Decoder" in note for note in checkpoint.notes)
    with pytest.raises(ValueError, match="position_embeddings.weight"):
        canonical_checkpoint(read_source(str(folder)), enhanced_mask_decoder=True)
