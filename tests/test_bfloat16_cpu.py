"""The bfloat16 choices of CPU inference by distance, against their float32 meaning and against eager; and the one
warning where the processor has no bfloat16 arithmetic.

In bfloat16 and float16 the c2p + p2c bias of a block is a copy of the p2c view and an add of c2p in place (one
rounding, the same sums as one add), and the T and U products read a contiguous copy of their slice of the relative
rows (oneDNN's product would otherwise copy it transposed). float32 keeps the one add and the slices as they are.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import tiny_models
import torch
from parity import inflate_weights, max_abs_diff, packed_inputs, padded_batch

import disentangled
from disentangled.modeling import cpu_inference, native
from disentangled.modeling.disentangled_attention import _by_head

TINY = dict(tiny_models.TINY, vocab_size=100, position_buckets=16, max_relative_positions=64)
VARIANTS = {
    "v3": {},
    "clipped-distances": dict(position_buckets=-1, max_relative_positions=8),
    "p2p": dict(pos_att_type="c2p|p2c|p2p"),  # not by distance: the blocked gathers, in bfloat16
}


def strided_views(dtype: torch.dtype, rows: int = 24, bands: int = 3, band: int = 8):
    """c2p as a skewed view of a T-like table and p2c as a `_band_view` of U-like bands, as the block's add reads
    them: c2p [1, H, rows, keys] (keys step by one element), p2c [1, H, rows, bands, band] (keys step by a row)."""
    generator = torch.Generator().manual_seed(0)
    heads, width = 2, rows + band - 1
    table = torch.randn(1, heads, rows, rows + bands * band, generator=generator).to(dtype)
    c2p = table.as_strided((1, heads, rows, bands * band), (*table.stride()[:2], table.stride(2) - 1, 1), rows - 1)
    storage = torch.randn(heads, 1, bands * band * width, generator=generator).to(dtype)
    p2c = storage.as_strided(
        (1, heads, rows, bands, band), (1 * storage.stride(1), storage.stride(0), 1, band * width, width - 1), band - 1
    )
    return c2p, p2c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_bias_add_of_the_views_is_the_one_rounded_sum(dtype):
    """The block's bias from `_add_by_key_chunks` equals c2p + p2c computed in float32 and rounded once, bit for bit,
    in every dtype (bfloat16 and float16 take the copy and the add in place, float32 the one add)."""
    c2p, p2c = strided_views(dtype)
    keys = c2p.shape[-1]
    out = torch.empty(c2p.shape, dtype=dtype)
    cpu_inference._add_by_key_chunks(c2p, [(slice(0, keys), p2c)], out)
    expected = (c2p.float() + p2c.flatten(-2).float()).to(dtype)
    assert torch.equal(out, expected)
    alone = torch.empty(c2p.shape, dtype=dtype)  # p2c only (no c2p term): the copy
    assert torch.equal(cpu_inference._add_by_key_chunks(None, [(slice(0, keys), p2c)], alone), p2c.flatten(-2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_products_with_a_slice_of_the_relative_rows(dtype):
    """`_by_head` against a slice of the relative rows (as the T and U products take them), into a column slice of
    a wider buffer: the float32 product within the dtype's rounding."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(1, 20, 3, 16, generator=generator).transpose(1, 2)  # [g, H, n, D], a permuted view
    relative = torch.randn(3, 50, 16, generator=generator)  # [H, E, D]
    expected = torch.einsum("ghnd,hed->ghne", rows, relative[:, 7:39])
    buffer = torch.zeros(3, 20, 40, dtype=dtype)
    actual = _by_head(rows.to(dtype), relative.to(dtype)[:, 7:39], out=buffer[..., 4:36])
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert max_abs_diff(actual.float(), expected) <= tolerance * expected.abs().max().item()
    assert buffer[..., :4].eq(0).all() and buffer[..., 36:].eq(0).all()  # only the slice was written


def build(**overrides) -> disentangled.DisentangledModel:
    torch.manual_seed(0)
    model = disentangled.DisentangledModel(disentangled.DisentangledConfig(**dict(TINY, **overrides)))
    inflate_weights(model)
    model.set_attn_implementation("eager")  # the reference (a model built from a config runs sdpa)
    return model.eval()


@pytest.mark.parametrize("path", ["kernel", "pytorch"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bfloat16_sdpa_inference_within_twice_eagers_error(monkeypatch, switch, variant, layout, path):
    """A model cast to bfloat16, long enough that blocks have keys beyond the reach (v3), several blocks and bands:
    sdpa's error against eager in float32 is at most twice eager's own bfloat16 error, padded and packed, with the
    compiled kernel making the bias (blocks of 16 rows and more: its 16 x 16 tiles) and without it."""
    if path == "kernel" and not native.available():
        pytest.skip(f"the kernel does not run here: {native.why_unavailable()}")
    switch(CPU_KERNEL=path == "kernel")
    monkeypatch.setattr(cpu_inference, "DISTANCE_BLOCK_ELEMENTS", 4 * 150 * 24)  # blocks of a few rows
    monkeypatch.setattr(cpu_inference, "DISTANCE_MIN_ROWS", 16)
    monkeypatch.setattr(cpu_inference, "BAND_TABLE_KEYS", 16)
    reference = build(**VARIANTS[variant])
    low_eager = copy.deepcopy(reference).to(torch.bfloat16)
    low_sdpa = copy.deepcopy(reference).to(torch.bfloat16)
    low_sdpa.set_attn_implementation("sdpa")
    batch = padded_batch(100, [150, 97, 120])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state[real]
        own = low_eager(**batch).last_hidden_state[real].float()
        if layout == "packed":
            actual = low_sdpa(**packed_inputs(batch)).last_hidden_state[0].float()
        else:
            actual = low_sdpa(**batch).last_hidden_state[real].float()
    assert torch.isfinite(actual).all()
    assert max_abs_diff(actual, expected) <= 2 * max_abs_diff(own, expected) + 1e-3


@pytest.fixture
def processor(monkeypatch):
    """Stands in for the processor's features (x86's flags or aarch64's Features); the one-warning state is fresh."""
    monkeypatch.setattr(native, "_bfloat16_checked", [])
    monkeypatch.delenv(native.BFLOAT16_WARNING, raising=False)

    def set_processor(machine: str, features: str) -> None:
        monkeypatch.setattr(native.platform, "machine", lambda: machine)
        monkeypatch.setattr(native, "_cpu_flags", lambda: features)

    return set_processor


def forwards(model, dtype=None, autocast=False, count=2) -> list[str]:
    """The warnings of `count` forwards (the model cast to `dtype`, or under CPU autocast to bfloat16)."""
    batch = padded_batch(100, [40, 31])
    model = copy.deepcopy(model).to(dtype) if dtype is not None else model
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(count):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                model(**batch)
    return [str(item.message) for item in caught if "bfloat16 on this CPU" in str(item.message)]


@pytest.mark.parametrize("how", ["cast", "autocast"])
@pytest.mark.parametrize(
    "machine, features, missing",
    [("x86_64", "flags : fpu sse2 avx2 fma", "avx512_bf16 or amx_bf16"), ("aarch64", "Features : fp asimd", "bf16")],
)
def test_bfloat16_without_bfloat16_arithmetic_warns_once(processor, how, machine, features, missing):
    """On a CPU without bfloat16 arithmetic the first bfloat16 forward (the model cast, or CPU autocast) warns once,
    naming the missing extensions, the measured cost and the remedies; a float32 forward does not."""
    processor(machine, features)
    model = build()
    assert forwards(model) == []  # float32: nothing, and the check is still to come
    caught = forwards(model, torch.bfloat16) if how == "cast" else forwards(model, autocast=True)
    assert len(caught) == 1
    assert f"no {missing}" in caught[0] and native.BFLOAT16_SLOWDOWN in caught[0]
    assert "float32" in caught[0] and "int8" in caught[0] and f"{native.BFLOAT16_WARNING}=0" in caught[0]
    assert forwards(model, torch.bfloat16) == []  # once per process


@pytest.mark.parametrize(
    "machine, features",
    [
        ("x86_64", "flags : fpu avx2 fma avx512f avx512bw avx512_bf16"),  # Zen 4, Cooper Lake
        ("x86_64", "flags : fpu avx2 fma avx512f avx512bw amx_bf16 amx_tile"),  # AMX
        ("aarch64", "Features : fp asimd sve bf16 i8mm"),  # Graviton 3, Neoverse V1/N2
    ],
)
def test_bfloat16_with_bfloat16_arithmetic_or_silenced_does_not_warn(monkeypatch, processor, machine, features):
    processor(machine, features)
    assert forwards(build(), torch.bfloat16) == []
    processor("x86_64", "flags : fpu sse2 avx2 fma")
    monkeypatch.setattr(native, "_bfloat16_checked", [])
    monkeypatch.setenv(native.BFLOAT16_WARNING, "0")
    assert forwards(build(), torch.bfloat16) == []
