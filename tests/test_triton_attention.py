"""The fused Triton kernel (`modeling/triton_attention.py`) against the eager reference, on the CPU through Triton's
interpreter: outputs and every gradient (q, k, v, Kr, Qr through the tables), masks, packed sequences, clipped and
log-bucketed distances, each term alone, p2p, head sizes 32/64/128, bfloat16 and float16, dropout; and the dispatch
from `sdpa_disentangled` (CUDA only, one debug line for each fallback).

The interpreter must be on when triton is imported: triton.language's own jitted helpers (`tl.zeros`, `tl.rand`, ...)
are built then, and in a suite something may import triton first. So the kernel tests (`in_interpreter`) run in a
child pytest started with TRITON_INTERPRET=1 (`test_kernels_in_the_interpreter`, one process for all of them), or
directly where this process was started so. Tiles are 16 x 16, so that 17, 24 and 40 tokens cover several and ragged
tiles.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from parity import inflate_weights, max_abs_diff, padded_batch

pytest.importorskip("triton")

import disentangled  # noqa: E402
from disentangled.modeling import (  # noqa: E402
    dispatch,
    kernel_check,
    modeling_disentangled,
    sdpa_attention,
    triton_attention,
    triton_tiles,
)
from disentangled.modeling.disentangled_attention import (  # noqa: E402
    PositionScores,
    RelativePositions,
    eager_disentangled,
    head_scaling,
)

TILES = {"forward": (16, 16, 1, 1), "keys": (16, 16, 1, 1), "queries": (16, 16, 1, 1)}


INTERPRETED = triton_attention.INTERPRETED  # this process was started with TRITON_INTERPRET=1
in_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in a process started with TRITON_INTERPRET=1 (test_kernels_in_the_interpreter)"
)


@pytest.mark.slow  # every kernel test of this file, interpreted
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter's process")
def test_kernels_in_the_interpreter():
    """Every test of this file in one child pytest whose triton is the interpreter's; its report on failure."""
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "not in_the_interpreter"]
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        command, cwd=Path(__file__).parents[1], env=environment, capture_output=True, text=True, timeout=900
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0 and "skipped" not in summary, result.stdout[-8000:] + result.stderr[-2000:]


class Case:
    """Leaf inputs of one attention call: q, k, v ([B, L, H, D] leaves, used as [B, H, L, D] views, as the model's
    heads are), the projected relative rows Kr and Qr ([H, W, D], scaled), a key mask, and the term switches."""

    def __init__(
        self,
        batch=2,
        heads=2,
        length=17,
        dim=32,
        terms=("c2p", "p2c"),
        buckets=(8, 0, 0),  # (span, bucket_size, max_position): bucket_size 0 clips distances at the span
        mask=None,  # None, "padded" (the last row keeps half its keys), "empty" (the last row keeps none)
        dtype=torch.float32,
        seed=0,
    ):
        generator = torch.Generator().manual_seed(seed)
        span, bucket_size, max_position = buckets
        self.positions = RelativePositions.build(length, span, bucket_size, max_position, "cpu")
        self.terms, self.dtype = terms, dtype
        self.scaling = head_scaling(dim, 1 + len(terms))
        width = self.positions.width

        def leaf(*shape, scale=1.0):
            return (torch.randn(*shape, generator=generator) * scale).to(dtype).requires_grad_()

        self.q, self.k, self.v = (leaf(batch, length, heads, dim) for _ in range(3))
        self.pos_key, self.pos_query = (leaf(heads, width, dim, scale=self.scaling) for _ in range(2))
        self.mask = None
        if mask is not None:
            self.mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
            self.mask[-1, ..., length // 2 if mask == "padded" else 0 :] = False
        self.grad_output = torch.randn(batch, length, heads, dim, generator=generator).to(dtype)

    def leaves(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.pos_key, self.pos_query

    def to(self, dtype) -> Case:
        """The same inputs in another dtype (leaves of their own)."""
        other = copy.copy(self)
        for name in ("q", "k", "v", "pos_key", "pos_query"):
            setattr(other, name, getattr(self, name).detach().to(dtype).requires_grad_())
        other.grad_output, other.dtype = self.grad_output.to(dtype), dtype
        return other

    def position_scores(self) -> PositionScores | None:
        if not self.terms:
            return None
        query, key = self.q.transpose(1, 2), self.k.transpose(1, 2)
        p2p = None
        if "p2p" in self.terms:  # as the model makes it: [H, 2L - 1] by distance, from both tables
            column = self.positions.column
            p2p = (self.pos_query[:, column] * self.pos_key[:, column.flip(0)]).sum(-1) / self.scaling
        pos_key = self.pos_key if "c2p" in self.terms else None
        pos_query = self.pos_query if "p2c" in self.terms else None
        return PositionScores(query, key, pos_key, pos_query, p2p, self.positions)

    def run_forward(self, attend, **kwargs) -> torch.Tensor:
        """The context [B, L, H, D] alone (no gradients asked)."""
        query, key, value = (t.transpose(1, 2) for t in (self.q, self.k, self.v))
        context, _ = attend(
            None, query, key, value, self.mask, self.scaling, position_scores=self.position_scores(), **kwargs
        )
        return context

    def run(self, attend, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The context [B, L, H, D] and the gradients of <context, grad_output> for each leaf."""
        query, key, value = (t.transpose(1, 2) for t in (self.q, self.k, self.v))
        context, _ = attend(
            None, query, key, value, self.mask, self.scaling, position_scores=self.position_scores(), **kwargs
        )
        grads = torch.autograd.grad(context, self.leaves(), self.grad_output, allow_unused=True)
        return context.detach(), list(grads)


def kernel(**kwargs):
    def attend(*args, **more):
        return triton_attention.triton_disentangled(*args, blocks=TILES, **kwargs, **more)

    return attend


def dense_with_dropout(keep: torch.Tensor, dropout: float):
    """The eager formula with a given dropout mask [B, H, L, L] (True = kept)."""

    def attend(module, query, key, value, mask, scaling, position_scores=None):
        scores = (query * scaling) @ key.mT + position_scores.bias()
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return ((probs * keep / (1 - dropout)) @ value).transpose(1, 2), None

    return attend


def assert_close(actual, expected, tolerance, what=""):
    """|actual - expected| <= tolerance * max(1, max|expected|) (outputs) or tolerance * max|expected| (gradients)."""
    scale = max(expected.abs().max().item(), 1e-6)
    error = (actual.float() - expected.float()).abs().max().item()
    assert error <= tolerance * scale, f"{what}: max error {error:.3g} at scale {scale:.3g}"


def assert_matches(case: Case, expected, actual) -> None:
    (expected_context, expected_grads), (context, grads) = expected, actual
    assert_close(context, expected_context, 1e-5, "context")
    for name, ours, reference in zip(("q", "k", "v", "Kr", "Qr"), grads, expected_grads):
        assert (ours is None) == (reference is None), name
        if reference is not None:
            assert_close(ours, reference, 1e-4, f"d{name}")


CASES = {  # name: Case arguments; with 16 x 16 tiles every length is ragged
    "both-clipped-d32": dict(length=17, dim=32, buckets=(8, 0, 0)),
    "both-log-buckets-padded-d64": dict(length=40, dim=64, buckets=(8, 8, 64), mask="padded"),
    "c2p-only-log-buckets-d64": dict(length=24, dim=64, terms=("c2p",), buckets=(4, 4, 32)),
    "p2c-only-padded-d128": dict(length=24, dim=128, terms=("p2c",), mask="padded"),
    "unclipped-empty-row-d128": dict(length=17, dim=128, buckets=(32, 0, 0), mask="empty"),
    "p2p-log-buckets-padded-d32": dict(
        length=40, dim=32, terms=("c2p", "p2c", "p2p"), buckets=(8, 8, 64), mask="padded"
    ),
    "p2p-only-clipped-d32": dict(length=17, dim=32, terms=("p2p",), buckets=(4, 0, 0)),
    "no-terms-padded-d64": dict(length=17, dim=64, terms=(), mask="padded"),
    "both-clipped-far-padded-d32": dict(length=40, dim=32, buckets=(4, 0, 0), mask="padded"),
}


@in_interpreter
@pytest.mark.parametrize("name", CASES)
def test_matches_eager_in_float32(name):
    case = Case(**CASES[name])
    assert_matches(case, case.run(eager_disentangled), case.run(kernel()))


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_eager_error(dtype):
    """Against float32 eager on the same (rounded) inputs, our error stays within twice eager's own in `dtype`."""
    low = Case(length=24, dim=64, buckets=(8, 8, 64), mask="padded", dtype=dtype)
    reference_context, reference_grads = low.to(torch.float32).run(eager_disentangled)
    eager_context, eager_grads = low.run(eager_disentangled)
    context, grads = low.run(kernel())
    for name, ours, eager, reference in zip(
        ("context", "q", "k", "v", "Kr", "Qr"),
        (context, *grads),
        (eager_context, *eager_grads),
        (reference_context, *reference_grads),
    ):
        assert ours.dtype == dtype, name
        our_error, eager_error = max_abs_diff(ours.float(), reference), max_abs_diff(eager.float(), reference)
        assert our_error <= 2 * eager_error, f"{name}: {our_error:.3g} against eager's {eager_error:.3g}"


@in_interpreter
def test_dropout_statistics():
    """The kept fraction is 1 - p, the decisions are the seed's, and the kept probabilities are scaled by 1 / (1 - p)."""
    shape, dropout = (2, 2, 24, 24), 0.1
    keep = triton_attention.dropout_keep_mask(shape, dropout, seed=7)
    assert keep.shape == shape and keep.dtype == torch.bool
    fraction, spread = keep.float().mean().item(), (dropout * (1 - dropout) / keep.numel()) ** 0.5
    assert abs(fraction - (1 - dropout)) < 4 * spread
    assert torch.equal(keep, triton_attention.dropout_keep_mask(shape, dropout, seed=7))
    assert not torch.equal(keep, triton_attention.dropout_keep_mask(shape, dropout, seed=8))
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])  # per (b, h)

    case = Case(length=24, dim=32)
    query, key = case.q.transpose(1, 2), case.k.transpose(1, 2)
    ones = torch.ones_like(query)  # values of ones: context = sum_j P_ij keep_ij / (1 - p) in every dimension
    with torch.no_grad():
        kept, _ = kernel(seed=7)(None, query, key, ones, None, case.scaling, dropout, case.position_scores())
        whole, _ = kernel()(None, query, key, ones, None, case.scaling, 0.0, case.position_scores())
    rows = kept[..., 0]  # [B, L, H]: each row's kept mass, rescaled; expectation 1
    assert abs(rows.mean().item() - 1) < 0.05 and rows.std().item() > 0.01
    assert torch.allclose(whole, torch.ones_like(whole), atol=1e-5)


@in_interpreter
def test_dropout_with_fixed_seed_matches_reference():
    """With the kernel's own decisions applied densely, the reference gives the same outputs and gradients."""
    case, dropout, seed = (
        Case(length=24, dim=32, terms=("c2p", "p2c", "p2p"), buckets=(8, 8, 64), mask="padded"),
        0.1,
        1234,
    )
    keep = triton_attention.dropout_keep_mask((2, 2, 24, 24), dropout, seed)
    expected = case.run(dense_with_dropout(keep, dropout))
    assert_matches(case, expected, case.run(kernel(seed=seed), dropout=dropout))


@in_interpreter
def test_packed_sequences_through_cut():
    """The model's packed loop: one call per sequence on `PositionScores.cut`, each with its own column vector."""
    case, bounds = Case(batch=1, length=40, dim=32, terms=("c2p", "p2c", "p2p"), buckets=(8, 8, 64)), (0, 23, 40)

    def per_sequence(attend):
        def packed(module, query, key, value, mask, scaling, position_scores=None, **kwargs):
            contexts = []
            for first, last in zip(bounds[:-1], bounds[1:]):
                tokens = slice(first, last)
                context, _ = attend(
                    module, query[:, :, tokens], key[:, :, tokens], value[:, :, tokens], None, scaling,
                    position_scores=position_scores.cut(first, last), **kwargs,
                )  # fmt: skip
                contexts.append(context)
            return torch.cat(contexts, dim=1), None

        return packed

    assert_matches(case, case.run(per_sequence(eager_disentangled)), case.run(per_sequence(kernel())))


def cuda_call(**facts) -> dispatch.Call:
    """A CUDA call's facts as the dispatcher takes them (an H100 unless told), with position terms and a key mask."""
    return dispatch.Call(**{"device": "cuda", "dtype": torch.bfloat16, "length": 40, "gpu": "NVIDIA H100",
                            "capability": (9, 0), **facts})  # fmt: skip


def test_dispatch_takes_the_kernel_on_cuda_and_names_each_fallback(monkeypatch, switch, verdicts):
    def path(**facts):
        return dispatch.decide(cuda_call(**facts))

    for dim in (32, 64, 128):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for mask in ("none", "keys"):
                decision = path(head_size=dim, dtype=dtype, mask=mask)
                tiles = triton_tiles.tiles_for((9, 0), dtype, dim, "NVIDIA H100")
                if tiles is None:  # float32 at head size 128: no tiles fit (TILES says None)
                    assert decision.path == "sdpa-blocked" and "without spilling" in decision.describe()
                    continue
                assert decision.path == "triton" and not decision.skipped, (dim, dtype, mask, decision)
                assert decision.tiles == tiles and decision.check == "pending"

    def fallback(**facts) -> str:
        decision = path(**facts)
        assert decision.path == "sdpa-blocked" and decision.skipped[-1][0] == "triton", decision
        return decision.skipped[-1][1]

    assert "CUDA" in fallback(device="mps")
    assert "pair mask" in fallback(mask="pairs")
    assert "head sizes" in fallback(head_size=48)
    assert "float16, bfloat16 or float32" in fallback(dtype=torch.float64)
    assert "one dtype" in fallback(uniform=False)
    assert path(terms=()).path == "sdpa-dense"  # plain attention: torch's own fused kernels
    assert path(tracing=True).path == "sdpa-dense"
    for capability in triton_tiles.TILES:  # every GPU of the table takes every precision it has tiles for
        for dim in (32, 64, 128):
            for dtype in (torch.float16, torch.float32) + ((torch.bfloat16,) if capability >= (8, 0) else ()):
                tiles = triton_tiles.tiles_for(capability, dtype, dim)
                decision = path(head_size=dim, dtype=dtype, capability=capability, gpu=None)
                assert (decision.path == "triton") == (tiles is not None), (capability, dim, dtype, decision)
    assert "(8.0 for bfloat16)" in fallback(capability=(7, 5))
    assert "int32" in fallback(length=50_000, dropout=0.1)
    assert path(length=50_000).path == "triton"  # without dropout any length
    monkeypatch.setitem(triton_attention.FAILED_LAUNCHES, ("A GPU", (9, 0), torch.bfloat16, 64), "out of resource")
    assert "failed to launch" in fallback(gpu="A GPU")
    assert path(gpu="Another GPU").path == "triton"
    monkeypatch.setattr(dispatch, "TRITON_AVAILABLE", False)
    assert "not installed" in fallback()
    monkeypatch.setattr(dispatch, "TRITON_AVAILABLE", True)
    switch(TRITON="0")
    assert "DISENTANGLED_TRITON=0" in fallback()
    switch(TRITON="1")
    assert path().path == "triton" and path().check is None  # on, without the self-check
    with pytest.raises(ValueError, match="DISENTANGLED_TRITON .* 'yes'.* 0 .* 1 .* check"):
        switch(TRITON="yes")


def test_tiles_per_gpu_from_the_table_and_a_tuned_profile(tmp_path, monkeypatch):
    """`tiles_for` reads TILES by compute capability (an unlisted one takes a listed neighbour's), and a tuned
    profile for the GPU's name and capability wins over it; every listed entry names the three kernels' tiles."""
    for capability, entries in triton_tiles.TILES.items():
        for (precision, dim), tiles in entries.items():
            assert precision in ("half", "float32") and dim in triton_attention.HEAD_SIZES
            if tiles is not None:
                assert set(tiles) == {"forward", "keys", "queries"}, (capability, precision, dim)
                assert all(len(t) == 4 and all(isinstance(n, int) and n > 0 for n in t) for t in tiles.values())
    monkeypatch.setattr(triton_tiles, "_PROFILES", [])
    table = triton_tiles.TILES
    assert triton_tiles.tiles_for((8, 7), torch.bfloat16, 64) == table[(8, 6)][("half", 64)]
    assert triton_tiles.tiles_for((7, 0), torch.float16, 64) == table[(7, 5)][("half", 64)]
    assert triton_tiles.tiles_for((12, 0), torch.bfloat16, 128) == table[(8, 9)][("half", 128)]
    tuned = {"forward": [32, 32, 4, 1], "keys": [16, 16, 4, 1], "queries": [16, 32, 4, 1]}
    path = tmp_path / "triton_tiles.json"
    path.write_text(
        json.dumps({"profiles": [{"gpu": "NVIDIA H200", "capability": [9, 0], "tiles": {"half/64": tuned}}]})
    )
    monkeypatch.setattr(triton_tiles, "_PROFILES", triton_tiles.load_profiles(path))
    expected = {phase: tuple(tiles) for phase, tiles in tuned.items()}
    assert triton_tiles.tiles_for((9, 0), torch.bfloat16, 64, "NVIDIA H200") == expected
    assert triton_tiles.tiles_for((9, 0), torch.float16, 64, "NVIDIA H200") == expected  # "half": both
    assert triton_tiles.tiles_for((9, 0), torch.bfloat16, 64, "NVIDIA H100") == table[(9, 0)][("half", 64)]
    assert triton_tiles.tiles_for((9, 0), torch.bfloat16, 128, "NVIDIA H200") == table[(9, 0)][("half", 128)]
    assert triton_tiles.load_profiles(tmp_path / "absent.json") == []


def test_failed_launch_falls_back_once_with_a_warning(monkeypatch, switch, caplog):
    """A GPU that cannot launch the kernel (simulated: the launch raises Triton's OutOfResources): sdpa's own path
    serves the call with the same result, one warning names the GPU and the reason, and later calls do not try."""
    from triton.runtime.errors import OutOfResources

    tries = []

    def out_of_shared_memory(self):
        tries.append(self.kernel)
        raise OutOfResources(262_144, 232_448, "shared memory")

    monkeypatch.setattr(triton_attention, "_device_facts", lambda device: ("A small GPU", (9, 0)))
    monkeypatch.setattr(triton_attention, "FAILED_LAUNCHES", {})
    monkeypatch.setattr(dispatch, "FAILED_LAUNCHES", triton_attention.FAILED_LAUNCHES)
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)  # the failure path of a real GPU
    monkeypatch.setattr(triton_attention.Launch, "__call__", out_of_shared_memory)
    monkeypatch.setattr(triton_attention.Launch, "prepare", out_of_shared_memory)
    on_gpu(monkeypatch, gpu="A small GPU")
    switch(TRITON="1")  # the launch's failure, not the self-check's (which meets it as well: passed on as is)
    case = Case(length=17, dim=32, mask="padded")
    expected = case.run(eager_disentangled)
    with pytest.warns(RuntimeWarning, match="A small GPU.*out of resource: shared memory") as warned:
        actual = case.run(sdpa_attention.sdpa_disentangled)
    assert_matches(case, expected, actual)
    assert len(tries) == 1 and len(warned) == 1
    with caplog.at_level(logging.DEBUG, logger=dispatch.logger.name), warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        again = case.run(sdpa_attention.sdpa_disentangled)
    assert_matches(case, expected, again)
    assert len(tries) == 1  # not tried again
    assert any("failed to launch on this GPU before" in record.getMessage() for record in caplog.records)


def test_table_tile_kinds_match_the_columns():
    """How the backward adds a tile's dS into the tables' gradients, from the prefix counts (`column_runs`), against
    the column vector read directly: "alone" where the tile's distances read distinct columns that no other
    distance reads, "one column" where the tile reads a single column; the test cases reach all three."""
    seen = set()
    for name, arguments in CASES.items():
        length = arguments["length"]
        positions = RelativePositions.build(length, *arguments.get("buckets", (8, 0, 0)), "cpu")
        column = positions.column.tolist()
        kinds = iter(triton_attention.table_tile_kinds(triton_attention.column_runs(positions), length, 16, 16))
        for i0 in range(0, length, 16):
            for j0 in range(0, length, 16):
                distances = {i - j + length - 1 for i in range(i0, min(i0 + 16, length))
                             for j in range(j0, min(j0 + 16, length))}  # fmt: skip
                columns = [column[d] for d in distances]
                outside = {column[d] for d in range(2 * length - 1) if d not in distances}
                alone = len(set(columns)) == len(columns) and not outside & set(columns)
                expected = "one column" if len(set(columns)) == 1 else "alone" if alone else "atomics"
                kind = next(kinds)
                assert kind == expected, (name, i0, j0, kind, expected)
                seen.add(kind)
    assert seen == {"alone", "one column", "atomics"}


def test_cpu_never_takes_the_kernel(monkeypatch, switch, caplog):
    """Even with the interpreter on and the kernel switched on without its check, sdpa on CPU tensors runs its own
    code; a call that falls back from the CPU's first path says which and why in one debug line."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the Triton kernel ran for CPU tensors")

    decisions = []
    decide = sdpa_attention.decide
    monkeypatch.setattr(sdpa_attention, "decide", lambda call: decisions.append(decide(call)) or decisions[-1])
    monkeypatch.setattr(sdpa_attention, "triton_disentangled", forbidden)
    switch(TRITON="1")
    case = Case(length=17, dim=32, mask="padded")
    with caplog.at_level(logging.DEBUG, logger=dispatch.logger.name):
        expected = case.run(eager_disentangled)
        actual = case.run(sdpa_attention.sdpa_disentangled)  # training: gradients on
        with torch.no_grad():
            query, key, value = (t.transpose(1, 2) for t in (case.q, case.k, case.v))
            sdpa_attention.sdpa_disentangled(
                None, query, key, value, case.mask, case.scaling, 0.0, case.position_scores()
            )
    assert_matches(case, expected, actual)
    assert [decision.path.startswith("cpu-") for decision in decisions] == [True, True]
    lines = [record.getMessage() for record in caplog.records if record.name == dispatch.logger.name]
    assert lines == [f"attention runs {decision.describe()}" for decision in decisions if decision.skipped]
    assert all("triton" not in line for line in lines)


def on_gpu(monkeypatch, gpu: str = "interpreter", tiles: dict | None = None) -> None:
    """The dispatcher told that CPU tensors are on a CUDA GPU `gpu` of compute capability 9.0 (the interpreter runs
    the kernel on them), with `tiles` for every call where given: where the facts are read, by a model's layer or by
    sdpa for a call that comes without a decision."""
    facts = dispatch.call_facts

    def on_cuda(*args, **kwargs):
        return dataclasses.replace(facts(*args, **kwargs), device="cuda", gpu=gpu, capability=(9, 0))

    for module in (modeling_disentangled, sdpa_attention):
        monkeypatch.setattr(module, "call_facts", on_cuda)
    if tiles is not None:
        monkeypatch.setattr(dispatch, "tiles_for", lambda *args: dict(tiles))


def model_config(**overrides) -> disentangled.DisentangledConfig:
    return disentangled.DisentangledConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        position_buckets=16, max_relative_positions=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        **overrides,
    )  # fmt: skip


@in_interpreter
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_model_through_the_kernel_matches_eager(monkeypatch, switch, layout):
    """A tiny model (head size 32) whose sdpa backend is routed through the kernel, as on CUDA: the dispatcher is
    told the device is CUDA, and every attention call must reach the kernel."""
    attend = triton_attention.triton_disentangled
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return attend(*args, **kwargs)

    on_gpu(monkeypatch, tiles=TILES)
    switch(TRITON="1")  # the self-check has tests of its own
    monkeypatch.setattr(sdpa_attention, "triton_disentangled", counted)
    torch.manual_seed(0)
    reference = disentangled.DisentangledModel(model_config())
    inflate_weights(reference)
    reference.set_attn_implementation("eager")
    ours = copy.deepcopy(reference)
    ours.set_attn_implementation("sdpa")

    batch = padded_batch(100, [23, 17])
    real = batch["attention_mask"].bool()
    lengths = batch["attention_mask"].sum(-1)
    packed = {
        "input_ids": batch["input_ids"][real][None],
        "cu_seqlens": torch.cat([torch.zeros(1), lengths.cumsum(0)]).long(),
    }
    expected = reference(**batch).last_hidden_state[real]  # [T, hidden]
    actual = ours(**batch).last_hidden_state[real] if layout == "padded" else ours(**packed).last_hidden_state[0]
    assert len(calls) == (1 if layout == "padded" else 2)  # the layer (each sequence) took the kernel
    assert max_abs_diff(actual, expected) <= 1e-5 * max(1.0, expected.abs().max().item())

    weights = torch.linspace(-1, 1, expected.numel()).view_as(expected)
    (expected * weights).sum().backward()
    (actual * weights).sum().backward()
    for (name, p), q in zip(reference.named_parameters(), ours.parameters()):
        if p.grad is not None:
            scale = max(p.grad.abs().max().item(), 1e-6)
            assert (p.grad - q.grad).abs().max().item() <= 1e-4 * scale + 1e-7, name


# The self-check on first use (`modeling/kernel_check.py`), with the interpreter's kernel on a "GPU" of 16 x 16 tiles


@pytest.fixture
def verdicts(monkeypatch, tmp_path):
    """A verdict cache of the test's own, and none in memory; the folder the verdicts are written to."""
    monkeypatch.setenv("DISENTANGLED_CACHE", str(tmp_path))
    kernel_check.forget()
    yield tmp_path / "triton-checks"
    kernel_check.forget()


def counting(monkeypatch, kernel=None) -> tuple[list, list]:
    """(the kinds the self-check compared, the calls `sdpa_attention.triton_disentangled` received), with `kernel`
    in its place where given."""
    checks, calls = [], []
    compare, attend = kernel_check._compare, kernel or triton_attention.triton_disentangled
    monkeypatch.setattr(kernel_check, "_compare", lambda kind, *args: checks.append(kind) or compare(kind, *args))
    monkeypatch.setattr(sdpa_attention, "triton_disentangled", lambda *a, **k: calls.append(1) or attend(*a, **k))
    return checks, calls


def sdpa_call(case: Case, dropout: float = 0.0, training: bool = False):
    """sdpa_disentangled on the case: the context, and the gradients where `training`."""
    if training:
        return case.run(sdpa_attention.sdpa_disentangled, dropout=dropout)
    with torch.no_grad():
        return case.run_forward(sdpa_attention.sdpa_disentangled, dropout=dropout)


@in_interpreter
@pytest.mark.parametrize("training", [False, True], ids=["forward", "training-with-dropout"])
def test_self_check_runs_once_per_kind_and_its_verdict_is_kept(monkeypatch, verdicts, training):
    """The first call of a kind runs the check, then the kernel serves it (outputs and gradients as eager's, the
    caller's random stream untouched by the check); the verdict is written; a later call and a fresh process (the
    memory forgotten, or another interpreter reading the file) check nothing; a kind that differs (a length that is
    a multiple of 16) is checked on its own. With dropout the check compares the kernel with the formula under the
    kernel's own Philox decisions (two seeds) and checks the kept fraction."""
    on_gpu(monkeypatch, tiles=TILES)
    checks, calls = counting(monkeypatch)
    case = Case(length=24, dim=32, mask="padded", terms=("c2p", "p2c", "p2p"))
    dropout = 0.1 if training else 0.0
    if not training:
        state = torch.get_rng_state()
        actual = sdpa_call(case)
        assert torch.equal(torch.get_rng_state(), state)  # the check drew nothing from the caller's generator
        with torch.no_grad():
            assert_close(actual, case.run_forward(eager_disentangled), 1e-5, "context")
    else:
        context, grads = sdpa_call(case, dropout, training=True)
        undropped = case.run(eager_disentangled)[0]
        assert context.isfinite().all() and all(grad.isfinite().all() for grad in grads if grad is not None)
        assert (context - undropped).abs().max() > 1e-3  # dropout dropped something
    assert len(checks) == 1 and checks[0].training == training and checks[0].dropout == training
    assert len(calls) == (3 if training else 2)  # the check's kernel runs (one per seed with dropout), the call
    (saved,) = verdicts.glob("*.json")
    verdict = json.loads(saved.read_text())
    assert verdict["passed"] and verdict["seconds"] > 0 and verdict["kind"]["terms"] == ["c2p", "p2c", "p2p"]
    if training:
        assert {"seed 1234567", "seed 1244432"} == set(verdict["figures"])
        assert all(entry["error"] <= entry["bound"] for entry in verdict["figures"]["seed 1234567"].values())
    sdpa_call(case, dropout, training)
    kernel_check.forget()  # as a new process: the verdict comes from the file
    sdpa_call(case, dropout, training)
    assert len(checks) == 1
    kind = checks[0]
    child = subprocess.run(
        [sys.executable, "-c", CHILD_VERDICT, json.dumps(dataclasses.asdict(kind))],
        capture_output=True, text=True, timeout=300, env=os.environ,
    )  # fmt: skip
    assert child.returncode == 0 and child.stdout.strip() == "passed", child.stderr[-2000:]
    sdpa_call(Case(length=32, dim=32, mask="padded", terms=("c2p", "p2c", "p2p")), dropout, training)
    assert len(checks) == 2 and checks[1].aligned and not kind.aligned
    from disentangled import environment

    reported = environment.self_checks()
    assert len(reported) == 2 and all(entry["passed"] and entry["current"] for entry in reported)


CHILD_VERDICT = """
import json, sys
from disentangled.modeling import kernel_check
kind = kernel_check.Kind.from_saved(json.loads(sys.argv[1]))
found = kernel_check.verdict(kind)
print("missing" if found is None else "passed" if found["passed"] else "failed")
"""


@in_interpreter
def test_a_kernel_with_wrong_numbers_is_caught_and_never_serves(monkeypatch, verdicts):
    """A kernel whose context is off by 1e-3 after its first tile of rows (a miscompile at some tile): its check
    fails with one warning that gives the figures; sdpa's path serves that call and every later one of the kind, in
    this process and the next, without checking again; the numbers returned are eager's."""
    attend = triton_attention.triton_disentangled

    def miscompiled(*args, **kwargs):
        context, probs = attend(*args, **kwargs)
        wrong = context.clone()
        wrong[:, 16:] += 1e-3
        return wrong, probs

    on_gpu(monkeypatch, tiles=TILES)
    checks, calls = counting(monkeypatch, miscompiled)
    case = Case(length=24, dim=32, mask="padded")
    with torch.no_grad():
        expected = case.run_forward(eager_disentangled)
    with pytest.warns(RuntimeWarning, match=r"failed its self-check on interpreter .* context error 0\.001") as warned:
        actual = sdpa_call(case)
    assert len(warned) == 1 and len(checks) == 1 and len(calls) == 1  # the check's run only
    assert_close(actual, expected, 1e-5, "context")
    (saved,) = verdicts.glob("*.json")
    assert not json.loads(saved.read_text())["passed"]
    for fresh in (False, True):
        if fresh:
            kernel_check.forget()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_close(sdpa_call(case), expected, 1e-5, "context")
    assert len(checks) == 1 and len(calls) == 1
    decision = dispatch.decide(dispatch.Call(**facts_of(checks[0])))
    assert decision.path == "sdpa-blocked" and "failed its self-check" in decision.describe()


def facts_of(kind: kernel_check.Kind) -> dict:
    """The facts of a call of `kind` on the interpreter's "GPU", as the dispatcher takes them."""
    return dict(
        device="cuda", gpu=kind.gpu, capability=kind.capability, dtype=getattr(torch, kind.dtype),
        head_size=kind.head_size, gradients=kind.training, dropout=0.1 if kind.dropout else 0.0,
        mask="keys" if kind.mask else "none", terms=kind.terms, length=24 if not kind.aligned else 32,
    )  # fmt: skip


@in_interpreter
def test_a_kernel_that_drops_other_entries_fails_the_check(monkeypatch, verdicts):
    """With dropout the outputs are random: the check holds the kernel to the formula under the decisions its seed
    makes (`dropout_keep_mask`). A kernel that draws them from another seed fails it, and sdpa trains instead."""
    attend = triton_attention.triton_disentangled

    def other_seed(*args, seed=None, **kwargs):
        return attend(*args, seed=None if seed is None else seed + 1, **kwargs)

    on_gpu(monkeypatch, tiles=TILES)
    checks, calls = counting(monkeypatch, other_seed)
    case = Case(length=24, dim=32, mask="padded")
    with pytest.warns(RuntimeWarning, match="failed its self-check .* dropout"):
        context, grads = sdpa_call(case, 0.1, training=True)
    assert len(checks) == 1 and context.isfinite().all() and all(g.isfinite().all() for g in grads if g is not None)
    (saved,) = verdicts.glob("*.json")
    figures = json.loads(saved.read_text())["figures"]["seed 1234567"]
    assert figures["kept fraction"]["error"] <= figures["kept fraction"]["bound"]  # the decisions themselves are fine
    assert figures["context"]["error"] > figures["context"]["bound"]


@in_interpreter
def test_the_report_names_the_path_a_call_takes_and_follows_a_switch(monkeypatch, switch, verdicts):
    """`disentangled env`'s table of paths comes from the dispatcher: for a GPU it describes, the path it reports
    is the one a call of that kind takes; switched off, both say sdpa's blocked path."""
    from disentangled import environment

    on_gpu(monkeypatch, tiles=TILES)
    checks, calls = counting(monkeypatch)
    gpu = [{"device": "cuda", "gpu": "interpreter", "capability": (9, 0)}]
    case = Case(length=24, dim=32, mask="padded")
    facts = dict(head_size=32, length=24, heads=2, width=case.positions.width)
    for value, expected in (("1", "triton"), ("0", "sdpa-blocked")):
        switch(TRITON=value)
        rows = environment.paths(gpu, **facts)
        (row,) = [row for row in rows if row["dtype"] == "float32" and row["mode"] == "inference"]
        before = len(calls)
        sdpa_call(case)
        ran = "triton" if len(calls) > before else "sdpa-blocked"
        assert row["path"] == ran == expected, (row, ran)
    assert not checks


def test_module_imports_without_triton(monkeypatch):
    """As in the Hub bundle on a machine without triton: the module imports, its tiles table reads, and it says
    triton is absent (which the dispatcher gives as its reason: `test_dispatch_takes_the_kernel_on_cuda_...`)."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("disentangled.modeling._without_triton", triton_attention.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.TRITON_AVAILABLE
    assert module.tiles_for((9, 0), torch.bfloat16, 64) == triton_tiles.tiles_for((9, 0), torch.bfloat16, 64)
