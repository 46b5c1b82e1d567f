"""The C code trusts no input (SECURITY.md, "Native code"): every value a kernel indexes with is checked before it is
used, by the ONNX operator for a graph's inputs and by the kernels' entries (position_bias.h and .c) for any caller.

The contract (position_bias.h, above column_fault) is written again here, in Python, as `columns_hold`: each column
in [0, W), ascending by at most one column per entry where tiles run (so 16 consecutive entries lie within 16
columns), c2p_column column's mirror. Then, for the operator
through ONNX Runtime and for each ctypes entry: the hostile cases a reviewer found (out-of-range, negative, extreme,
unordered columns, two columns per distance, tables of width 0, overflowing heads, empty inputs, NaN), and generated
inputs of every such kind (hypothesis), each of which must end in a clean error when `columns_hold` says no and in the
formula's numbers (written here, element by element of the inputs as given) when it says yes. CI runs this file under
AddressSanitizer and UndefinedBehaviorSanitizer too (.ci/run), where a read or write outside a buffer fails it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parity import inflate_weights
from test_onnx_export import run_cli
from test_onnx_kernel import operator_graph

import disentangled
from disentangled import DisentangledConfig
from disentangled.modeling import native
from disentangled.serving import ort_operator

onnxruntime = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

needs_kernel = pytest.mark.skipif(not native.available(), reason=f"no kernel here: {native.why_unavailable()}")
needs_operator = pytest.mark.skipif(
    ort_operator.why_unavailable() is not None, reason=f"no operator library: {ort_operator.why_unavailable()}"
)
DIM, SCALE = 64, 0.125
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def columns_hold(column: np.ndarray, c2p_column: np.ndarray | None, width: int, tiled: bool = True) -> bool:
    """The kernels' contract on column vectors, from its words in position_bias.h."""
    for vector in (column, c2p_column):
        if vector is None:
            continue
        vector = vector.astype(np.int64)
        if len(vector) and (vector.min() < 0 or vector.max() >= width):
            return False
        if (np.diff(vector) < 0).any():
            return False
        if tiled and (np.diff(vector) > 1).any():  # one distance more: the same column or the next
            return False
    if c2p_column is not None and len(column):
        sums = c2p_column.astype(np.int64) + column[::-1].astype(np.int64)
        return bool((sums == sums[0]).all())
    return True


def valid_columns(length: int, width: int, step: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Columns as a bucketing makes them: distance d at d + L - 1, ascending by at most `step`, clipped to [0, W'),
    W' <= W; and c2p's mirror."""
    reach = max(1, width // 2)
    distance = np.arange(1 - length, length)
    column = np.clip(distance * step + reach, 0, width - 1).astype(np.int32)
    return column, ((width - 1) - column[::-1]).astype(np.int32)


def tiles(rows: np.ndarray) -> np.ndarray:
    """[H, W, 64] rows in the operator's layout [H, W / 16, 64, 16] (native.as_key_tiles, float32)."""
    heads, width, dim = rows.shape
    return np.ascontiguousarray(rows.reshape(heads, width // 16, 16, dim).transpose(0, 1, 3, 2))


def formula(query, key, value, pos_key, pos_query, column, c2p_column, keep, scale):
    """The operator's output from its inputs as given: [B, H, L, 64] in, [B, L, H * 64] out;
    scores[i, j] = scale q_i . k_j + q_i . Kr'[c2p_column[L - 1 - i + j]] + k_j . Qr[column[i - j + L - 1]]
    (Kr' the rows of pos_key as given), keys with keep 0 left out, a sequence of padding uniform over every key."""
    batch, heads, length, dim = query.shape
    scores = scale * query @ key.mT
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    if pos_key is not None:
        rows = pos_key[:, torch.from_numpy(c2p_column).long()[length - 1 - i + j]]  # [H, L, L, 64]
        scores = scores + torch.einsum("bhid,hijd->bhij", query, rows)
    if pos_query is not None:
        rows = pos_query[:, torch.from_numpy(column).long()[i - j + length - 1]]
        scores = scores + torch.einsum("bhjd,hijd->bhij", key, rows)
    if keep is not None:
        scores = scores.masked_fill(~torch.from_numpy(keep).bool()[:, None, None, :], -math.inf)
    weights = scores.softmax(-1)
    if keep is not None:
        weights[torch.from_numpy(~keep.astype(bool).any(-1))] = 1.0 / length
    return (weights @ value).transpose(1, 2).reshape(batch, length, heads * dim)


# ---- The operator through ONNX Runtime ----

_sessions: dict = {}


def operator_session(with_key: bool, with_query: bool, with_keep: bool, heads: int, scale: float = SCALE):
    """A session of one disentangled::Attention node whose every input is a graph input; ONNX Runtime's memory arena
    off, so that each tensor is an allocation of its own (the sanitizers see a read past any of them)."""
    key = (with_key, with_query, with_keep, heads, scale)
    if key not in _sessions:
        model = operator_graph(with_key, with_query, with_keep, heads, scale)
        options = onnxruntime.SessionOptions()
        options.enable_cpu_mem_arena = False
        ort_operator.register(options)
        _sessions[key] = onnxruntime.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    return _sessions[key]


def case(batch=2, heads=2, length=20, width=32, terms="both", masked=True, seed=0):
    """Inputs of the operator, valid ones: (feeds, the [B, H, L, 64] tensors and [H, W, 64] rows for the formula)."""
    generator = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(batch, heads, length, DIM, generator=generator) for _ in range(3))
    pos_key = torch.randn(heads, width, DIM, generator=generator) * 0.3 if terms in ("both", "c2p") else None
    pos_query = torch.randn(heads, width, DIM, generator=generator) * 0.3 if terms in ("both", "p2c") else None
    column, c2p_column = valid_columns(length, width)
    keep = None
    if masked:
        keep = np.ones((batch, length), dtype=np.uint8)
        keep[0, (length + 1) // 2 :] = 0
        if batch > 1:
            keep[-1] = 0  # a sequence of padding only
    feeds = {
        name: t.transpose(1, 2).reshape(batch, length, heads * DIM).numpy()
        for name, t in (("query", query), ("key", key), ("value", value))
    }
    feeds |= {"column": column, "c2p_column": c2p_column}
    if pos_key is not None:
        feeds["pos_key"] = tiles(pos_key.numpy())
    if pos_query is not None:
        feeds["pos_query"] = tiles(pos_query.numpy())
    if keep is not None:
        feeds["keep"] = keep
    return feeds, (query, key, value, pos_key, pos_query)


def run_operator(feeds: dict, heads: int, scale: float = SCALE) -> np.ndarray:
    session = operator_session("pos_key" in feeds, "pos_query" in feeds, "keep" in feeds, heads, scale)
    return session.run(None, feeds)[0]


def expected(feeds: dict, tensors, scale: float = SCALE) -> torch.Tensor:
    query, key, value, pos_key, pos_query = tensors
    return formula(
        query, key, value, pos_key, pos_query, feeds["column"], feeds["c2p_column"], feeds.get("keep"), scale
    )


def with_entry(vector: np.ndarray, index: int, value: int) -> np.ndarray:
    vector = vector.copy()
    vector[index] = value
    return vector


HOSTILE = {  # name: (what to change in a valid case of length 20, width 32), the message's words
    "column all 1e6": (
        lambda f: {"column": np.full_like(f["column"], 10**6)},
        r"column \(input 5\), entry 0 .*outside",
    ),
    "c2p_column 1e6": (lambda f: {"c2p_column": np.full_like(f["column"], 10**6)}, r"c2p_column \(input 6\).*outside"),
    "c2p_column 20000": (lambda f: {"c2p_column": np.full_like(f["column"], 20000)}, r"c2p_column.*outside"),
    "one negative column": (lambda f: {"column": with_entry(f["column"], 7, -1)}, r"column \(input 5\), entry 7"),
    "one negative c2p_column": (lambda f: {"c2p_column": with_entry(f["c2p_column"], 30, -5)}, r"entry 30 .*outside"),
    "int32 extremes": (lambda f: {"column": with_entry(f["column"], 3, INT32_MIN)}, r"value -2147483648"),
    "int32 maximum": (lambda f: {"c2p_column": with_entry(f["c2p_column"], 38, INT32_MAX)}, r"entry 38"),
    "column[0] = -16912": (lambda f: {"column": with_entry(f["column"], 0, -16912)}, r"entry 0 \(value -16912"),
    "one past W": (lambda f: {"column": with_entry(f["column"], 38, 32)}, r"entry 38 \(value 32, W = 32\)"),
    "unordered": (lambda f: {"column": f["column"][::-1].copy()}, r"below the entry before it"),
    "two columns per distance": (
        lambda f: {"c2p_column": f["c2p_column"] - np.int32(1) * (f["c2p_column"] > 0)},
        r"mirror",
    ),
    "16 distances over 17 columns": (
        lambda f: {"column": valid_columns(20, 32, step=2)[0], "c2p_column": valid_columns(20, 32, step=2)[1]},
        r"more than one column past the entry before it",
    ),
    "tables narrower than the columns reach": (
        lambda f: {"pos_key": f["pos_key"][:, :1].copy(), "pos_query": f["pos_query"][:, :1].copy()},
        r"W = 16\): lies outside",
    ),
    "tables of width 0": (
        lambda f: {"pos_key": f["pos_key"][:, :0].copy(), "pos_query": f["pos_query"][:, :0].copy()},
        r"W >= 16",
    ),
}


@needs_operator
@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_operator_refuses_each_hostile_input_by_name(name):
    """Each of the reviewer's cases is an INVALID_ARGUMENT error naming the input, the rule and the entry; nothing is
    read or written first (under the sanitizers, .ci/run)."""
    feeds, _ = case()
    change, message = HOSTILE[name]
    with pytest.raises(onnxruntime.capi.onnxruntime_pybind11_state.InvalidArgument, match=message):
        run_operator(feeds | change(feeds), heads=2)


@needs_operator
def test_overflowing_heads_is_refused_when_the_session_is_made():
    with pytest.raises(Exception, match=r"heads attribute must lie in \[1, 2\^31 / 64\)"):
        operator_session(True, True, False, heads=2**58 + 1).run(None, case()[0])


@needs_operator
@pytest.mark.parametrize("batch", [0, 2])
def test_no_tokens_is_an_empty_output(batch):
    feeds, _ = case(batch=batch or 1, length=1, masked=False)
    feeds = {name: value[:batch, :0] if name in ("query", "key", "value") else value for name, value in feeds.items()}
    feeds |= {"column": np.zeros(0, np.int32), "c2p_column": np.zeros(0, np.int32)}
    assert run_operator(feeds, heads=2).shape == (batch, 0, 2 * DIM)


@needs_operator
def test_nan_reaches_the_output_as_in_pytorch():
    """A NaN in a query row makes that row NaN (and no other); a NaN scale makes every row NaN but those of a
    sequence of padding (uniform over its keys, as eager attention under the dtype's minimum)."""
    feeds, tensors = case(length=40)
    feeds["query"][0, 5, :DIM] = np.nan  # head 0 of token 5
    tensors[0][0, 0, 5] = float("nan")
    actual = torch.from_numpy(run_operator(feeds, heads=2))
    torch.testing.assert_close(actual, expected(feeds, tensors), atol=1e-5, rtol=1e-5, equal_nan=True)
    assert actual[0, 5, :DIM].isnan().all() and not actual[0, 4].isnan().any() and not actual[1].isnan().any()
    feeds, tensors = case(length=40)
    actual = torch.from_numpy(run_operator(feeds, heads=2, scale=float("nan")))
    torch.testing.assert_close(actual, expected(feeds, tensors, float("nan")), equal_nan=True, atol=1e-5, rtol=1e-5)
    assert actual[0].isnan().all() and not actual[1].isnan().any()


@needs_operator
def test_sessions_share_workspaces_but_never_each_others_data():
    """Two sessions in one process take workspaces from one pool: the second's output is the formula's whatever the
    first ran before it (a long input leaves its tables in the pool), and its columns cannot point past its own."""
    long_feeds, _ = case(length=300, width=64, seed=1)
    run_operator(long_feeds, heads=2)
    feeds, tensors = case(length=40, seed=2, terms="p2c")
    first = run_operator(feeds, heads=2)
    run_operator(long_feeds, heads=2)
    assert np.array_equal(run_operator(feeds, heads=2), first)
    torch.testing.assert_close(torch.from_numpy(first), expected(feeds, tensors), atol=1e-5, rtol=1e-5)
    with pytest.raises(onnxruntime.capi.onnxruntime_pybind11_state.InvalidArgument, match="outside"):
        run_operator(feeds | {"column": feeds["column"] + np.int32(200)}, heads=2)


def corrupt(draw, vector: np.ndarray, width: int) -> np.ndarray:
    """One hostile change of a column vector, or none."""
    kind = draw(st.sampled_from(["none", "entry", "negative", "extreme", "shuffle", "shift", "off-by-one", "step"]))
    vector = vector.copy()
    if not len(vector) or kind == "none":
        return vector
    index = draw(st.integers(0, len(vector) - 1))
    if kind == "entry":
        vector[index] = draw(st.integers(-3 * width, 3 * width))
    elif kind == "negative":
        vector[index] = -draw(st.integers(1, 20000))
    elif kind == "extreme":
        vector[index] = draw(st.sampled_from([INT32_MIN, INT32_MAX, INT32_MIN + 1, INT32_MAX - 15]))
    elif kind == "shuffle":
        vector = np.random.default_rng(draw(st.integers(0, 2**16))).permutation(vector)
    elif kind == "shift":
        vector = vector + np.int32(draw(st.sampled_from([-1, 1, width])))
    elif kind == "off-by-one":
        vector[index] += np.int32(draw(st.sampled_from([-1, 1])))
    else:  # columns two apart from here on
        vector[index:] += np.arange(len(vector) - index, dtype=np.int32)
    return vector


@needs_operator
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_generated_hostile_inputs_end_in_an_error_or_the_formula(data):
    """Generated hostile inputs through ONNX Runtime: lengths 0, 1, 15, 16, 17 and 40; widths of one or more tiles,
    or none; odd heads; each column vector left alone or changed in one of eight ways. The operator errors exactly
    when the contract (`columns_hold`) or a shape says no, and otherwise gives the formula's numbers."""
    draw = data.draw
    length = draw(st.sampled_from([0, 1, 15, 16, 17, 40]))
    heads, tile_count = draw(st.sampled_from([1, 3])), draw(st.sampled_from([0, 1, 2, 3]))
    terms = draw(st.sampled_from(["both", "c2p", "p2c"]))
    feeds, tensors = case(
        batch=draw(st.sampled_from([1, 2])),
        heads=heads,
        length=max(length, 1),
        width=32,
        terms=terms,
        masked=draw(st.booleans()),
        seed=draw(st.integers(0, 9)),
    )
    width = 16 * tile_count
    for name in ("pos_key", "pos_query"):
        if name in feeds:  # the tables cut or zero-padded to the drawn width
            table = np.zeros((heads, tile_count, DIM, 16), np.float32)
            table[:, : min(tile_count, 2)] = feeds[name][:, : min(tile_count, 2)]
            feeds[name] = table
    tensors = tuple(t[:, :, :length] if t is not None and t.dim() == 4 else t for t in tensors)
    if length == 0:
        feeds = {
            name: value[:, :0] if name in ("query", "key", "value", "keep") else value for name, value in feeds.items()
        }
    column, c2p_column = valid_columns(length, max(width, 1)) if length else (np.zeros(0, np.int32),) * 2
    feeds["column"] = corrupt(draw, column, max(width, 16))
    feeds["c2p_column"] = corrupt(draw, c2p_column, max(width, 16))
    try:
        actual = run_operator(feeds, heads=heads)
    except onnxruntime.capi.onnxruntime_pybind11_state.InvalidArgument as error:
        assert "disentangled::Attention" in str(error)
        assert width == 0 or not columns_hold(feeds["column"], feeds["c2p_column"], width), str(error)
        return
    assert width > 0 and columns_hold(feeds["column"], feeds["c2p_column"], width)
    if length == 0:
        assert actual.shape[1] == 0
        return
    rows = {
        name: torch.from_numpy(feeds[name]).transpose(-1, -2).reshape(heads, width, DIM) if name in feeds else None
        for name in ("pos_key", "pos_query")
    }
    query, key, value = tensors[:3]
    reference = formula(
        query,
        key,
        value,
        rows["pos_key"],
        rows["pos_query"],
        feeds["column"],
        feeds["c2p_column"],
        feeds.get("keep"),
        SCALE,
    )
    torch.testing.assert_close(torch.from_numpy(actual), reference, atol=1e-5, rtol=1e-5)


# ---- The ctypes entries, through native.py's wrappers ----


def bias_reference(c2p, p2c, column, c2p_column, keep, first_row, first_key, length):
    """position_bias's formula from its inputs as given: c2p[a, c2p_column[L - 1 - i + j]] + p2c[b, column[i - j +
    L - 1]], the dtype's minimum where keep is 0."""
    rows, keys = c2p.shape[2], p2c.shape[2]
    i = torch.arange(first_row, first_row + rows)[:, None]
    j = torch.arange(first_key, first_key + keys)[None, :]
    c2p_at = torch.from_numpy(c2p_column).long()[length - 1 - i + j]  # [rows, keys]
    p2c_at = torch.from_numpy(column).long()[i - j + length - 1]
    out = c2p.gather(-1, c2p_at.expand(*c2p.shape[:2], rows, keys))
    out = out + p2c.gather(-1, p2c_at.T.expand(*p2c.shape[:2], keys, rows)).mT
    if keep is not None:
        out = out.masked_fill(~keep.bool()[:, None, None, :], torch.finfo(out.dtype).min)
    return out


def with_spare(*shape) -> torch.Tensor:
    """A float32 tensor with 15 spare elements after it, as position_bias's tables need."""
    return torch.randn(math.prod(shape) + 15)[:-15].view(*shape)


@needs_kernel
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_generated_hostile_columns_at_the_bias_kernel(data):
    """native.position_bias with columns changed in the operator test's eight ways, rows and keys at an offset: a
    ValueError naming the rule where `columns_hold` says no, else the formula."""
    draw = data.draw
    length, width = draw(st.sampled_from([1, 15, 16, 17, 40])), draw(st.sampled_from([16, 32, 48]))
    first_row = draw(st.integers(0, length - 1))
    rows = draw(st.integers(1, length - first_row))
    first_key = draw(st.integers(0, length - 1))
    keys = draw(st.integers(1, length - first_key))
    column, c2p_column = valid_columns(length, width)
    column, c2p_column = corrupt(draw, column, width), corrupt(draw, c2p_column, width)
    c2p, p2c = with_spare(2, 3, rows, width), with_spare(2, 3, keys, width)
    keep = (torch.rand(2, keys) > 0.3).to(torch.uint8) if draw(st.booleans()) else None
    out = torch.empty(2, 3, rows, keys)
    arguments = (torch.from_numpy(column), torch.from_numpy(c2p_column), keep, first_row, first_key)
    if not columns_hold(column, c2p_column, width):
        with pytest.raises(ValueError, match=r"position_bias: (c2p_)?column\[\d+\] = -?\d+ (lies|is|breaks)"):
            native.position_bias(out, c2p, p2c, *arguments)
        return
    native.position_bias(out, c2p, p2c, *arguments)
    torch.testing.assert_close(out, bias_reference(c2p, p2c, column, c2p_column, keep, first_row, first_key, length))


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_generated_hostile_columns_at_the_fused_attention(data):
    """native.attend (the operator's kernel, called from PyTorch) likewise: a ValueError, or the formula."""
    draw = data.draw
    length, heads = draw(st.sampled_from([1, 15, 16, 17, 40])), draw(st.sampled_from([1, 3]))
    width = 32
    first_key = draw(st.integers(0, length - 1))
    keys = slice(first_key, draw(st.integers(first_key + 1, length)))
    _, (query, key, value, pos_key, pos_query) = case(batch=2, heads=heads, length=length, width=width, masked=False)
    column, c2p_column = valid_columns(length, width)
    column, c2p_column = corrupt(draw, column, width), corrupt(draw, c2p_column, width)
    out = torch.empty(2, length, heads, DIM)
    workspace = torch.empty(native.workspace_bytes(keys.stop - keys.start, width), dtype=torch.uint8)
    arguments = (
        query,
        key,
        value,
        torch.from_numpy(tiles(pos_key.numpy())),
        torch.from_numpy(tiles(pos_query.numpy())),
    )
    arguments += (torch.from_numpy(column), torch.from_numpy(c2p_column), None, keys, SCALE, workspace)
    if not columns_hold(column, c2p_column, width):
        with pytest.raises(ValueError, match=r"attend: (c2p_)?column\[\d+\] = -?\d+ (lies|is|breaks)"):
            native.attend(out, *arguments)
        return
    native.attend(out, *arguments)
    keep = np.zeros((2, length), np.uint8)
    keep[:, keys] = 1
    reference = formula(query, key, value, pos_key, pos_query, column, c2p_column, keep, SCALE)
    torch.testing.assert_close(out.reshape(2, length, heads * DIM), reference, atol=1e-5, rtol=1e-5)


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_generated_hostile_columns_at_the_training_kernels(data):
    """native.hankel_bias and hankel_bias_backward (one column vector, read at a + b; tiled or not): a ValueError
    naming the rule, or the formula: out[a, b] = T[a, c] + U[b, c], dT[a, c] = sum of dS[a, b] over column[a + b] =
    c, dU likewise."""
    draw = data.draw
    rows, keys, width = draw(st.sampled_from([1, 15, 16, 17, 33])), draw(st.sampled_from([1, 16, 17, 40])), 48
    tiled = draw(st.booleans())
    column = corrupt(draw, valid_columns((rows + keys) // 2 + 1, width)[0][: rows + keys - 1], width)
    t, u = torch.randn(2, 3, rows, width), torch.randn(2, 3, keys, width)
    out = torch.empty(2, 3, rows, keys)
    if not columns_hold(column, None, width, tiled):
        with pytest.raises(ValueError, match=r"hankel_bias: column\[\d+\] = -?\d+ (lies|is)"):
            native.hankel_bias(out, t, u, torch.from_numpy(column), tiled)
        with pytest.raises(ValueError, match=r"hankel_bias_backward: column\[\d+\]"):
            native.hankel_bias_backward(
                out, torch.empty_like(t), torch.empty_like(u), torch.from_numpy(column), tiled, False
            )
        return
    index = torch.from_numpy(column).long()[torch.arange(rows)[:, None] + torch.arange(keys)[None, :]]  # [rows, keys]
    native.hankel_bias(out, t, u, torch.from_numpy(column), tiled)
    expected = t.gather(-1, index.expand(2, 3, rows, keys)) + u.gather(-1, index.T.expand(2, 3, keys, rows)).mT
    torch.testing.assert_close(out, expected)
    grad, grad_t, grad_u = torch.randn(2, 3, rows, keys), torch.empty_like(t), torch.empty_like(u)
    native.hankel_bias_backward(grad, grad_t, grad_u, torch.from_numpy(column), tiled, False)
    expected_t = torch.zeros_like(t).scatter_add_(-1, index.expand(2, 3, rows, keys), grad)
    expected_u = torch.zeros_like(u).scatter_add_(-1, index.T.expand(2, 3, keys, rows), grad.mT)
    torch.testing.assert_close(grad_t, expected_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_u, expected_u, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_the_wrappers_refuse_what_the_c_cannot_see():
    """Shapes, dtypes and spare room that the C cannot check are the wrappers' part of the contract."""
    column, c2p_column = (torch.from_numpy(v) for v in valid_columns(20, 32))
    c2p, p2c, out = with_spare(1, 2, 20, 32), with_spare(1, 2, 20, 32), torch.empty(1, 2, 20, 20)
    with pytest.raises(ValueError, match="contiguous int32"):
        native.position_bias(out, c2p, p2c, column.long(), c2p_column, None, 0, 0)
    with pytest.raises(ValueError, match="15 spare elements"):
        native.position_bias(out, c2p, torch.randn(1, 2, 20, 32), column, c2p_column, None, 0, 0)
    with pytest.raises(ValueError, match="p2c's keys must cover"):
        native.position_bias(out, c2p, p2c[:, :, :5], column, c2p_column, None, 0, 0)
    with pytest.raises(ValueError, match="keep must be uint8"):
        native.position_bias(out, c2p, p2c, column, c2p_column, torch.ones(1, 5, dtype=torch.uint8), 0, 0)
    _, (query, key, value, pos_key, pos_query) = case(batch=1, length=20, masked=False)
    tables = torch.from_numpy(tiles(pos_key.numpy())), torch.from_numpy(tiles(pos_query.numpy()))
    workspace = torch.empty(native.workspace_bytes(20, 32), dtype=torch.uint8)
    out = torch.empty(1, 20, 2, DIM)
    with pytest.raises(ValueError, match="must lie inside the 20 tokens"):
        native.attend(out, query, key, value, *tables, column, c2p_column, None, slice(5, 25), SCALE, workspace)
    with pytest.raises(ValueError, match="key and value must have the query's shape"):
        native.attend(
            out, query, key[:, :, :10], value, *tables, column, c2p_column, None, slice(0, 20), SCALE, workspace
        )


# ---- Configurations the bucket formula cannot take, and kernel graphs that could not be right ----


def test_one_position_bucket_is_refused_at_the_config():
    """position_buckets = 1 would divide by zero in the log buckets (half of it, 0, is the divisor)."""
    with pytest.raises(ValueError, match="position_buckets = 1"):
        DisentangledConfig(position_buckets=1)
    assert DisentangledConfig(position_buckets=2).position_buckets == 2


def tiny_model(**overrides):
    config = DisentangledConfig(
        **dict(vocab_size=64, hidden_size=128, num_hidden_layers=1, num_attention_heads=2, intermediate_size=96)
        | overrides
    )
    model = disentangled.DisentangledForSequenceClassification(config)
    inflate_weights(model)
    return model.eval()


# 8 buckets reaching 7 positions: the buckets outnumber the distances, and the column steps by two in places while 16
# consecutive distances still read 16 columns (the old check passed it; a tile's one load then read wrong columns)
STEPS_BY_TWO = dict(position_buckets=8, max_relative_positions=7)


@needs_kernel
def test_buckets_that_step_by_two_take_the_pytorch_path_and_match_eager():
    reference = tiny_model(**STEPS_BY_TWO)
    reference.set_attn_implementation("eager")
    positions = reference.deberta.encoder.get_rel_index(40, "cpu")
    assert not native.tiles_hold(positions.column) and native.kernel_columns(positions) is None
    sdpa = tiny_model(**STEPS_BY_TWO)
    sdpa.load_state_dict(reference.state_dict())
    sdpa.set_attn_implementation("sdpa")
    ids = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@needs_operator
def test_the_kernel_graph_is_refused_where_its_tiles_could_not_be_right(tmp_path, capsys):
    """`export-onnx --kernel --no-check` for buckets whose column steps by two: refused before the export, naming the
    default graph, and nothing written."""
    model = tiny_model(**STEPS_BY_TWO)
    model.save_pretrained(tmp_path / "model")
    assert run_cli(str(tmp_path / "model"), str(tmp_path / "a.onnx"), "--kernel", "--no-check") == 2
    error = capsys.readouterr().err
    assert "--kernel cannot serve this configuration" in error and "Export without --kernel" in error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]
