"""The Triton kernels as the compiler sees them, checked on the CPU (`benchmarks/kernel_resources.py`).

Each kernel is compiled ahead of time for real GPU targets with the ptxas inside triton's wheel, at the tiles the
dispatcher picks on that GPU (`triton_tiles.tiles_for`), from launches made the way a training step makes them, and
must use no stack (no spilled registers) and no more shared memory than the GPU gives a block, or fall back on purpose
(an entry None in TILES). The matrix here (`ci_configurations`) is CI's share of the report's; it runs with the
installed Triton, and again with Triton 3.8 (what torch 2.14 pins) where .ci/run made its environment
(`.venvtriton38`, or DISENTANGLED_PYTHON_TRITON_3_8). Real calls of many shapes are seen to make exactly the report's
compiles (Triton's own cache key), and a seed of 1 or a length that is a multiple of 16, which the report once
compiled alone, is seen to hide a spill.
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
if not (TOOLS / "ptxas").exists() or not (TOOLS / "cuobjdump").exists():  # pragma: no cover - other wheels
    pytest.skip(f"triton's wheel has no ptxas / cuobjdump in {TOOLS}", allow_module_level=True)

import torch  # noqa: E402

from benchmarks import kernel_resources  # noqa: E402
from benchmarks.records import read_records  # noqa: E402
from disentangled.modeling import dispatch, triton_tiles  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Triton 3.8 beside the installed one (.ci/run makes this environment: a venv over the system's packages)
PYTHON_TRITON_3_8 = Path(os.environ.get("DISENTANGLED_PYTHON_TRITON_3_8", REPO / ".venvtriton38" / "bin" / "python"))
PROCESSES = min(2, os.cpu_count() or 1)


def ci_configurations(second: tuple[bool, bool, int] = (True, False, 509)) -> list[dict]:
    """sm_75 (float16), sm_80, sm_86 and sm_90 (bfloat16), and float32 on each; head sizes 64 and 128; per
    configuration the specialisation that spilled most often in the report at the former tiles (a padded training
    call with dropout at a length that is not a multiple of 16: 52 of its 138 spills) and `second` (mask, dropout,
    length): for the installed Triton a padded call without dropout at that length, for Triton 3.8 an unpadded one at
    512 tokens. On the report's record at the former tiles, this matrix sees a spill in 19 of the 24 (Triton, GPU,
    dtype, head size, kernel) that had one within its scope; the former CI matrix (a key mask, 512 tokens; even with a
    training call's seed) in 10."""
    rows = []
    for target in ("sm_75", "sm_80", "sm_86", "sm_90"):
        for dtype in ("float16" if target == "sm_75" else "bfloat16", "float32"):
            for head_size in (64, 128):
                for config in kernel_resources.variants(target, dtype, head_size):
                    flags = config["flags"]
                    if (flags["mask"], flags["dropout"], config["length"]) in ((True, True, 509), second):
                        rows.append(config)
    return rows


CI_TRITON_3_8 = (False, False, 512)


def measure_all(configs: list[dict]) -> list[dict]:
    with ProcessPoolExecutor(max_workers=PROCESSES) as pool:
        return [row for rows in pool.map(kernel_resources.measure, configs) for row in rows]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return measure_all(ci_configurations())


@pytest.fixture(scope="module")
def rows_triton_3_8() -> list[dict]:
    if not PYTHON_TRITON_3_8.exists():
        pytest.skip(f"no Triton 3.8 environment at {PYTHON_TRITON_3_8} (.ci/run makes it)")
    return kernel_resources.run_elsewhere(str(PYTHON_TRITON_3_8), ci_configurations(CI_TRITON_3_8), PROCESSES)


def assert_fit(rows: list[dict]) -> None:
    """No spills and shared memory within the GPU's, at the dispatcher's tiles, or a fallback the table records."""
    assert len(rows) == 3 * len(ci_configurations()) and len({kernel_resources.variant(row) for row in rows}) == 2
    misfits = kernel_resources.misfit_lines(rows)
    assert not misfits, "\n".join(misfits)
    for row in rows:
        if row["falls_back"]:  # only float32 may fall back, and the dispatcher must then say so
            assert row["dtype"] == "float32", row
            capability = kernel_resources.TARGETS[row["target"]]
            decision = dispatch.decide(_facts(row, capability))
            assert decision.path == "sdpa-blocked" and "fit compute capability" in decision.describe()
        else:
            assert row["registers"] <= 255 and row["shared"] > 0, row


def test_every_kernel_fits_every_gpu(rows):
    assert {row["triton"] for row in rows} == {triton.__version__}
    assert_fit(rows)


def test_every_kernel_fits_every_gpu_under_triton_3_8(rows_triton_3_8):
    assert {row["triton"] for row in rows_triton_3_8} == {"3.8.0"}
    assert_fit(rows_triton_3_8)


def test_the_report_compiles_the_dispatchers_tiles(rows, monkeypatch):
    """The report reads the same table as the dispatcher: each row's tiles are `tiles_for` that GPU's, and a change
    to TILES reaches what the report compiles (the launches it hands the compiler carry the new tiles)."""
    for row in rows:
        capability = kernel_resources.TARGETS[row["target"]]
        tiles = triton_tiles.tiles_for(capability, kernel_resources.DTYPES[row["dtype"]], row["head_size"])
        assert row["tiles"] == (list(tiles[row["kernel"]]) if tiles is not None else None), row
    marked = {"forward": (16, 32, 2, 1), "keys": (32, 16, 2, 1), "queries": (16, 16, 2, 1)}
    monkeypatch.setitem(triton_tiles.TILES, (9, 0), {**triton_tiles.TILES[(9, 0)], ("half", 64): marked})
    compiled = []

    def record(launch, capability):
        compiled.append((capability, launch.options["BLOCK_M"], launch.options["BLOCK_N"], launch.options["num_warps"]))
        return type("Compiled", (), {"asm": {"cubin": b""}, "metadata": type("Meta", (), {"shared": 1})})()

    monkeypatch.setattr(kernel_resources, "compile_launch", record)
    monkeypatch.setattr(kernel_resources, "resource_usage", lambda cubin: {"registers": 1, "stack": 0})
    flags = dict(mask=True, dropout=False, p2p=False)
    measured = kernel_resources.measure(dict(target="sm_90", dtype="bfloat16", head_size=64, flags=flags, length=509))
    assert compiled == [((9, 0), *marked[kernel][:3]) for kernel in kernel_resources.KERNELS]
    assert [row["tiles"] for row in measured] == [list(marked[kernel]) for kernel in kernel_resources.KERNELS]


def test_the_measurement_sees_spills_and_shared_memory():
    """The same measurement on tiles known to be too large (the forward's first tiles before this table: 128 x 64,
    4 warps, 3 stages) reports spills, and float32 at those tiles more shared memory than an sm_86 GPU has."""
    too_large = {k: (128, 64, 4, 3) for k in kernel_resources.KERNELS}
    flags = dict(mask=True, dropout=False, p2p=False)

    def forward(dtype, capability):
        launch = kernel_resources.call_launches(dtype, 64, flags, too_large)["forward"]
        return kernel_resources.compile_launch(launch, capability)

    assert kernel_resources.resource_usage(forward(torch.bfloat16, (9, 0)).asm["cubin"])["stack"] > 0
    assert forward(torch.float32, (8, 6)).metadata.shared > kernel_resources.SHARED_MEMORY[(8, 6)]


def test_real_calls_make_exactly_the_reports_compiles():
    """Training and inference calls of other shapes (batch, heads: DeBERTa-v3-xsmall's 6, base's 12, large's 16;
    lengths from 1 to 2,048; padded or not; a fresh seed each) hand the compiler exactly what one of the report's two
    lengths does (Triton's own cache key, per kernel): the report compiles every kernel a real call runs. A seed of 1
    (once the report's) and a length of 1 are no constants. The two lengths stay apart (a test that could not fail
    would pass with one)."""
    tiles = {kernel: (32, 32, 4, 1) for kernel in kernel_resources.KERNELS}
    calls = [(1, 12, 1), (1, 12, 100), (3, 16, 257), (8, 6, 509), (2, 12, 504), (2, 12, 512), (1, 16, 1024), (4, 6, 48)]
    for flags in (dict(mask=True, dropout=True, p2p=False), dict(mask=False, dropout=False, p2p=True)):
        report = {
            length: {
                kernel: kernel_resources.compile_key(launch)
                for kernel, launch in kernel_resources.call_launches(torch.bfloat16, 64, flags, tiles, length).items()
            }
            for length in kernel_resources.LENGTHS
        }
        assert all(report[512][kernel] != report[509][kernel] for kernel in kernel_resources.KERNELS)
        for batch, heads, length in calls:
            shape = dict(batch=batch, heads=heads)
            made = kernel_resources.call_launches(torch.bfloat16, 64, flags, tiles, length, shape)
            expected = report[512 if length % 16 == 0 else 509]
            for kernel, launch in made.items():
                assert kernel_resources.compile_key(launch) == expected[kernel], (flags, batch, heads, length, kernel)
                for seed in (1, random.randrange(2**31 - 1) // 16 * 16):  # the seed-1 launch; a seed divisible by 16
                    assert kernel_resources.compile_key(with_seed(launch, seed)) == expected[kernel]


def test_the_old_reports_one_specialisation_hid_spills():
    """The report once compiled one specialisation of each kernel: a seed of 1, which Triton's own specialisation
    makes a constant, and a length that is a multiple of 16. Both hid spills at the tiles sm_86 had then for
    bfloat16, under Triton 3.8 and 3.9 alike: the by-keys kernel at head size 64 (64 x 32, 8 warps) compiles without
    a spill for a seed of 1 and with 8 bytes of stack for a training call's seed; the forward at head size 32 (64 x
    64, 8 warps) without a spill at 512 tokens and with 16 bytes at 509. The report now compiles what a training call
    compiles (our kernels compile a seed of 1 as any other), and both lengths."""
    before = {"forward": (64, 64, 8, 2), "keys": (64, 32, 8, 1), "queries": (64, 32, 8, 2)}
    flags = dict(mask=True, dropout=True, p2p=False)

    def stack(launch) -> int:
        return kernel_resources.resource_usage(kernel_resources.compile_launch(launch, (8, 6)).asm["cubin"])["stack"]

    keys = kernel_resources.call_launches(torch.bfloat16, 64, flags, before)["keys"]
    as_triton_would = keys._replace(kernel=triton.jit(keys.kernel.fn))  # Triton's own specialisation of the seed
    assert stack(with_seed(as_triton_would, 1)) == 0
    assert stack(with_seed(as_triton_would, 123_457)) > 0
    assert kernel_resources.compile_key(with_seed(keys, 1)) == kernel_resources.compile_key(keys)
    assert stack(keys) > 0
    forward = {
        length: kernel_resources.call_launches(torch.bfloat16, 32, flags, before, length)["forward"]
        for length in kernel_resources.LENGTHS
    }
    assert stack(forward[512]) == 0 and stack(forward[509]) > 0


def with_seed(launch, seed: int):
    """`launch` with another dropout seed."""
    names = [param.name for param in launch.kernel.params]
    args = list(launch.args)
    args[names.index("seed")] = seed
    return launch._replace(args=tuple(args))


def test_report_table_and_record(rows, tmp_path, monkeypatch, capsys):
    """The table names every (Triton, GPU, dtype, head size) once with the worst figures of its specialisations;
    the record holds the rows, their Triton, and the table the dispatcher read."""
    lines = kernel_resources.table(rows)
    groups = {(row["target"], row["dtype"], row["head_size"]) for row in rows}
    assert len(lines) == 2 + len(groups)
    (line,) = [line for line in lines if f"| {triton.__version__} | sm_75 | float16 | 64 |" in line]
    stack = [max(r["stack"] for r in rows if (r["target"], r["head_size"], r["kernel"]) == ("sm_75", 64, k))
             for k in kernel_resources.KERNELS]  # fmt: skip
    assert " / ".join(map(str, stack)) in line
    monkeypatch.setattr(kernel_resources, "run", lambda configs, processes: [r for r in rows if r["target"] == "sm_80"])
    monkeypatch.setattr(kernel_resources, "append_record", _recording_into(tmp_path))
    out = tmp_path / "rows.jsonl"
    assert kernel_resources.main(["--targets", "sm_80", "--json", str(out)]) == 0
    assert "0 spill or exceed shared memory" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == len([r for r in rows if r["target"] == "sm_80"])
    (record,) = read_records("kernel_resources", tmp_path)
    assert record["figures"]["rows"][0]["target"] == "sm_80" and "9.0" in record["figures"]["tiles"]
    assert record["figures"]["triton"] == [triton.__version__]
    assert record["command"] == "python -m benchmarks.kernel_resources --targets sm_80 --json " + str(out)
    assert "0 that spill or exceed shared memory" in kernel_resources.section([record])


def _recording_into(folder: Path):
    from benchmarks.records import append_record

    def append(benchmark, figures, **kwargs):
        return append_record(benchmark, figures, folder=folder, **kwargs)

    return append


def _facts(row: dict, capability: tuple[int, int]):
    """A CUDA call of the row's kind on its GPU, as the dispatcher sees it."""
    dtype = kernel_resources.DTYPES[row["dtype"]]
    return dispatch.Call(device="cuda", dtype=dtype, head_size=row["head_size"], gpu=row["target"], capability=capability)


def test_tuner_refuses_without_a_gpu():
    from benchmarks import tune_kernel

    with pytest.raises(ValueError, match="CUDA GPU"):
        tune_kernel.main(["--device", "cpu"])


def test_tuner_keeps_the_fastest_tile_that_fits_everywhere_within_its_budget(tmp_path, monkeypatch):
    """With timings made up (a tile's milliseconds: 1000 / its area, but 64 x 32 unusable) and 64 x 64 said to spill
    in some specialisation, each kernel keeps its fastest usable candidate that fits everywhere; a budget that runs
    out keeps the table's tiles for what was not tuned; the profile is merged into the file by GPU and Triton release
    and read back by the dispatcher under that release only."""
    from benchmarks import tune_kernel

    def fake_time(kernel, tile, dtypes, head_size, timer, tiles=None):
        return None if tile[:2] == (64, 32) else 1000.0 / (tile[0] * tile[1]) + tile[2] * 1e-3

    def fake_check(kernel, tile, dtypes, head_size, capability, tiles):
        return tile[:2] != (64, 64)

    monkeypatch.setattr(tune_kernel, "time_tile", fake_time)
    tuned = tune_kernel.tune((9, 0), "Made-up GPU", budget_s=1e9, check=fake_check)
    for key in ("half/64", "half/128"):
        default = triton_tiles.tiles_for((9, 0), torch.bfloat16, int(key.split("/")[1]))
        for kernel in kernel_resources.KERNELS:
            usable = [
                t for t in [default[kernel], *tune_kernel.CANDIDATES[kernel]] if t[:2] not in ((64, 32), (64, 64))
            ]
            best = min(usable, key=lambda t: fake_time(kernel, t, (), 0, None))
            assert tuple(tuned["tiles"][key][kernel]) == best, (key, kernel)

    ticks = iter(range(10_000))
    short = tune_kernel.tune((9, 0), "Made-up GPU", budget_s=3, clock=lambda: next(ticks), check=fake_check)
    table = triton_tiles.tiles_for((9, 0), torch.bfloat16, 128)
    assert "half/128" not in short["tiles"]  # the budget ran out before it: the table's tiles stay

    path = tmp_path / "triton_tiles.json"
    other = {"gpu": "Other GPU", "capability": [8, 0], "triton": "3.9.0", "tiles": {"half/64": {"forward": [16] * 4}}}
    older = {"gpu": "Made-up GPU", "capability": [9, 0], "triton": "3.8.0", "tiles": {}}
    tune_kernel.write(
        path, [other, older, {"gpu": "Made-up GPU", "capability": [9, 0], "triton": "3.9.1", "tiles": {}}]
    )
    profile = {"gpu": "Made-up GPU", "capability": [9, 0], "triton": "3.9.0", **tuned}
    tune_kernel.write(path, tune_kernel.merge(path, profile))
    profiles = triton_tiles.load_profiles(path)
    assert [(p["gpu"], p["triton"]) for p in profiles] == [("Other GPU", "3.9.0"), ("Made-up GPU", "3.8.0"),
                                                           ("Made-up GPU", "3.9.0")]  # fmt: skip
    monkeypatch.setattr(triton_tiles, "_PROFILES", profiles)
    chosen = triton_tiles.tiles_for((9, 0), torch.float16, 64, "Made-up GPU", triton_version="3.9.2")
    assert chosen == {k: tuple(t) for k, t in tuned["tiles"]["half/64"].items()}
    assert triton_tiles.tiles_for((9, 0), torch.float16, 64, "Made-up GPU", triton_version="3.8.0") != chosen
    assert triton_tiles.tiles_for((9, 0), torch.bfloat16, 128, "Another GPU") == table
