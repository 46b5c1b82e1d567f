"""Attention with the position terms made inside the tile (`native.attend`): bfloat16 on AMX, float32 with any vector
set (AVX-512, AVX2 + FMA, NEON).

Against the formula written here in float32 (scale q.k + q.Kr[δ(i - j)] + k.Qr[δ(i - j)], softmax, times v): in
bfloat16 within twice the bfloat16 rounding of the formula's own result (plus one bfloat16 step of the values), in
float32 within 1e-5, over v3's buckets with tiles beyond the reach, small log buckets, clipped distances, either
term alone, ragged rows and keys, key masks over a span of keys, and more threads than planes. Then the model against
eager (float32: 1e-5; bfloat16: within twice eager's own bfloat16 error against float32), the fallbacks where the
fused kernel does not run, PyTorch's own AMX operators before and after it (its tiles are released and configured
per call), and the kernel built as for processors with AVX-512 but no AMX.
"""

from __future__ import annotations

import copy

import pytest
import torch
from parity import inflate_weights, max_abs_diff, packed_inputs, padded_batch

import disentangled
from disentangled.modeling import dispatch, native
from disentangled.modeling.disentangled_attention import RelativePositions

needs_amx = pytest.mark.skipif(
    not native.attend_available(), reason="the fused kernel needs AMX and AVX512-BF16 (and the compiled kernel)"
)
DTYPES = [
    pytest.param(torch.bfloat16, id="bfloat16", marks=needs_amx),
    pytest.param(
        torch.float32,
        id="float32",
        marks=pytest.mark.skipif(not native.available(), reason=f"no kernel here: {native.why_unavailable()}"),
    ),
]

# (length, span, buckets, max position): v3's own, small log buckets (runs of one column), clipped distances
POSITIONS = {
    "v3": (600, 256, 256, 512),
    "small-buckets": (300, 16, 16, 64),
    "clipped": (200, 20, -1, 20),
}
SCALE = 0.125


def inputs(length, span, buckets, max_position, batch=2, heads=3, seed=0, dtype=torch.bfloat16):
    positions = RelativePositions.build(length, span if buckets <= 0 else buckets, buckets, max_position, "cpu")
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16).to(dtype)

    # the layout the model hands over: [B, H, L, 64] views of [B, L, H, 64]
    query, key, value = (randn(batch, length, heads, 64).transpose(1, 2) for _ in range(3))
    pos_key, pos_query = (randn(heads, positions.width, 64, scale=0.3) for _ in range(2))
    return positions, query, key, value, pos_key, pos_query


def formula(positions, query, key, value, pos_key, pos_query, keep, keys: slice):
    """The attention of every row over the keys of `keys` that `keep` marks, in float32 from the bfloat16 inputs,
    with the eager reference's dense index δ(i - j)."""
    query, key, value = query.float(), key[:, :, keys].float(), value[:, :, keys].float()
    scores = query @ key.mT * SCALE
    index = positions.dense()[:, keys]  # [L, keys]
    if pos_key is not None:
        c2p = query @ pos_key.float().mT  # [B, H, L, W]
        scores += c2p.gather(-1, index.expand(*c2p.shape[:2], *index.shape))
    if pos_query is not None:
        p2c = key @ pos_query.float().mT  # [B, H, keys, W]
        scores += p2c.gather(-1, index.T.expand(*p2c.shape[:2], *index.T.shape)).mT
    if keep is not None:
        scores = scores.masked_fill(~keep.bool()[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)  # [B, L, H, 64]


def fused(positions, query, key, value, pos_key, pos_query, keep, keys: slice):
    """The kernel's call as `cpu_inference._attend_fused` makes it: Kr's rows reversed, both padded to a multiple
    of 16 rows, in the key tiles' layout."""
    width = -(-positions.width // 16) * 16

    def tiles(rows, reverse):
        if rows is None:
            return None
        rows = rows.flip(1) if reverse else rows
        return native.as_key_tiles(torch.nn.functional.pad(rows, (0, 0, 0, width - rows.shape[1])))

    out = torch.full((query.shape[0], query.shape[2], query.shape[1], 64), float("nan"), dtype=query.dtype)
    workspace = torch.empty(native.workspace_bytes(keys.stop - keys.start, width), dtype=torch.uint8)
    column, c2p_column = native.kernel_columns(positions)
    native.attend(
        out, query, key, value, tiles(pos_key, True), tiles(pos_query, False), column, c2p_column,
        keep, keys, SCALE, workspace,
    )  # fmt: skip
    return out


def within(actual, expected, value):
    """float32: 1e-5 of the largest output. bfloat16: twice the bfloat16 rounding of the formula's result, plus a
    bfloat16 step of the largest value (the kernel rounds the softmax weights to bfloat16 for the product with v)."""
    if actual.dtype == torch.float32:
        tolerance = 1e-5 * max(1.0, expected.abs().max().item())
    else:
        rounding = max_abs_diff(expected.to(torch.bfloat16).float(), expected)
        tolerance = 2 * rounding + 2**-8 * value.float().abs().max().item()
    error = max_abs_diff(actual.float(), expected)
    assert error <= tolerance, (error, tolerance)
    return error


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("terms", ["both", "c2p", "p2c"])
@pytest.mark.parametrize("setting", list(POSITIONS))
def test_fused_kernel_matches_the_formula(setting, terms, dtype):
    positions, query, key, value, pos_key, pos_query = inputs(*POSITIONS[setting], dtype=dtype)
    pos_key = pos_key if terms in ("both", "c2p") else None
    pos_query = pos_query if terms in ("both", "p2c") else None
    length = query.shape[2]
    for keys, masked in [(slice(0, length), False), (slice(0, length), True), (slice(7, length - 21), True)]:
        keep = None
        if masked:  # the second sequence drops its last third, the first a few keys inside
            keep = torch.ones(2, keys.stop - keys.start, dtype=torch.uint8)
            keep[1, 2 * keep.shape[1] // 3 :] = 0
            keep[0, 5:9] = 0
        expected = formula(positions, query, key, value, pos_key, pos_query, keep, keys)
        actual = fused(positions, query, key, value, pos_key, pos_query, keep, keys)
        within(actual, expected, value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [1, 5, 16, 17, 130])
def test_fused_kernel_short_and_ragged_inputs(length, dtype):
    """Fewer rows and keys than a tile, one more than a tile, and a key block plus a ragged tile."""
    positions, query, key, value, pos_key, pos_query = inputs(length, 256, 256, 512, dtype=dtype)
    keys = slice(0, length)
    expected = formula(positions, query, key, value, pos_key, pos_query, None, keys)
    within(fused(positions, query, key, value, pos_key, pos_query, None, keys), expected, value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("threads", [1, 4])
def test_fused_kernel_with_more_threads_than_planes(threads, heads, dtype):
    """Planes fewer than threads split their rows into parts, each packing the plane and making U only where its
    rows read it: one plane on 4 threads in 4 parts, three planes in 6 parts (a thread takes two parts of one
    plane, and must make U again for the second); on 1 thread each plane is one part. The same bits every way."""
    positions, query, key, value, pos_key, pos_query = inputs(300, 256, 256, 512, batch=1, heads=heads, dtype=dtype)
    keys = slice(0, 300)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        actual = fused(positions, query, key, value, pos_key, pos_query, None, keys)
        torch.set_num_threads(2)
        two = fused(positions, query, key, value, pos_key, pos_query, None, keys)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(actual, two)
    within(actual, formula(positions, query, key, value, pos_key, pos_query, None, keys), value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_with_no_key_comes_out_zero(dtype):
    positions, query, key, value, pos_key, pos_query = inputs(40, 256, 256, 512, batch=1, heads=2, dtype=dtype)
    keep = torch.zeros(1, 40, dtype=torch.uint8)
    assert fused(positions, query, key, value, pos_key, pos_query, keep, slice(0, 40)).eq(0).all()


@needs_amx
def test_pytorchs_amx_operators_are_unchanged_around_it():
    """oneDNN's bfloat16 products and the CPU flash attention configure AMX tiles too: the same calls before and
    after the fused kernel (which configures its own and releases them) give the same bits."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, generator=generator).to(torch.bfloat16) for _ in range(3))
    a, b = (torch.randn(300, 256, generator=generator).to(torch.bfloat16) for _ in range(2))

    def pytorch():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v), a @ b.T

    before = pytorch()
    positions, query, key, value, pos_key, pos_query = inputs(600, 256, 256, 512)
    fused(positions, query, key, value, pos_key, pos_query, None, slice(0, 600))
    after = pytorch()
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def model(**overrides) -> disentangled.DisentangledModel:
    """64 dimensions per head, as every released DeBERTa has (the fused kernel's only size)."""
    config = disentangled.DisentangledConfig(
        **dict(
            vocab_size=100,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=256,
            position_buckets=32,
            max_relative_positions=128,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        | overrides
    )
    torch.manual_seed(0)
    built = disentangled.DisentangledModel(config)
    inflate_weights(built)
    built.set_attn_implementation("eager")
    return built.eval()


VARIANTS = {
    "v3": {},
    "c2p-only": dict(pos_att_type="c2p"),
    "p2c-only": dict(pos_att_type="p2c"),
    "clipped": dict(position_buckets=-1, max_relative_positions=24),
}


@needs_amx
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_sequences_in_bfloat16_within_twice_eagers_error(monkeypatch, variant):
    """Packed sequences ([1, T] with cu_seqlens) run one sequence at a time, each through the fused kernel: within
    twice eager's own bfloat16 error of the padded batch in float32."""
    reference = model(**VARIANTS[variant])
    low_eager = copy.deepcopy(reference).to(torch.bfloat16)
    low_sdpa = copy.deepcopy(reference).to(torch.bfloat16)
    low_sdpa.set_attn_implementation("sdpa")
    batch = padded_batch(100, [300, 211, 17])
    real = batch["attention_mask"].bool()
    packed = packed_inputs(batch)
    calls = []
    attend = native.attend
    monkeypatch.setattr(native, "attend", lambda *args: calls.append(1) or attend(*args))
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state[real]
        own = low_eager(**batch).last_hidden_state[real].float()
        actual = low_sdpa(**packed).last_hidden_state[0].float()
    assert len(calls) == 3 * reference.config.num_hidden_layers  # each sequence, each layer
    assert max_abs_diff(actual, expected) <= 2 * max_abs_diff(own, expected) + 1e-3


@needs_amx
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_in_bfloat16_within_twice_eagers_error(monkeypatch, variant):
    """A bfloat16 model through the fused kernel (padded batch, one sequence of padding only): its error against
    eager in float32 is at most twice eager's own bfloat16 error, and so is the unfused kernel path's."""
    reference = model(**VARIANTS[variant])
    low_eager = copy.deepcopy(reference).to(torch.bfloat16)
    low_sdpa = copy.deepcopy(reference).to(torch.bfloat16)
    low_sdpa.set_attn_implementation("sdpa")
    batch = padded_batch(100, [300, 211, 1])
    batch["attention_mask"][2] = 0  # padding only: uniform attention over every key, as in eager
    real = batch["attention_mask"].bool()
    calls = []
    attend = native.attend
    monkeypatch.setattr(native, "attend", lambda *args: calls.append(1) or attend(*args))
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        own = low_eager(**batch).last_hidden_state.float()
        actual = low_sdpa(**batch).last_hidden_state.float()
        assert calls  # the fused kernel ran
        with dispatch.switched(CPU_FUSED=False):
            unfused = low_sdpa(**batch).last_hidden_state.float()
    assert torch.isfinite(actual).all()
    bound = 2 * max_abs_diff(own, expected, real) + 1e-3
    assert max_abs_diff(actual, expected, real) <= bound
    assert max_abs_diff(unfused, expected, real) <= bound
    # the sequence of padding only: eager's uniform attention, within the same bound
    assert max_abs_diff(actual[2], expected[2]) <= 2 * max_abs_diff(own[2], expected[2]) + 1e-3


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.skipif(not native.available(), reason=f"no kernel here: {native.why_unavailable()}")
def test_model_in_float32_matches_eager(monkeypatch, variant, layout):
    """float32 through the fused kernel (vector products): padded with a sequence of padding only, and packed;
    eager's outputs to 1e-5 of their largest, and the bias kernel's path to the same."""
    reference = model(**VARIANTS[variant])
    sdpa = copy.deepcopy(reference)
    sdpa.set_attn_implementation("sdpa")
    batch = padded_batch(100, [300, 211, 1])
    batch["attention_mask"][2] = 0
    real = batch["attention_mask"].bool()
    if layout == "packed":
        batch = padded_batch(100, [300, 211, 17])
        real = batch["attention_mask"].bool()
        packed = packed_inputs(batch)
    calls = []
    attend = native.attend
    monkeypatch.setattr(native, "attend", lambda *args: calls.append(1) or attend(*args))
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        inputs_ = packed if layout == "packed" else batch

        def ours():
            output = sdpa(**inputs_).last_hidden_state
            return output[0] if layout == "packed" else output[real]

        actual = ours()
        assert calls
        with dispatch.switched(CPU_FUSED=False):
            unfused = ours()
    tolerance = 1e-5 * max(1.0, expected.abs().max().item())
    assert max_abs_diff(actual, expected[real]) <= tolerance
    assert max_abs_diff(actual, unfused) <= tolerance
    if layout == "padded":  # the sequence of padding only: eager's uniform attention
        assert max_abs_diff(sdpa(**batch).last_hidden_state[2], expected[2]) <= tolerance


CASES = ["float16", "float32-turned-off", "head-size-32", "mask-of-pairs", "no-amx", "workspace", "p2p"]


@pytest.mark.parametrize("case", CASES)
def test_where_the_fused_kernel_does_not_run_the_others_do(monkeypatch, switch, case):
    """float16, float32 with CPU_FUSED off, heads of another size, a [B, L, L] mask of query-key
    pairs, bfloat16 on a processor without AMX, a workspace beyond FUSED_WORKSPACE_BYTES and the p2p term take the
    other paths; the output still matches eager."""
    overrides = {"head-size-32": dict(hidden_size=64), "p2p": dict(pos_att_type="c2p|p2c|p2p")}.get(case, {})
    reference = model(**overrides)
    dtype = {"float16": torch.float16, "float32-turned-off": torch.float32}.get(case, torch.bfloat16)
    eager, sdpa = copy.deepcopy(reference).to(dtype), copy.deepcopy(reference).to(dtype)
    sdpa.set_attn_implementation("sdpa")
    if case == "float32-turned-off":
        switch(CPU_FUSED=False)
    if case == "no-amx":
        monkeypatch.setattr(dispatch, "native_attend", lambda dtype: dtype != torch.bfloat16)
    if case == "workspace":
        monkeypatch.setattr(dispatch, "FUSED_WORKSPACE_BYTES", 1024)
    calls = []
    monkeypatch.setattr(native, "attend", lambda *args: calls.append(1))
    batch = padded_batch(100, [150, 97])
    real = batch["attention_mask"].bool()
    if case == "mask-of-pairs":  # the same padding, as pairs: every query row of a sequence to its own keys
        batch["attention_mask"] = batch["attention_mask"][:, :, None] * batch["attention_mask"][:, None, :]
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state[real]
        own = eager(**batch).last_hidden_state[real].float()
        actual = sdpa(**batch).last_hidden_state[real].float()
    assert not calls
    assert max_abs_diff(actual, expected) <= 2 * max_abs_diff(own, expected) + 1e-5


@needs_amx
def test_training_never_runs_it_and_float32_gradients_match_eager(monkeypatch):
    """With gradients the fused kernel (inference only) is not called: a bfloat16 model with gradients goes the
    blocked way, and float32 gradients match eager's to 1e-4."""
    reference = model()
    sdpa = copy.deepcopy(reference)
    sdpa.set_attn_implementation("sdpa")
    calls = []
    monkeypatch.setattr(native, "attend", lambda *args: calls.append(1))
    batch = padded_batch(100, [150, 97])
    copy.deepcopy(sdpa).to(torch.bfloat16)(**batch).last_hidden_state.float().sum().backward()
    for built in (reference, sdpa):
        built(**batch).last_hidden_state[batch["attention_mask"].bool()].square().mean().backward()
    assert not calls
    for (name, theirs), ours in zip(reference.named_parameters(), sdpa.parameters()):
        if theirs.grad is not None:
            scale = theirs.grad.abs().max().item()
            assert max_abs_diff(ours.grad, theirs.grad) <= 1e-4 * max(scale, 1e-8), name


# Built as for processors with AVX-512 but no AMX: Xeons from Skylake to Cascade Lake (AVX-512 F, BW, VL, DQ), and
# AMD EPYC from Zen 4 (AVX512-BF16 too, no AMX), here by turning AMX off on this processor's own flags.
WITHOUT_AMX = {
    "skylake-avx512": ("-march=skylake-avx512",),
    "native-without-amx": ("-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
}


@pytest.mark.skipif(
    "avx512" not in native._processor_sets()[0], reason=f"no AVX-512 here: {native._processor_sets()[1]}"
)
@pytest.mark.parametrize("target", list(WITHOUT_AMX))
def test_built_without_amx_float32_runs_fused_and_bfloat16_does_not(monkeypatch, tmp_path, target):
    """The source builds for those processors (a header it needs only with AMX once kept it from building there at
    all); its float32 attention matches the formula and runs in the model, which matches eager to 1e-5; bfloat16
    says the attention is not there and takes the bias kernel and SDPA, within twice eager's own error."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("DISENTANGLED_CACHE", str(tmp_path))
    flags = tuple(flag for flag in native.flags_for("avx512") if not flag.startswith("-march")) + WITHOUT_AMX[target]
    library = native._build(flags, "avx512")
    assert library is not None, native._state.get("why")
    monkeypatch.setattr(native, "_state", {"library": library})
    assert native.available() and native.attend_available(torch.float32)
    assert not native.attend_available(torch.bfloat16)

    positions, query, key, value, pos_key, pos_query = inputs(*POSITIONS["v3"], dtype=torch.float32)
    keys = slice(0, query.shape[2])
    expected = formula(positions, query, key, value, pos_key, pos_query, None, keys)
    within(fused(positions, query, key, value, pos_key, pos_query, None, keys), expected, value)

    reference = model()
    sdpa = copy.deepcopy(reference)
    sdpa.set_attn_implementation("sdpa")
    low_eager = copy.deepcopy(reference).to(torch.bfloat16)
    low_sdpa = copy.deepcopy(sdpa).to(torch.bfloat16)
    batch = padded_batch(100, [150, 97])
    real = batch["attention_mask"].bool()
    calls = []
    attend = native.attend
    monkeypatch.setattr(native, "attend", lambda *args: calls.append(args[1].dtype) or attend(*args))
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state[real]
        actual = sdpa(**batch).last_hidden_state[real]
        own = low_eager(**batch).last_hidden_state[real].float()
        low = low_sdpa(**batch).last_hidden_state[real].float()
    assert calls and set(calls) == {torch.float32}
    assert max_abs_diff(actual, expected) <= 1e-5 * max(1.0, expected.abs().max().item())
    assert max_abs_diff(low, expected) <= 2 * max_abs_diff(own, expected) + 1e-3
