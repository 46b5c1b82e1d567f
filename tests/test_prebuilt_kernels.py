"""The CPU kernels without a compiler (`disentangled build-kernels`, `modeling/native.py`): a folder of prebuilt
libraries serves a process that has no C compiler on PATH, no CC and an empty cache, with the compiled path and the
PyTorch path's outputs; `disentangled env` names the library and where it came from; a library of another version of
the kernels is refused with both versions named, never run. The folder holds only the library this processor's
set needs (the whole command, every set and the operator library, runs in tests/test_wheel.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disentangled import cli
from disentangled.modeling import native
from disentangled.serving import prebuilt

TESTS = Path(__file__).resolve().parent
CHOSEN = native.instruction_set()[0]
RUNS = [name for name in native._processor_sets()[0] if name != "none"]  # every set this processor runs, best first

pytestmark = pytest.mark.skipif(
    CHOSEN == "none" or native._compiler() is None,
    reason="no vector set or no compiler here to build the folder with",
)

# In a process without a compiler: the path `env` reports for a float32 inference call, the library and its origin,
# and a tiny model (64 dimensions per head, padded) with the kernels against the PyTorch path and eager.
SCRIPT = """
import json, shutil, sys
import torch
sys.path.insert(0, sys.argv[1])
from parity import inflate_weights, max_abs_diff, padded_batch
import disentangled
from disentangled import environment
from disentangled.modeling import native

calls = []
for name in ("attend", "position_bias"):
    kernel = getattr(native, name)
    setattr(native, name, lambda *args, kernel=kernel, name=name: calls.append(name) or kernel(*args))
config = disentangled.DisentangledConfig(vocab_size=100, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=96, position_buckets=32, max_relative_positions=128)
torch.manual_seed(0)
model = disentangled.DisentangledModel(config)
inflate_weights(model)
model.eval().set_attn_implementation("sdpa")
batch = padded_batch(100, [200, 150])
with torch.no_grad():
    kernel = model(**batch).last_hidden_state
    ran = sorted(set(calls))
    with native.turned_off():
        pytorch = model(**batch).last_hidden_state
    model.set_attn_implementation("eager")
    eager = model(**batch).last_hidden_state
mask = batch["attention_mask"]
(row,) = [row for row in environment.paths([{"device": "cpu"}]) if (row["dtype"], row["mode"]) == ("float32", "inference")]
print(json.dumps({
    "compilers": [name for name in ("cc", "gcc", "clang") if shutil.which(name)],
    "native": environment.native(),
    "path": row["path"],
    "ran": ran,
    "scale": max(1.0, eager.abs().max().item()),
    "against_pytorch": max_abs_diff(kernel, pytorch, mask),
    "against_eager": max_abs_diff(kernel, eager, mask),
}))
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The libraries of the sets this processor runs (PyTorch's kernels only), as `disentangled build-kernels` writes
    them."""
    built = tmp_path_factory.mktemp("kernels")
    prebuilt.write(built, [native.machine_kind()], RUNS, onnxruntime=False)
    return built


def without_a_compiler(tmp_path: Path, **environment: str) -> dict:
    """The environment of a machine without a compiler: PATH an empty folder, no CC, an empty cache."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "cache").mkdir(exist_ok=True)
    env = {name: value for name, value in os.environ.items() if name not in ("CC", native.KERNELS)}
    return env | {"PATH": str(tmp_path / "bin"), "DISENTANGLED_CACHE": str(tmp_path / "cache")} | environment


def test_the_folder_holds_the_library_and_says_what_it_is(folder):
    library = folder / native.prebuilt_name(native.machine_kind(), CHOSEN, native.kernels_version())
    assert library.is_file()
    described = json.loads((folder / prebuilt.SIDECAR).read_text())
    assert described["version"] == native.kernels_version()
    entry = described["libraries"][library.name]
    assert entry["instruction_set"] == CHOSEN and entry["machine"] == native.machine_kind()
    assert "-march" not in entry["flags"] and described["use"] == f"{native.KERNELS}={folder.resolve()}"
    if shutil.which("readelf"):  # what it needs: the C library (libm) and OpenMP's runtime, nothing of this machine
        dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
        needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic))
        assert needed and needed <= {"libc.so.6", "libm.so.6", "libgomp.so.1"}, needed


@pytest.mark.parametrize("name", RUNS)
def test_without_a_compiler_the_prebuilt_library_runs_the_compiled_path(folder, tmp_path, name):
    """The subprocess finds no compiler and compiles nothing (its cache stays empty), yet the report gives the fused
    path, the kernels run, and the outputs are the PyTorch path's and eager's within 1e-5; `disentangled env` names
    the library and DISENTANGLED_KERNELS. Each set the processor runs (a lower one chosen by DISENTANGLED_CPU_ISA, as
    on a processor without the higher)."""
    env = without_a_compiler(tmp_path, **{native.KERNELS: str(folder), "DISENTANGLED_CPU_ISA": name})
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(TESTS)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["compilers"] == [] and not any((tmp_path / "cache").iterdir())
    library = folder / native.prebuilt_name(native.machine_kind(), name, native.kernels_version())
    assert found["native"]["built"] and found["native"]["library"] == str(library)
    assert found["native"]["library_from"] == native.KERNELS
    assert found["path"] in ("cpu-fused", "cpu-bias-kernel") and found["ran"] in (["attend"], ["position_bias"])
    assert found["against_pytorch"] <= 1e-5 * found["scale"] and found["against_eager"] <= 1e-5 * found["scale"]
    report = subprocess.run(
        [sys.executable, "-m", "disentangled", "env"], env=env, capture_output=True, text=True, timeout=300
    )
    assert report.returncode == 0, report.stderr[-2000:]
    assert f"- library ({native.KERNELS}): {library}" in report.stdout


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """This process as one without a compiler (PATH empty, no CC), with the kernels' state of its own."""
    monkeypatch.setattr(native, "_state", {})
    for name, value in without_a_compiler(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv(native.KERNELS, raising=False)
    assert native._compiler() is None


def test_a_wheel_s_prebuilt_folder_serves_where_no_compiler_is(fresh, monkeypatch, folder, tmp_path):
    """Without DISENTANGLED_KERNELS, the package's own prebuilt folder (a wheel's) is loaded; without one either,
    the PyTorch path runs and the reason says what would serve."""
    monkeypatch.setattr(native, "PREBUILT", folder)
    assert native.available(), native.why_unavailable()
    assert native.loaded_library() == (folder / native.prebuilt_name(native.machine_kind(), CHOSEN,
                                                                       native.kernels_version()), "the wheel")  # fmt: skip
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "PREBUILT", tmp_path / "absent")
    assert not native.available() and native.loaded_library() is None
    assert "no C compiler" in native.why_unavailable() and native.KERNELS in native.why_unavailable()


def test_a_library_of_another_version_is_refused_naming_both(fresh, monkeypatch, folder, tmp_path):
    """A folder whose library was built from other kernel sources: the first use raises, naming the library's version,
    this package's and the command that builds the right one; a model's forward raises it too, computing nothing."""
    stale = tmp_path / "stale"
    stale.mkdir()
    version = native.kernels_version()
    shutil.copyfile(
        folder / native.prebuilt_name(native.machine_kind(), CHOSEN, version),
        stale / native.prebuilt_name(native.machine_kind(), CHOSEN, "0123456789ab"),
    )
    monkeypatch.setenv(native.KERNELS, str(stale))
    expected = (
        f"kernels of version 0123456789ab, but this package's kernels are version {version}: .*build-kernels {stale}"
    )
    with pytest.raises(ValueError, match=expected):
        native.available()
    import disentangled

    config = disentangled.DisentangledConfig(vocab_size=50, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64)  # fmt: skip
    model = disentangled.DisentangledModel(config).eval()
    model.set_attn_implementation("sdpa")
    with torch.no_grad(), pytest.raises(ValueError, match="0123456789ab"):
        model(input_ids=torch.randint(0, 50, (1, 40)))
    assert cli.main(["env"]) == 2  # the report says the same, as an error


def test_a_folder_without_this_set_s_library_is_an_error_that_says_how_to_build_it(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv(native.KERNELS, str(tmp_path))
    with pytest.raises(ValueError, match=f"no library of the {CHOSEN} kernels .*disentangled build-kernels {tmp_path}"):
        native.available()


def test_onnx_runtime_s_operator_library_comes_from_the_folder_too(fresh, monkeypatch, tmp_path):
    """`ort_operator.library_path()` takes the operator library of the DISENTANGLED_KERNELS folder, or of the wheel's
    prebuilt folder where no compiler is found (the library is `export-onnx --kernel`'s, tested there)."""
    pytest.importorskip("onnxruntime")
    from disentangled.serving import ort_operator

    for environment, prebuilt_folder in ((True, tmp_path / "absent"), (False, tmp_path)):
        monkeypatch.setattr(ort_operator, "_state", {})
        monkeypatch.setattr(native, "PREBUILT", prebuilt_folder)
        if environment:
            monkeypatch.setenv(native.KERNELS, str(tmp_path))
        else:
            monkeypatch.delenv(native.KERNELS)
        (tmp_path / ort_operator.library_name()).write_bytes(b"")
        assert ort_operator.library_path() == tmp_path / ort_operator.library_name()
