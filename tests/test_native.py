"""The compiled kernel that makes a block's position bias (`modeling/native.py`, `modeling/position_bias.c`).

Against the formula written here with PyTorch's gather: c2p[i, δ(i - j)] + p2c[j, δ(i - j)], summed in float32
and rounded once, bit for bit, in float32 and bfloat16, over whole 16 x 16 tiles, ragged edges, tiles beyond the
buckets' reach, log buckets, clipped distances, offsets and key masks. Then the model with the kernel against eager
(outputs within the float32 tolerance). CPU training's kernels (the keys reversed: the bias, and dS summed into the
tables' gradients) against gather / scatter_add, and a training step against eager (float32 gradients to 1e-4) and
the PyTorch path. Then the fallbacks, and a failed build that leaves nothing behind.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from parity import inflate_weights, max_abs_diff, padded_batch

import disentangled
from disentangled.modeling import blocks, cpu_inference, dispatch, native
from disentangled.modeling.disentangled_attention import RelativePositions
from disentangled.modeling.workspace import int32_column

needs_kernel = pytest.mark.skipif(
    not native.available(), reason=f"the kernel does not run here: {native.why_unavailable()}"
)

# (length, span, buckets, max position): v3's own, small log buckets (runs of one column), clipped distances
POSITIONS = {
    "v3": (600, 256, 256, 512),
    "small-buckets": (300, 16, 16, 64),
    "clipped": (200, 20, -1, 20),
}


def tables(length, span, buckets, max_position, dtype, batch=2, heads=3, seed=0):
    positions = RelativePositions.build(length, span if buckets <= 0 else buckets, buckets, max_position, "cpu")
    width = positions.width
    generator = torch.Generator().manual_seed(seed)
    spare = 16  # the kernel loads 16 columns at a time, past the last row's end too

    def table():
        return torch.randn(batch * heads * length * width + spare, generator=generator).to(dtype)[:-spare]

    c2p, p2c = (table().view(batch, heads, length, width) for _ in range(2))
    return positions, c2p, p2c


def reference(positions, c2p, p2c, keep, rows: slice, keys: slice, dtype):
    """The formula, with the eager reference's dense index."""
    index = positions.dense(rows)[:, keys]  # [rows, keys]: δ(i - j) + span
    expected = torch.zeros(*(c2p if c2p is not None else p2c).shape[:2], *index.shape)
    if c2p is not None:
        expected += c2p[:, :, rows].float().gather(-1, index.expand(*c2p.shape[:2], *index.shape))
    if p2c is not None:
        transposed = index.T.expand(*p2c.shape[:2], *index.T.shape)
        expected += p2c[:, :, keys].float().gather(-1, transposed).mT
    expected = expected.to(dtype)
    if keep is not None:
        expected = expected.masked_fill(~keep.bool()[:, None, None, :], torch.finfo(dtype).min)
    return expected


def kernel_bias(positions, c2p, p2c, keep, rows: slice, keys: slice, dtype):
    """The kernel's call as `cpu_inference` makes it: c2p against Kr in reverse row order."""
    width = positions.width
    reversed_c2p = None
    if c2p is not None:  # T's columns reversed, in a buffer with spare elements after it
        spare = torch.empty(c2p[:, :, rows].numel() + 16, dtype=dtype)
        reversed_c2p = spare[:-16].view(*c2p.shape[:2], rows.stop - rows.start, width)
        reversed_c2p.copy_(c2p[:, :, rows].flip(-1))
    out = torch.empty(
        *(c2p if c2p is not None else p2c).shape[:2], rows.stop - rows.start, keys.stop - keys.start, dtype=dtype
    )
    p2c_keys = p2c[:, :, keys] if p2c is not None else None
    return native.position_bias(
        out, reversed_c2p, p2c_keys, *native.kernel_columns(positions), keep, rows.start, keys.start
    )


@needs_kernel
@pytest.mark.parametrize("terms", ["both", "c2p", "p2c"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("setting", list(POSITIONS))
def test_kernel_matches_the_formula_bit_for_bit(setting, dtype, terms):
    length, span, buckets, max_position = POSITIONS[setting]
    positions, c2p, p2c = tables(length, span, buckets, max_position, dtype)
    c2p = c2p if terms in ("both", "c2p") else None
    p2c = p2c if terms in ("both", "p2c") else None
    blocks = [  # whole tiles; ragged rows and keys; an offset block; the last rows against the first keys
        (slice(0, length), slice(0, length)),
        (slice(3, 3 + 37), slice(5, length - 2)),
        (slice(length // 2, length), slice(16, 16 + 64)),
        (slice(length - 32, length), slice(0, 48)),
    ]
    for rows, keys in blocks:
        for masked in (False, True):
            keep = None
            if masked:  # the second sequence drops its last third, the first a few keys inside
                keep = torch.ones(2, keys.stop - keys.start, dtype=torch.uint8)
                keep[1, 2 * keep.shape[1] // 3 :] = 0
                keep[0, 5:9] = 0
            expected = reference(positions, c2p, p2c, keep, rows, keys, dtype)
            actual = kernel_bias(positions, c2p, p2c, keep, rows, keys, dtype)
            assert torch.equal(actual, expected), (rows, keys, masked)


@needs_kernel
def test_kernel_beyond_the_reach_reads_the_edge_columns():
    """At 600 tokens v3's buckets stop at |d| = 511: the tiles far from the diagonal are a row constant plus a key
    bias from the first or last column; a table whose other columns are NaN shows they read nothing else."""
    length, span, buckets, max_position = POSITIONS["v3"]
    positions, c2p, p2c = tables(length, span, buckets, max_position, torch.float32)
    edges = [positions.far_columns[0], positions.far_columns[1]]
    inside = torch.ones(positions.width, dtype=torch.bool)
    inside[edges] = False
    c2p[..., inside] = float("nan")
    p2c[..., inside] = float("nan")
    rows, keys = slice(length - 64, length), slice(0, 16)  # d >= 521 > near[1] everywhere: the last column only
    assert rows.start - keys.stop + 1 >= positions.near[1]
    actual = kernel_bias(positions, c2p, p2c, None, rows, keys, torch.float32)
    assert torch.isfinite(actual).all()
    assert torch.equal(actual, reference(positions, c2p, p2c, None, rows, keys, torch.float32))


@needs_kernel
def test_kernel_keeps_nan_and_rounds_to_nearest_even():
    """bfloat16 sums that fall halfway round to the even neighbour, and NaN stays NaN, as torch's add does."""
    positions, c2p, p2c = tables(64, 8, -1, 8, torch.bfloat16, batch=1, heads=1)
    c2p.fill_(1.0)
    p2c.fill_(2.0**-8)  # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: rounds to 1
    p2c[0, 0, 3, :] = float("nan")
    rows = keys = slice(0, 64)
    actual = kernel_bias(positions, c2p, p2c, None, rows, keys, torch.bfloat16)
    expected = reference(positions, c2p, p2c, None, rows, keys, torch.bfloat16)
    assert torch.equal(actual.isnan(), expected.isnan()) and actual[..., 3].isnan().all()
    assert torch.equal(actual.nan_to_num(), expected.nan_to_num()) and actual[0, 0, 0, 0] == 1.0


def model(**overrides) -> disentangled.DisentangledModel:
    config = disentangled.DisentangledConfig(
        **dict(
            vocab_size=100,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            position_buckets=32,
            max_relative_positions=128,
        )
        | overrides
    )
    torch.manual_seed(0)
    built = disentangled.DisentangledModel(config)
    inflate_weights(built)
    built.set_attn_implementation("eager")
    return built.eval()


@needs_kernel
@pytest.mark.parametrize("split", [False, True], ids=["dense", "far-keys-split"])
@pytest.mark.parametrize("variant", ["v3", "c2p-only", "p2c-only", "clipped"])
def test_model_with_the_kernel_matches_eager_and_the_pytorch_path(monkeypatch, variant, split):
    """Default block sizes (tiles of 16 x 16), 300 tokens with padding: the kernel path against eager at float32's
    tolerance and against the pure-PyTorch path, with the far keys as a dense bias and split off."""
    overrides = {
        "v3": {},
        "c2p-only": dict(pos_att_type="c2p"),
        "p2c-only": dict(pos_att_type="p2c"),
        "clipped": dict(position_buckets=-1, max_relative_positions=24),
    }[variant]
    reference = model(**overrides)
    sdpa = copy.deepcopy(reference)
    sdpa.set_attn_implementation("sdpa")
    batch = padded_batch(100, [300, 211])
    monkeypatch.setattr(cpu_inference, "KERNEL_SPLIT_LENGTH", 0 if split else 10**9)
    used = []
    bias = cpu_inference._KernelTables.bias
    monkeypatch.setattr(cpu_inference._KernelTables, "bias", lambda *args: used.append(1) or bias(*args))
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        actual = sdpa(**batch).last_hidden_state
        with dispatch.switched(CPU_KERNEL=False):
            pytorch = sdpa(**batch).last_hidden_state
    assert used  # the kernel made the bias
    tolerance = 1e-5 * max(1.0, expected.abs().max().item())
    assert max_abs_diff(actual, expected, batch["attention_mask"]) <= tolerance
    assert max_abs_diff(actual, pytorch, batch["attention_mask"]) <= tolerance


@needs_kernel
def test_buckets_that_step_by_two_columns_take_the_pytorch_path(monkeypatch):
    """256 buckets over 300 positions step by two columns per unit of distance in places: the kernel's window of
    16 columns does not hold, so it is not used, and the output still matches eager."""
    reference = model(position_buckets=256, max_relative_positions=300)
    positions = reference.encoder.get_rel_index(300, "cpu")
    assert native.kernel_columns(positions) is None
    sdpa = copy.deepcopy(reference)
    sdpa.set_attn_implementation("sdpa")
    monkeypatch.setattr(native, "position_bias", lambda *args: pytest.fail("the kernel ran"))
    batch = padded_batch(100, [300, 120])
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        actual = sdpa(**batch).last_hidden_state
    assert max_abs_diff(actual, expected, batch["attention_mask"]) <= 1e-5 * max(1.0, expected.abs().max().item())


# CPU training's kernels (`native.hankel_bias`, `native.hankel_bias_backward`): the keys reversed, a block of rows
# "steps-by-two": 16 distances over more than 16 columns; "v3-128": v3's buckets at 128 tokens, where CPU training
# bands its tables (`cpu_training.BAND_MOST`)
HANKEL_POSITIONS = POSITIONS | {"steps-by-two": (300, 256, 256, 300), "v3-128": (128, 256, 256, 512)}


def hankel_tables(setting, dtype, rows, seed=0):
    """Block tables as BlockedAttention holds them: c2p [g, H, n, W] and p2c [g, H, L, W], each a view of an
    [H, g * rows, W] buffer."""
    length, span, buckets, max_position = HANKEL_POSITIONS[setting]
    positions = RelativePositions.build(length, span if buckets <= 0 else buckets, buckets, max_position, "cpu")
    generator = torch.Generator().manual_seed(seed)
    batch, heads, width = 2, 3, positions.width

    def table(count):
        flat = torch.randn(heads, batch * count, width, generator=generator).to(dtype)
        return flat.view(heads, batch, count, width).transpose(0, 1)

    return positions, table(rows), table(length)


def hankel_reference(positions, c2p, p2c, first, rows, grad=None):
    """The formula with PyTorch's gather and scatter_add along the Hankel index column[first + a + b], in float32:
    the bias, or, given dS, the two tables' gradients."""
    length = positions.length
    index = blocks._hankel(positions, first, rows, length)
    index = index.expand(*(c2p if c2p is not None else p2c).shape[:2], rows, length)
    if grad is None:
        bias = torch.zeros(index.shape)
        if c2p is not None:
            bias += c2p.float().gather(-1, index)
        if p2c is not None:
            bias += p2c.float().mT.gather(-2, index)
        return bias
    grad_c2p = torch.zeros(c2p.shape).scatter_add_(-1, index, grad.float()) if c2p is not None else None
    grad_p2c = torch.zeros(p2c.shape).mT.scatter_add_(-2, index, grad.float()).mT if p2c is not None else None
    return grad_c2p, grad_p2c


@needs_kernel
@pytest.mark.parametrize("terms", ["both", "c2p", "p2c"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("setting", list(HANKEL_POSITIONS))
def test_training_kernels_match_gather_and_scatter_add(setting, dtype, terms):
    """The block bias bit for bit (summed in float32, rounded once), and dS summed into the tables: float32 within
    the rounding of float32 sums of the same terms in other orders, bfloat16 within PyTorch's own bfloat16
    scatter_add error; in whole tiles and element by element, ragged rows and keys, offset blocks; the c2p gradient
    written (NaN before), the p2c one written at a group's first block and added to after."""
    length = HANKEL_POSITIONS[setting][0]
    for first, rows in [(0, 48), (7, 37), (length - 21, 21)]:
        positions, c2p, p2c = hankel_tables(setting, dtype, rows)
        c2p = c2p if terms in ("both", "c2p") else None
        p2c = p2c if terms in ("both", "p2c") else None
        column = int32_column(positions)[first:]
        grad = torch.randn(2, 3, rows, length, generator=torch.Generator().manual_seed(1)).to(dtype)
        expected = hankel_reference(positions, c2p, p2c, first, rows)
        want_c2p, want_p2c = hankel_reference(positions, c2p, p2c, first, rows, grad)
        tilings = [False, True] if native.kernel_columns(positions) is not None else [False]
        for tiled in tilings:
            out = torch.empty(2, 3, rows, length, dtype=dtype)
            assert torch.equal(native.hankel_bias(out, c2p, p2c, column, tiled), expected.to(dtype)), (first, tiled)
            got_c2p, got_p2c = (
                table.clone().fill_(float("nan")) if table is not None else None for table in (c2p, p2c)
            )
            native.hankel_bias_backward(grad, got_c2p, got_p2c, column, tiled, add_p2c=False)
            if got_p2c is not None:  # a second block of the group adds to p2c's gradient
                native.hankel_bias_backward(grad, None, got_p2c, column, tiled, add_p2c=True)
            index = blocks._hankel(positions, first, rows, length).expand_as(grad)
            for got, want, dim, calls in [(got_c2p, want_c2p, -1, 1), (got_p2c, want_p2c, -2, 2)]:
                if got is None:
                    continue
                want = calls * want
                if dtype == torch.bfloat16:  # twice PyTorch's own error: scatter_add in bfloat16, call by call
                    own = torch.zeros(want.shape, dtype=dtype)
                    for _ in range(calls):
                        (own if dim == -1 else own.mT).scatter_add_(dim, index, grad)
                    tolerance = 2 * (own.float() - want).abs().max().item()
                else:  # the kernel and scatter_add each sum the n values of dS an entry gathers (calls times) in
                    # their own order: within about sqrt(calls * n) * u * calls * sum|dS| of the exact sum, u = 2^-24
                    # (rounding errors as random, Higham & Mary 2019; in the worst case, calls * n - 1 in place of the
                    # root). Entry by entry, so an entry that gathers nothing must be exactly 0.
                    count, size = (torch.zeros(want.shape, dtype=torch.float64) for _ in range(2))
                    for total, values in [(count, torch.ones_like(grad, dtype=torch.float64)), (size, grad.abs())]:
                        (total if dim == -1 else total.mT).scatter_add_(dim, index, values.double())
                    tolerance = 2 * (calls * count).sqrt() * 2.0**-24 * calls * size
                assert torch.isfinite(got).all(), (first, tiled)
                assert ((got.float() - want).abs() <= tolerance).all(), (first, tiled, dim)


def banded(table, firsts, lines, band):
    """A [g, H, n, W] table as a banded one ([tiles, H, g, lines, band], `native.Band`): tile k holds lines k * lines ..
    from column firsts[k] on; NaN in the lines after the last (the kernel must never read them)."""
    groups, heads, count, _ = table.shape
    tiles = -(-count // lines)
    out = torch.full((tiles, heads, groups, lines, band), float("nan"), dtype=table.dtype)
    for k, first in enumerate(firsts):
        part = table[:, :, k * lines : (k + 1) * lines, first : first + band]
        out[k, :, :, : part.shape[2]] = part.transpose(0, 1)
    return out


def unbanded(table, firsts, count, width):
    """The whole [g, H, count, width] table that a banded one stands for, zeros outside its bands."""
    tiles, heads, groups, lines, band = table.shape
    out = torch.zeros(groups, heads, tiles * lines, width, dtype=table.dtype)
    for k, first in enumerate(firsts):
        out[:, :, k * lines : (k + 1) * lines, first : first + band] = table[k].transpose(0, 1)
    return out[:, :, :count]


def band_firsts(positions, first, count, lines):
    """The narrowest band (a multiple of 16) that every tile of `lines` lines reads within, from the formula: line l
    of a block at row `first` reads column[first + l + s] for s < L; and each tile's first column, moved down where
    the band would pass the table's last column."""
    length, width, column = positions.length, positions.width, positions.column.tolist()
    starts = range(first, first + count, lines)
    reach = [column[min(start + lines - 1, first + count - 1) + length - 1] - column[start] + 1 for start in starts]
    band = min(width, -(-max(reach) // 16) * 16)
    return band, [min(column[start], width - band) for start in starts]


def band_layout(positions, first, rows, lines):
    """The band and first columns of a block's c2p table (rows from `first` on) and of its group's p2c table (every
    key), one width for both (`band_firsts`), with the `native.Band` that says so."""
    (c2p_band, c2p_firsts), (p2c_band, p2c_firsts) = (
        band_firsts(positions, start, count, lines) for start, count in ((first, rows), (0, positions.length))
    )
    band = max(c2p_band, p2c_band)
    firsts = [[min(f, positions.width - band) for f in firsts] for firsts in (c2p_firsts, p2c_firsts)]
    return band, firsts, native.Band(lines, *(torch.tensor(f, dtype=torch.int32) for f in firsts))


@needs_kernel
@pytest.mark.parametrize("lines", [16, 32])
@pytest.mark.parametrize("terms", ["both", "c2p", "p2c"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("setting", list(HANKEL_POSITIONS))
def test_training_kernels_read_and_write_banded_tables(setting, dtype, terms, lines):
    """With banded tables (`native.Band`) the kernels give exactly what they give with the whole tables: the same
    bias bit for bit, and the same gradients within the bands (summed in the same order), zeros outside them; ragged
    last tiles (NaN in their unused lines), offset blocks, first columns moved down at the table's end."""
    length = HANKEL_POSITIONS[setting][0]
    for first, rows in [(0, 48), (7, 37), (length - 21, 21)]:
        positions, c2p, p2c = hankel_tables(setting, dtype, rows)
        c2p = c2p if terms in ("both", "c2p") else None
        p2c = p2c if terms in ("both", "p2c") else None
        width, column = positions.width, int32_column(positions)[first:]
        band, (c2p_firsts, p2c_firsts), spec = band_layout(positions, first, rows, lines)
        grad = torch.randn(2, 3, rows, length, generator=torch.Generator().manual_seed(1)).to(dtype)
        c2p_banded = banded(c2p, c2p_firsts, lines, band) if c2p is not None else None
        p2c_banded = banded(p2c, p2c_firsts, lines, band) if p2c is not None else None
        for tiled in [False, True] if native.kernel_columns(positions) is not None else [False]:
            whole_out, out = (torch.empty(2, 3, rows, length, dtype=dtype) for _ in range(2))
            native.hankel_bias(whole_out, c2p, p2c, column, tiled)
            assert torch.equal(native.hankel_bias(out, c2p_banded, p2c_banded, column, tiled, spec), whole_out)
            whole = [table.clone() if table is not None else None for table in (c2p, p2c)]
            got = [
                table.clone().fill_(float("nan")) if table is not None else None for table in (c2p_banded, p2c_banded)
            ]
            for tables, band_spec in [(whole, None), (got, spec)]:
                native.hankel_bias_backward(grad, *tables, column, tiled, False, band_spec)
                if tables[1] is not None:  # a second block of the group adds to p2c's gradient
                    native.hankel_bias_backward(grad, None, tables[1], column, tiled, True, band_spec)
            for want, banded_grad, firsts, count in [
                (whole[0], got[0], c2p_firsts, rows),
                (whole[1], got[1], p2c_firsts, length),
            ]:
                if want is None:
                    continue
                assert torch.equal(unbanded(banded_grad, firsts, count, width), want), (first, tiled)


@needs_kernel
def test_training_kernels_refuse_bands_that_miss_a_read():
    """A band that does not hold every column its tile reads is a ValueError before anything is read or written,
    as is a banded table of the wrong shape."""
    positions, c2p, p2c = hankel_tables("v3", torch.float32, 32)
    length, column = positions.length, int32_column(positions)
    band, firsts = band_firsts(positions, 0, 32, 32)
    table = banded(c2p, firsts, 32, band)
    out, before = torch.full((2, 3, 32, length), 7.0), table.clone()
    with pytest.raises(ValueError, match="outside its band"):
        native.hankel_bias(
            out, table, None, column, True, native.Band(32, torch.tensor([firsts[0] + 1], dtype=torch.int32), None)
        )
    with pytest.raises(ValueError, match="outside its band"):
        native.hankel_bias_backward(
            out,
            table,
            None,
            column,
            True,
            False,
            native.Band(32, torch.tensor([firsts[0] - 16], dtype=torch.int32), None),
        )
    with pytest.raises(ValueError, match="tiles"):
        native.hankel_bias(
            out, table[:, :2], None, column, True, native.Band(32, torch.tensor(firsts, dtype=torch.int32), None)
        )
    with pytest.raises(ValueError, match="multiple of 16"):
        native.hankel_bias(
            out, table, None, column, True, native.Band(24, torch.tensor(firsts, dtype=torch.int32), None)
        )
    assert (out == 7.0).all()  # nothing written: neither the bias nor (the backward's) the gradient table
    torch.testing.assert_close(table, before, rtol=0, atol=0, equal_nan=True)


def test_training_kernel_rejects_wrong_inputs():
    """Bad arguments are a ValueError naming the problem, before the kernel reads anything."""
    positions, c2p, p2c = hankel_tables("small-buckets", torch.float32, 16)
    out = torch.empty(2, 3, 16, positions.length)
    column = int32_column(positions)
    with pytest.raises(ValueError, match="int32"):
        native.hankel_bias(out, c2p, p2c, positions.column, True)
    with pytest.raises(ValueError, match="dtype"):
        native.hankel_bias(out, c2p.bfloat16(), p2c, column, True)
    with pytest.raises(ValueError, match="contiguous"):
        native.hankel_bias(out.mT, c2p, p2c, column, True)
    with pytest.raises(ValueError, match="rows \\+ keys - 1"):
        native.hankel_bias(out, c2p, p2c, column[-10:], True)


def splitmix64_keep(count: int, seed: int, threshold: int) -> torch.Tensor:
    """Dropout's decisions from the formula, in numpy's wrapping uint64 arithmetic: entry n keeps where the 15 bits
    16 (n % 4) .. of draw n / 4 are below `threshold`, draw k being SplitMix64's mix of seed + (k + 1) * gamma."""
    k = np.arange(1, (count + 3) // 4 + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + k * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    lanes = (z[:, None] >> (np.uint64(16) * np.arange(4, dtype=np.uint64))) & np.uint64(0x7FFF)
    return torch.from_numpy((lanes.reshape(-1)[:count] < threshold).astype(np.uint8))


@pytest.mark.parametrize("count", [1, 4, 4 * 1001, 4 * 1001 + 3])
@pytest.mark.parametrize("seed", [0, 2**63 + 11, 2**64 - 1])
def test_dropout_kernel_matches_the_formula_on_any_thread_count(count, seed):
    """native.keep_mask against splitmix64_keep, byte for byte, at keep probabilities 0, 0.9, 1 and on 1 and 2
    threads (each draw depends on its index alone)."""
    if not native.available():
        pytest.skip(f"the kernel does not run here: {native.why_unavailable()}")
    threads = torch.get_num_threads()
    try:
        for threshold in (0, round(0.9 * 2**15), 2**15):
            expected = splitmix64_keep(count, seed, threshold)
            for used in (1, 2):
                torch.set_num_threads(used)
                got = native.keep_mask(torch.full((count,), 7, dtype=torch.uint8), seed, threshold)
                assert torch.equal(got, expected), (threshold, used)
    finally:
        torch.set_num_threads(threads)


def test_dropout_kernel_rejects_wrong_inputs():
    if not native.available():
        pytest.skip(f"the kernel does not run here: {native.why_unavailable()}")
    with pytest.raises(ValueError, match="uint8"):
        native.keep_mask(torch.empty(8, dtype=torch.bool), 1, 100)
    with pytest.raises(ValueError, match="contiguous"):
        native.keep_mask(torch.empty(8, 2, dtype=torch.uint8).mT, 1, 100)
    with pytest.raises(ValueError, match="threshold"):
        native.keep_mask(torch.empty(8, dtype=torch.uint8), 1, 2**15 + 1)
    with pytest.raises(ValueError, match="seed"):
        native.keep_mask(torch.empty(8, dtype=torch.uint8), -1, 100)


def parameter_gradients(built, batch) -> dict[str, torch.Tensor]:
    built.zero_grad(set_to_none=True)
    built(**batch).last_hidden_state[batch["attention_mask"].bool()].float().square().mean().backward()
    return {name: parameter.grad for name, parameter in built.named_parameters() if parameter.grad is not None}


@needs_kernel
@pytest.mark.parametrize("variant", ["v3", "c2p-only", "p2c-only", "clipped", "steps-by-two"])
def test_model_training_with_the_kernel_matches_eager_and_the_pytorch_path(monkeypatch, variant):
    """A training step of the model on the CPU (blocks of 64 rows: whole tiles, ragged edges, a group's p2c gradient
    over several blocks) with the kernel: float32 gradients against eager to 1e-4 and against gather / scatter_add
    to 1e-5; bfloat16 (the model cast) within twice the PyTorch path's own error against float32. "steps-by-two"
    runs the kernel element by element (its columns do not fit the tiles)."""
    overrides = {
        "v3": {},
        "c2p-only": dict(pos_att_type="c2p"),
        "p2c-only": dict(pos_att_type="p2c"),
        "clipped": dict(position_buckets=-1, max_relative_positions=24),
        "steps-by-two": dict(position_buckets=256, max_relative_positions=300),
    }[variant]
    reference = model(**overrides)
    sdpa = copy.deepcopy(reference)
    sdpa.set_attn_implementation("sdpa")
    batch = padded_batch(100, [300, 211])
    monkeypatch.setattr(blocks, "SDPA_BLOCK_ELEMENTS", 4 * 300 * 64)
    calls = []
    kernel = native.hankel_bias_backward
    monkeypatch.setattr(native, "hankel_bias_backward", lambda *args: calls.append(args[4]) or kernel(*args))
    expected = parameter_gradients(reference, batch)
    actual = parameter_gradients(sdpa, batch)
    assert calls and all(tiled == (variant != "steps-by-two") for tiled in calls)
    with dispatch.switched(TRAINING_KERNEL=False):
        pytorch = parameter_gradients(sdpa, batch)
    for name, want in expected.items():  # (a gradient that is 0 in exact arithmetic is ~1e-10 here: the floor)
        scale = max(want.abs().max().item(), 1e-5)
        assert max_abs_diff(actual[name], want) <= 1e-4 * scale, name
        assert max_abs_diff(actual[name], pytorch[name]) <= 1e-5 * scale, name
    low = copy.deepcopy(sdpa).to(torch.bfloat16)
    with dispatch.switched(TRAINING_KERNEL=False):
        low_pytorch = parameter_gradients(low, batch)
    low_kernel = parameter_gradients(low, batch)
    for name, want in expected.items():
        own = max_abs_diff(low_pytorch[name].float(), want)
        assert max_abs_diff(low_kernel[name].float(), want) <= 2 * own + 1e-3 * want.abs().max().item(), name


def fresh_state(monkeypatch, tmp_path, **environment):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("DISENTANGLED_CACHE", str(tmp_path / "cache"))
    for name, value in environment.items():
        monkeypatch.setenv(name, value)


def test_failed_build_falls_back_and_leaves_nothing(monkeypatch, tmp_path):
    """A compiler that fails: `available()` is False with the reason, no library (or partial file) is left in the
    cache, and the model runs on the PyTorch path."""
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    failing.chmod(0o755)
    fresh_state(monkeypatch, tmp_path, CC=str(failing))
    chosen, reason = native.instruction_set()
    if chosen == "none":
        assert not native.available() and native.why_unavailable() == reason
        return
    assert not native.available()
    assert "compiling position_bias.c failed" in native.why_unavailable()
    assert not any(path.is_file() for path in (tmp_path / "cache").rglob("*"))
    reference = model()
    sdpa = copy.deepcopy(reference)
    sdpa.set_attn_implementation("sdpa")
    batch = padded_batch(100, [200, 150])
    with torch.no_grad():
        expected, actual = reference(**batch).last_hidden_state, sdpa(**batch).last_hidden_state
    assert max_abs_diff(actual, expected, batch["attention_mask"]) <= 1e-5 * max(1.0, expected.abs().max().item())


def test_turned_off_by_the_environment(monkeypatch, tmp_path):
    fresh_state(monkeypatch, tmp_path, DISENTANGLED_NATIVE="0")
    assert not native.available() and "DISENTANGLED_NATIVE=0" in native.why_unavailable()


def test_turned_off_by_the_instruction_set_none(monkeypatch, tmp_path):
    fresh_state(monkeypatch, tmp_path, DISENTANGLED_CPU_ISA="none")
    assert native.instruction_set()[0] == "none"
    assert not native.available() and "DISENTANGLED_CPU_ISA=none" in native.why_unavailable()
    assert not native.attend_available(torch.float32)


@pytest.mark.parametrize(
    "machine, features, sets",
    [  # /proc/cpuinfo's feature line (x86's flags, aarch64's Features) -> the sets, best first
        ("x86_64", "flags : fpu sse2 avx2 fma avx512f avx512bw avx512vl amx_bf16", ["avx512", "avx2", "none"]),
        ("x86_64", "flags : fpu sse2 avx avx2 fma bmi2", ["avx2", "none"]),
        ("x86_64", "flags : fpu sse2 avx avx512f", ["none"]),  # AVX-512 F without BW, and no AVX2
        ("aarch64", "Features : fp asimd evtstrm aes sve bf16 i8mm", ["neon", "none"]),
        ("aarch64", "Features : fp", ["none"]),
        ("riscv64", "isa : rv64imafdc", ["none"]),
    ],
)
def test_instruction_sets_from_the_processor_features(monkeypatch, machine, features, sets):
    """x86 reads its flags, aarch64 its Features (not an x86 flag name); an impossible request names what the
    processor runs, an unknown one the sets there are."""
    monkeypatch.setattr(native.platform, "machine", lambda: machine)
    monkeypatch.setattr(native, "_cpu_flags", lambda: features)
    monkeypatch.setattr(native.sys, "platform", "linux")
    monkeypatch.delenv("DISENTANGLED_NATIVE", raising=False)
    monkeypatch.delenv("DISENTANGLED_CPU_ISA", raising=False)
    assert native._processor_sets()[0] == sets
    assert native.instruction_set()[0] == sets[0]
    for name in native.INSTRUCTION_SETS:
        monkeypatch.setenv("DISENTANGLED_CPU_ISA", name)
        if name in sets:
            assert native.instruction_set() == (name, native.instruction_set()[1])
            assert f"DISENTANGLED_CPU_ISA={name}" in native.instruction_set()[1]
        else:
            with pytest.raises(ValueError, match=f"DISENTANGLED_CPU_ISA={name}: .* runs {', '.join(sets)}"):
                native.instruction_set()
    monkeypatch.setenv("DISENTANGLED_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="avx512, avx2, neon, none"):
        native.instruction_set()


def test_aarch64_without_cpuinfo_reads_the_hardware_capabilities(monkeypatch):
    """Where /proc/cpuinfo has no Features line, NEON comes from the kernel's HWCAP bits (getauxval)."""
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(native, "_cpu_flags", lambda: "")

    class Libc:
        def __init__(self, hwcap):
            self.getauxval = lambda key: hwcap if key == 16 else 0

    for hwcap, sets in [(0b10, ["neon", "none"]), (0b01, ["none"])]:
        monkeypatch.setattr(native.ctypes, "CDLL", lambda name, hwcap=hwcap: Libc(hwcap))
        assert native._processor_sets()[0] == sets


@pytest.mark.parametrize("name", ["avx512", "avx2", "neon"])
def test_each_set_the_processor_runs_builds_and_says_so(monkeypatch, tmp_path, name):
    """DISENTANGLED_CPU_ISA builds each set this processor runs (AVX2 on an AVX-512 machine: the flags keep AVX-512
    out), into a cache file of its own; the library says which set it was built for, and the bias matches the formula
    bit for bit."""
    if name not in native._processor_sets()[0]:
        pytest.skip(f"this processor does not run {name}: {native._processor_sets()[1]}")
    fresh_state(monkeypatch, tmp_path, DISENTANGLED_CPU_ISA=name)
    assert native.instruction_set()[0] == name
    assert native.available(), native.why_unavailable()
    assert native._library().instruction_set().decode() == name
    assert [path.name.split("-")[1] for path in (tmp_path / "cache").glob("position_bias-*.so")] == [name]
    positions, c2p, p2c = tables(*POSITIONS["v3"], torch.float32)
    rows, keys = slice(3, 3 + 37), slice(5, 300)
    expected = reference(positions, c2p, p2c, None, rows, keys, torch.float32)
    assert torch.equal(kernel_bias(positions, c2p, p2c, None, rows, keys, torch.float32), expected)


@needs_kernel
def test_build_is_cached_and_reused(monkeypatch, tmp_path):
    """The first use compiles into the cache, the next process reuses the file."""
    fresh_state(monkeypatch, tmp_path)
    assert native.available()
    built = list((tmp_path / "cache").glob("position_bias-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_state", {})
    assert native.available() and built[0].stat().st_mtime_ns == stamp


def test_the_kernel_source_ships_with_the_package_not_the_bundle():
    """The C source and its vector headers are package data beside native.py (pyproject's package-data names them);
    the Hub bundle carries neither them nor native.py, so remote code runs on PyTorch alone."""
    from pathlib import Path

    from disentangled.conversion.bundle import bundle_sources

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

    assert native.SOURCE.is_file() and all(header.is_file() for header in native.HEADERS)
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["disentangled.modeling"]
    assert {native.SOURCE.name, *(header.name for header in native.HEADERS)} <= set(shipped)
    assert "native.py" not in bundle_sources() and not any(name.endswith((".c", ".h")) for name in bundle_sources())
