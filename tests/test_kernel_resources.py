"""The Triton kernels as the compiler sees them, checked on the CPU (`benchmarks/kernel_resources.py`).

Each kernel is compiled ahead of time for real GPU targets with the ptxas inside triton's wheel, at the tiles the
dispatcher picks on that GPU (`triton_attention.tiles_for`), and must use no stack (no spilled registers) and no
more shared memory than the GPU gives a block, or fall back on purpose (an entry None in TILES). The matrix here is
CI's share of the report's: sm_75, sm_80, sm_86 and sm_90; one half precision (float16 on sm_75, which has no
bfloat16) and float32; head sizes 64 and 128; with and without dropout; a key mask and c2p + p2c.
"""

from __future__ import annotations

import os
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
from disentangled.modeling import dispatch, triton_attention  # noqa: E402


def ci_configurations() -> list[dict]:
    rows = []
    for target in ("sm_75", "sm_80", "sm_86", "sm_90"):
        for dtype in ("float16" if target == "sm_75" else "bfloat16", "float32"):
            for head_size in (64, 128):
                for dropout in (False, True):
                    flags = dict(mask=True, dropout=dropout, p2p=False)
                    rows.append(dict(target=target, dtype=dtype, head_size=head_size, flags=flags))
    return rows


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        return [row for rows in pool.map(kernel_resources.measure, ci_configurations()) for row in rows]


def test_every_kernel_fits_every_gpu(rows):
    """No spills and shared memory within the GPU's, at the dispatcher's tiles, or a fallback the table records."""
    assert len(rows) == 3 * len(ci_configurations())
    misfits = [row for row in rows if not kernel_resources.fits(row)]
    assert not misfits, "\n".join(kernel_resources.table(misfits))
    for row in rows:
        if row["falls_back"]:  # only float32 may fall back, and the dispatcher must then say so
            assert row["dtype"] == "float32", row
            capability = kernel_resources.TARGETS[row["target"]]
            decision = dispatch.decide(_facts(row, capability))
            assert decision.path == "sdpa-blocked" and "fit compute capability" in decision.describe()
        else:
            assert row["registers"] <= 255 and row["shared"] > 0, row


def test_the_report_compiles_the_dispatchers_tiles(rows, monkeypatch):
    """The report reads the same table as the dispatcher: each row's tiles are `tiles_for` that GPU's, and a change
    to TILES reaches what the report compiles (the launches it hands the compiler carry the new tiles)."""
    for row in rows:
        capability = kernel_resources.TARGETS[row["target"]]
        tiles = triton_attention.tiles_for(capability, kernel_resources.DTYPES[row["dtype"]], row["head_size"])
        assert row["tiles"] == (list(tiles[row["kernel"]]) if tiles is not None else None), row
    marked = {"forward": (16, 32, 2, 1), "keys": (32, 16, 2, 1), "queries": (16, 16, 2, 1)}
    monkeypatch.setitem(triton_attention.TILES, (9, 0), {**triton_attention.TILES[(9, 0)], ("half", 64): marked})
    compiled = []

    def record(launch, capability):
        compiled.append((capability, launch.options["BLOCK_M"], launch.options["BLOCK_N"], launch.options["num_warps"]))
        return type("Compiled", (), {"asm": {"cubin": b""}, "metadata": type("Meta", (), {"shared": 1})})()

    monkeypatch.setattr(kernel_resources, "compile_launch", record)
    monkeypatch.setattr(kernel_resources, "resource_usage", lambda cubin: {"registers": 1, "stack": 0})
    flags = dict(mask=True, dropout=False, p2p=False)
    measured = kernel_resources.measure(dict(target="sm_90", dtype="bfloat16", head_size=64, flags=flags))
    assert compiled == [((9, 0), *marked[kernel][:3]) for kernel in kernel_resources.KERNELS]
    assert [row["tiles"] for row in measured] == [list(marked[kernel]) for kernel in kernel_resources.KERNELS]


def test_the_measurement_sees_spills_and_shared_memory():
    """The same measurement on tiles known to be too large (the forward's first tiles before this table: 128 x 64,
    4 warps, 3 stages) reports spills, and float32 at those tiles more shared memory than an sm_86 GPU has."""
    too_large = {k: (128, 64, 4, 3) for k in kernel_resources.KERNELS}
    flags = dict(mask=True, dropout=False, p2p=False)

    def forward(dtype, capability):
        launch = kernel_resources.launches(dtype, 64, flags, too_large)["forward"]
        return kernel_resources.compile_launch(launch, capability)

    assert kernel_resources.resource_usage(forward(torch.bfloat16, (9, 0)).asm["cubin"])["stack"] > 0
    assert forward(torch.float32, (8, 6)).metadata.shared > kernel_resources.SHARED_MEMORY[(8, 6)]


def test_report_table_and_record(rows, tmp_path, monkeypatch, capsys):
    """The table names every configuration once; the record holds the rows and the table the dispatcher read."""
    lines = kernel_resources.table(rows)
    assert len(lines) == 2 + len(ci_configurations())
    assert any("sm_75 | float16 | 64 | mask+dropout" in line for line in lines)
    monkeypatch.setattr(kernel_resources, "run", lambda targets, processes: [r for r in rows if r["target"] in targets])
    monkeypatch.setattr(kernel_resources, "append_record", _recording_into(tmp_path))
    out = tmp_path / "rows.jsonl"
    assert kernel_resources.main(["--targets", "sm_80", "--json", str(out)]) == 0
    assert "0 spill or exceed shared memory" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == len([r for r in rows if r["target"] == "sm_80"])
    (record,) = read_records("kernel_resources", tmp_path)
    assert record["figures"]["rows"][0]["target"] == "sm_80" and "9.0" in record["figures"]["tiles"]
    assert record["command"] == "python -m benchmarks.kernel_resources --targets sm_80 --json " + str(out)


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


def test_tuner_keeps_the_fastest_usable_tile_within_its_budget(tmp_path, monkeypatch):
    """With timings made up (a tile's milliseconds: 1000 / its area, but 64 x 32 unusable), each kernel keeps its
    fastest usable candidate; a budget that runs out keeps the table's tiles for what was not tuned; the profile is
    merged into the file by GPU and read back by the dispatcher."""
    from benchmarks import tune_kernel

    def fake_time(kernel, tile, dtypes, head_size, timer):
        return None if tile[:2] == (64, 32) else 1000.0 / (tile[0] * tile[1]) + tile[2] * 1e-3

    monkeypatch.setattr(tune_kernel, "time_tile", fake_time)
    tuned = tune_kernel.tune((9, 0), "Made-up GPU", budget_s=1e9)
    for key in ("half/64", "half/128"):
        for kernel in kernel_resources.KERNELS:
            usable = [t for t in tune_kernel.CANDIDATES[kernel] if t[:2] != (64, 32)]
            best = min(usable, key=lambda t: fake_time(kernel, t, (), 0, None))
            default = triton_attention.tiles_for((9, 0), torch.bfloat16, int(key.split("/")[1]))[kernel]
            if fake_time(kernel, default, (), 0, None) is not None:
                best = min([best, default], key=lambda t: fake_time(kernel, t, (), 0, None))
            assert tuple(tuned["tiles"][key][kernel]) == best, (key, kernel)

    ticks = iter(range(10_000))
    short = tune_kernel.tune((9, 0), "Made-up GPU", budget_s=3, clock=lambda: next(ticks))
    table = triton_attention.tiles_for((9, 0), torch.bfloat16, 128)
    assert "half/128" not in short["tiles"]  # the budget ran out before it: the table's tiles stay

    path = tmp_path / "triton_tiles.json"
    other = {"gpu": "Other GPU", "capability": [8, 0], "tiles": {"half/64": {"forward": [16, 16, 4, 1]}}}
    tune_kernel.write(path, [other, {"gpu": "Made-up GPU", "capability": [9, 0], "tiles": {}}])
    tune_kernel.write(path, tune_kernel.merge(path, {"gpu": "Made-up GPU", "capability": [9, 0], **tuned}))
    profiles = triton_attention.load_profiles(path)
    assert [p["gpu"] for p in profiles] == ["Other GPU", "Made-up GPU"]
    monkeypatch.setattr(triton_attention, "_PROFILES", profiles)
    chosen = triton_attention.tiles_for((9, 0), torch.float16, 64, "Made-up GPU")
    assert chosen == {k: tuple(t) for k, t in tuned["tiles"]["half/64"].items()}
    assert triton_attention.tiles_for((9, 0), torch.bfloat16, 128, "Another GPU") == table
