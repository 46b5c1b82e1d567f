"""Every attention backend against the eager reference: outputs, gradients, padded and packed batches, caches.

sdpa runs with a small block budget, so that the query-blocked bias is exercised over several blocks. FlexAttention
has no CPU backward and compiles for about a minute on a CI CPU, so its default check runs flex_attention's dense
reference of the same `score_mod` (inference); `DISENTANGLED_TEST_COMPILE=1` adds the compiled kernel.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from parity import check_parity, inflate_weights, max_abs_diff, padded_batch, uncached_copy

import disentangled
from disentangled.modeling import (
    blocks,
    cpu_inference,
    cpu_training,
    disentangled_attention,
    dispatch,
    native,
    workspace,
)

TINY = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    position_buckets=16,  # log buckets from |d| >= 8 on, so short inputs reach them
    max_relative_positions=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
VARIANTS = {
    "v3": {},
    "separate-position-projections": dict(share_att_key=False),
    "c2p-only": dict(pos_att_type="c2p"),
    "p2c-only": dict(pos_att_type="p2c"),
    "p2p": dict(pos_att_type="c2p|p2c|p2p"),
    "clipped-distances": dict(position_buckets=-1, max_relative_positions=8),
    "no-relative-attention": dict(relative_attention=False, pos_att_type=None),
}
LENGTHS = [40, 23, 31]


def build(implementation: str, **overrides) -> disentangled.DisentangledModel:
    config = disentangled.DisentangledConfig(**dict(TINY, **overrides))
    torch.manual_seed(0)
    model = disentangled.DisentangledModel(config)
    inflate_weights(model)
    model.set_attn_implementation(implementation)
    return model.eval()


def with_implementation(model, implementation: str):
    other = copy.deepcopy(model)
    other.set_attn_implementation(implementation)
    return other


@pytest.fixture(params=["kernel", "pytorch"])
def cpu_inference_path(request, monkeypatch) -> str:
    """Every test of CPU inference twice: with the compiled kernel making the band's bias (`native.py`, where it
    builds; here with the far keys split off at every length, as from KERNEL_SPLIT_LENGTH tokens on, so that the
    far parts run with it too) and with PyTorch's operators alone (U by bands of keys, the add of two views).
    The switch decides CPU inference only (`dispatch._sdpa_path`): tests of training, of eager and flex, and of
    `BlockedAttention` itself run once, since both settings would run the same code."""
    if request.param == "kernel" and not native.available():
        pytest.skip(f"the kernel does not run here: {native.why_unavailable()}")
    monkeypatch.setattr(cpu_inference, "KERNEL_SPLIT_LENGTH", 0)
    with dispatch.switched(CPU_KERNEL=request.param == "kernel"):
        yield request.param


# The buffer that holds U (the p2c table) on each path
P2C_BUFFER = {"kernel": "p2c table", "pytorch": "band table"}


@pytest.fixture(autouse=True)
def small_sdpa_blocks(monkeypatch):
    monkeypatch.setattr(blocks, "SDPA_BLOCK_ELEMENTS", 3 * 4 * 40 * 7)  # 7 query rows per block
    monkeypatch.setattr(cpu_inference, "DISTANCE_BLOCK_ELEMENTS", 3 * 4 * 40 * 7)
    monkeypatch.setattr(cpu_inference, "DISTANCE_MIN_ROWS", 1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sdpa_matches_eager_outputs_and_gradients(variant):
    reference = build("eager", **VARIANTS[variant])
    check_parity(reference, with_implementation(reference, "sdpa"), "Model", padded_batch(100, LENGTHS))


@pytest.mark.parametrize("variant", ["v3", "c2p-only", "p2c-only"])
def test_sdpa_training_with_banded_tables_matches_eager(monkeypatch, variant):
    """At v3's buckets, 128 tokens and a batch of five, CPU training's kernel bands its tables by default
    (`cpu_training.BAND_MOST`, `BAND_SEQUENCES`): the model's outputs and gradients still match eager's."""
    if not native.available():
        pytest.skip(f"the kernel does not run here: {native.why_unavailable()}")
    monkeypatch.setattr(blocks, "SDPA_BLOCK_ELEMENTS", 1 << 21)  # the default blocks: groups of five
    bands = []
    kernel = native.hankel_bias
    monkeypatch.setattr(native, "hankel_bias", lambda *args: bands.append(args[5]) or kernel(*args))
    reference = build("eager", **dict(VARIANTS[variant], position_buckets=256, max_relative_positions=512))
    check_parity(reference, with_implementation(reference, "sdpa"), "Model", padded_batch(100, [128, 97, 128, 64, 110]))
    assert bands and all(band is not None for band in bands)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_flex_score_mod_matches_eager(variant):
    reference = build("eager", **VARIANTS[variant])
    flex = with_implementation(reference, "flex_attention")
    batch = padded_batch(100, LENGTHS)
    with torch.no_grad(), dispatch.switched(FLEX_COMPILED=False):
        expected = reference(**batch).last_hidden_state
        actual = flex(**batch).last_hidden_state
    assert max_abs_diff(actual, expected, batch["attention_mask"]) <= 1e-5 * max(1.0, expected.abs().max().item())


@pytest.mark.skipif(os.environ.get("DISENTANGLED_TEST_COMPILE") != "1", reason="compiles for about a minute")
def test_compiled_flex_matches_eager():
    reference = build("eager")
    flex = with_implementation(reference, "flex_attention")
    batch = padded_batch(100, LENGTHS)
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        actual = flex(**batch).last_hidden_state
    assert max_abs_diff(actual, expected, batch["attention_mask"]) <= 1e-5 * max(1.0, expected.abs().max().item())


def test_flex_falls_back_to_sdpa_for_gradients_on_cpu():
    model = build("flex_attention")
    batch = padded_batch(100, LENGTHS)
    disentangled_attention._warned.clear()
    with pytest.warns(UserWarning, match="flex_attention"):
        model(**batch).last_hidden_state.sum().backward()


def test_output_attentions_falls_back_to_eager_once():
    model = build("sdpa")
    batch = padded_batch(100, LENGTHS)
    disentangled_attention._warned.clear()
    with pytest.warns(UserWarning, match="output_attentions"):
        output = model(**batch, output_attentions=True)
    assert len(output.attentions) == 2 and output.attentions[0].shape == (3, 4, 40, 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batch, output_attentions=True)


def packed(batch: dict) -> tuple[dict, torch.Tensor]:
    lengths = batch["attention_mask"].sum(-1)
    tokens = batch["input_ids"][batch["attention_mask"].bool()][None]  # [1, T]
    return {"input_ids": tokens, "cu_seqlens": torch.cat([torch.zeros(1), lengths.cumsum(0)]).long()}, lengths


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", ["v3", "absolute-positions"])
def test_packed_batch_matches_padded(implementation, variant):
    overrides = dict(position_biased_input=True, max_position_embeddings=64) if variant == "absolute-positions" else {}
    padded_model = build("eager", **overrides)
    packed_model = with_implementation(padded_model, implementation)
    batch = padded_batch(100, LENGTHS)
    inputs, _ = packed(batch)
    real = batch["attention_mask"].bool()

    expected = padded_model(**batch).last_hidden_state
    actual = packed_model(**inputs).last_hidden_state  # [1, T, hidden]
    assert actual.shape == (1, int(real.sum()), 32)
    assert max_abs_diff(actual[0], expected[real]) <= 1e-5 * max(1.0, expected.abs().max().item())

    weights = torch.linspace(-1, 1, actual.numel()).view_as(actual[0])
    (expected[real] * weights).sum().backward()
    (actual[0] * weights).sum().backward()
    for (name, p), q in zip(padded_model.named_parameters(), packed_model.parameters()):
        if p.grad is not None:
            scale = max(p.grad.abs().max().item(), 1e-6)
            assert (p.grad - q.grad).abs().max().item() <= 1e-4 * scale + 1e-7, name


def test_packed_sequence_classification_matches_padded():
    """One logit row per packed sequence, read from its first token: logits, loss and gradients as padded."""
    config = disentangled.DisentangledConfig(**TINY, num_labels=3)
    torch.manual_seed(0)
    padded_model = disentangled.DisentangledForSequenceClassification(config).eval()
    inflate_weights(padded_model)
    packed_model = copy.deepcopy(padded_model)
    batch = padded_batch(100, LENGTHS)
    inputs, _ = packed(batch)
    labels = torch.tensor([2, 0, 1])

    expected = padded_model(**batch, labels=labels)
    actual = packed_model(**inputs, labels=labels)
    assert actual.logits.shape == (3, 3)
    assert max_abs_diff(actual.logits, expected.logits) <= 1e-5 * max(1.0, expected.logits.abs().max().item())
    assert abs(actual.loss.item() - expected.loss.item()) <= 1e-5 * max(1.0, expected.loss.item())
    expected.loss.backward()
    actual.loss.backward()
    for (name, p), q in zip(padded_model.named_parameters(), packed_model.parameters()):
        if p.grad is not None:
            assert (p.grad - q.grad).abs().max().item() <= 1e-4 * max(p.grad.abs().max().item(), 1e-6) + 1e-7, name
    with pytest.raises(ValueError, match="labels"):
        packed_model(**inputs, labels=torch.tensor([1, 0]))  # one label per packed sequence


def test_flattening_collator_drives_the_token_classification_head():
    from transformers import DataCollatorWithFlattening

    config = disentangled.DisentangledConfig(**TINY, num_labels=3)
    torch.manual_seed(0)
    model = disentangled.DisentangledForTokenClassification(config).eval()
    features = [{"input_ids": list(range(5, 5 + n)), "labels": [1] * n} for n in (9, 4, 12)]
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)(features)
    logits = model(**flat).logits  # [1, 25, 3]
    first = model(input_ids=torch.tensor([features[1]["input_ids"]])).logits[0]
    assert max_abs_diff(logits[0, 9:13], first) <= 1e-5


@pytest.mark.usefixtures("cpu_inference_path")
def test_inference_position_cache_follows_weight_updates():
    model = build("sdpa")
    batch = padded_batch(100, LENGTHS)
    attention = model.encoder.layer[0].attention.self
    with torch.no_grad():
        first = model(**batch).last_hidden_state
        cached = attention._position_cache
        assert cached is not None and model.encoder._rel_cache is not None
        again = model(**batch).last_hidden_state
        assert attention._position_cache[2] is cached[2]  # reused, not recomputed
        torch.testing.assert_close(again, first, rtol=0, atol=0)

        attention.key_proj.weight.mul_(1.5)  # in place: bumps the version
        model.encoder.rel_embeddings.weight.add_(0.25)
        changed = model(**batch).last_hidden_state
    with torch.no_grad():
        expected = uncached_copy(model)(**batch).last_hidden_state
    assert not torch.allclose(changed, first)
    torch.testing.assert_close(changed, expected, rtol=0, atol=0)
    model.train()
    with torch.no_grad():
        model(**batch)
    assert model.encoder._rel_cache is None  # training never caches (dropout, optimizer steps)


@pytest.mark.usefixtures("cpu_inference_path")
def test_inference_position_cache_is_not_used_past_a_hook():
    """A forward hook on a projection (or a global one) may change what it returns: with one, the position
    projections are made afresh on every call, and the hook sees the relative rows go through."""
    model = build("sdpa")
    batch = padded_batch(100, LENGTHS)
    attention = model.encoder.layer[0].attention.self
    with torch.no_grad():
        first = model(**batch).last_hidden_state
        assert attention._position_cache is not None
        seen = []

        def doubled(module, inputs, output):
            seen.append(inputs[0].shape[0])
            return output * 2

        handle = attention.key_proj.register_forward_hook(doubled)
        hooked = model(**batch).last_hidden_state
        assert attention._position_cache is None
        assert len(seen) == 2  # the hidden states and the relative rows
        handle.remove()
        fresh = uncached_copy(model)
        handle = fresh.encoder.layer[0].attention.self.key_proj.register_forward_hook(doubled)
        expected = fresh(**batch).last_hidden_state
        handle.remove()
        again = model(**batch).last_hidden_state
    assert not torch.allclose(hooked, first)
    torch.testing.assert_close(hooked, expected, rtol=0, atol=0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_only_reachable_relative_rows_are_projected():
    config = disentangled.DisentangledConfig(**dict(TINY, position_buckets=256, max_relative_positions=512))
    positions = disentangled.DisentangledModel(config).encoder.get_rel_index(128, "cpu")
    assert positions.width == 255 and positions.column.shape == (255,)
    assert positions.column.dtype == torch.int64  # gather's index type; [2L - 1], never [L, L]


@pytest.mark.usefixtures("cpu_inference_path")
@pytest.mark.parametrize("variant", ["v3", "clipped-distances", "c2p-only", "p2c-only"])
def test_sdpa_inference_beyond_the_buckets_reach_matches_eager(variant):
    """Long enough that keys far left and far right of a block attend without a dense bias (log-sum-exp merge)."""
    reference = build("eager", **VARIANTS[variant])
    sdpa = with_implementation(reference, "sdpa")
    batch = padded_batch(100, [150, 97])
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        actual = sdpa(**batch).last_hidden_state
    assert sdpa.encoder.get_rel_index(150, "cpu").near[1] < 100  # the far parts are exercised
    assert max_abs_diff(actual, expected, batch["attention_mask"]) <= 1e-5 * max(1.0, expected.abs().max().item())


@pytest.mark.usefixtures("cpu_inference_path")
@pytest.mark.parametrize("variant", ["v3", "clipped-distances", "c2p-only", "p2c-only"])
@pytest.mark.parametrize("block_elements", [None, 1 << 20])  # the fixture's 7-row blocks, or whole groups
@pytest.mark.parametrize("band_keys", [None, 7])  # U in bands of 64 keys (up to three here), or of 7
def test_sdpa_inference_by_distance_matches_eager_at_every_position(monkeypatch, variant, block_elements, band_keys):
    """CPU inference reads the position terms as strided views of tables by distance: padded keys are masked
    through rows of U's bands (the dtype's minimum), and the keys beyond the reach of a whole block run as plain
    attention with a key bias on each side of its band. Every position matches eager, padding included: right-
    and left-padded rows, a row of padding only (uniform attention, as in eager), several sequences per block,
    lengths within and beyond the buckets' reach. With bands of 7 keys, a block reads several whole bands per
    view (two per add of 16 keys) and a partial last one."""
    if block_elements:
        monkeypatch.setattr(cpu_inference, "DISTANCE_BLOCK_ELEMENTS", block_elements)
    if band_keys:
        monkeypatch.setattr(cpu_inference, "BAND_TABLE_KEYS", band_keys)
        monkeypatch.setattr(cpu_inference, "ADD_CHUNK_KEYS", 16)
    reference = build("eager", **VARIANTS[variant])
    sdpa = with_implementation(reference, "sdpa")
    for lengths in ([40, 23, 31], [150, 97]):
        batch = padded_batch(100, [*lengths, 0])
        longest = max(lengths)
        for name in ("input_ids", "attention_mask"):  # the second row padded on the left
            batch[name][1] = batch[name][1].roll(longest - lengths[1])
        with torch.no_grad():
            expected = reference(**batch).last_hidden_state
            actual = sdpa(**batch).last_hidden_state
        assert torch.isfinite(actual).all()
        assert max_abs_diff(actual, expected) <= 1e-5 * max(1.0, expected.abs().max().item()), lengths


@pytest.mark.usefixtures("cpu_inference_path")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", ["v3", "clipped-distances", "c2p-only", "p2c-only"])
def test_sdpa_inference_beyond_the_reach_in_low_precision(variant, dtype):
    """A model cast to float16 or bfloat16, long enough that blocks have keys beyond the reach on both sides (their
    key bias, row constant and log-sum-exp merge in low precision), padded rows and a row of padding only: at every
    position within twice the error of eager in the same dtype, both against eager in float32."""
    reference = build("eager", **VARIANTS[variant])
    low_sdpa = with_implementation(reference, "sdpa").to(dtype)
    low_eager = copy.deepcopy(reference).to(dtype)
    batch = padded_batch(100, [150, 97, 0])
    assert reference.encoder.get_rel_index(150, "cpu").near[1] < 100
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        actual = low_sdpa(**batch).last_hidden_state.float()
        own = low_eager(**batch).last_hidden_state.float()
    assert torch.isfinite(actual).all()
    assert max_abs_diff(actual, expected) <= 2 * max_abs_diff(own, expected) + 1e-3


@pytest.mark.usefixtures("cpu_inference_path")
@pytest.mark.parametrize("variant", ["v3", "c2p-only"])
def test_sdpa_inference_under_cpu_autocast_matches_eager(variant):
    """Under bfloat16 autocast, queries and keys come out of the linear layers in bfloat16 while the cached relative
    projections may be float32: the tables by distance take the queries' dtype (matmul's out= is not autocast),
    as eager's products do under autocast."""
    reference = build("eager", **VARIANTS[variant])
    sdpa = with_implementation(reference, "sdpa")
    batch = padded_batch(100, [150, 97])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(**batch).last_hidden_state.float()
        actual = sdpa(**batch).last_hidden_state.float()
    assert torch.isfinite(actual).all()
    assert max_abs_diff(actual, expected, batch["attention_mask"]) <= 6e-2 * max(1.0, expected.abs().max().item())


@pytest.mark.usefixtures("cpu_inference_path")
@pytest.mark.skipif(not cpu_inference.CPU_FLASH_WITH_LSE, reason="the near/far split needs the CPU flash kernel's LSE")
@pytest.mark.parametrize("variant", ["v3", "clipped-distances", "p2c-only"])
@pytest.mark.parametrize("block_elements", [None, 1 << 20])  # a sequence per group, or all three in one
def test_sdpa_inference_leaves_keys_of_padding_only_out(monkeypatch, variant, block_elements):
    """Keys that are padding in every sequence of a group (`_unpadded_span`) take part in no product or call: the
    calls cover fewer query-key pairs than with every key, and every position still matches eager. Every row ends
    in 20 keys of padding; row 1 is also padded on the left beyond the reach (the far keys on the right start inside
    the padding); some blocks keep no key in their band and take only the far parts'."""
    if block_elements:
        monkeypatch.setattr(cpu_inference, "DISTANCE_BLOCK_ELEMENTS", block_elements)
    reference = build("eager", **VARIANTS[variant])
    sdpa = with_implementation(reference, "sdpa")
    batch = padded_batch(100, [130, 20, 97])
    for name in ("input_ids", "attention_mask"):  # 20 more keys of padding in every row
        batch[name] = torch.cat([batch[name], batch[name].new_zeros(3, 20)], dim=1)
        batch[name][1] = batch[name][1].roll(110)
    assert sdpa.encoder.get_rel_index(130, "cpu").near[1] < 110
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
    pairs = []  # query-key pairs of the sdpa model's calls only

    def counting(function):
        def call(query, key, *args, **kwargs):
            pairs.append(query.shape[-2] * key.shape[-2])
            return function(query, key, *args, **kwargs)

        return call

    # a block with keys beyond the reach on either side runs the flash kernel itself (it needs the log-sum-exp)
    monkeypatch.setattr(cpu_inference, "cpu_flash_attention", counting(cpu_inference.cpu_flash_attention))
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting(F.scaled_dot_product_attention))
    with torch.no_grad():
        actual = sdpa(**batch).last_hidden_state
        trimmed = sum(pairs)
        monkeypatch.setattr(cpu_inference, "_unpadded_span", lambda mask, length: slice(0, length))
        pairs.clear()
        whole = sdpa(**batch).last_hidden_state
    assert trimmed < sum(pairs)
    for output in (actual, whole):
        assert max_abs_diff(output, expected) <= 1e-5 * max(1.0, expected.abs().max().item())


@pytest.mark.usefixtures("cpu_inference_path")
@pytest.mark.skipif(not cpu_inference.CPU_FLASH_WITH_LSE, reason="the near/far split needs the CPU flash kernel's LSE")
@pytest.mark.parametrize("padded", [False, True])
def test_far_parts_hand_the_flash_kernel_masks_it_reads_in_place(monkeypatch, padded):
    """The CPU flash kernel copies a mask whose keys are strided into a whole [B, H, rows, keys] tensor (it was a
    fifth of the time at 1x2048): every bias the near/far split hands it has unit key stride. Outputs as eager."""
    flash, masks = cpu_inference.cpu_flash_attention, []

    def recording_flash(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return flash(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(cpu_inference, "cpu_flash_attention", recording_flash)
    reference = build("eager")
    sdpa = with_implementation(reference, "sdpa")
    batch = padded_batch(100, [150, 97] if padded else [150])
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        actual = sdpa(**batch).last_hidden_state
    assert masks and any(mask.shape[-2] == 1 for mask in masks)  # far parts ran, with a key bias
    assert all(mask.stride(-1) == 1 for mask in masks)
    assert max_abs_diff(actual, expected, batch["attention_mask"]) <= 1e-5 * max(1.0, expected.abs().max().item())


def test_kept_workspace_is_kept_between_calls_and_stays_exact(cpu_inference_path):
    """CPU inference keeps its buffers (U's bands, T, the block's bias) between calls, per
    model and thread. Inputs of other lengths and paddings in any order, in and out of inference mode, give exactly
    what a call with fresh buffers gives, and `release_workspace` frees them."""
    reference = build("eager")
    sdpa = with_implementation(reference, "sdpa")
    fresh = with_implementation(reference, "sdpa")
    batches = [
        padded_batch(100, [150, 97]),
        padded_batch(100, [40, 23, 31]),
        padded_batch(100, [150]),
        padded_batch(100, [150, 97], seed=1),
        padded_batch(100, [120, 150, 3]),
    ]
    with torch.no_grad():
        for index, batch in enumerate(batches + batches[::-1]):
            inference_mode = torch.inference_mode() if index % 3 == 1 else contextlib.nullcontext()
            with inference_mode:  # buffers made in inference mode are replaced outside it
                actual = sdpa(**batch).last_hidden_state
            with dispatch.switched(KEEP_WORKSPACE=False):
                expected = fresh(**batch).last_hidden_state
            assert torch.equal(actual, expected)
        assert max_abs_diff(actual, reference(**batch).last_hidden_state, batch["attention_mask"]) <= 1e-5 * max(
            1.0, expected.abs().max().item()
        )
        held = workspace.kept_workspace(sdpa.encoder)
        assert P2C_BUFFER[cpu_inference_path] in held and not workspace.kept_workspace(fresh.encoder)
        sdpa.release_workspace()
        assert not workspace.kept_workspace(sdpa.encoder)


@pytest.mark.usefixtures("cpu_inference_path")
def test_training_workspace_is_kept_between_steps_and_stays_exact():
    """CPU training makes a block's c2p table and a group's p2c table (and their gradients) in buffers kept between
    steps. Steps of other lengths and paddings, inference calls in between, two forwards before one backward and a
    backward on another thread all give exactly the gradients of a model with fresh buffers (which match eager's:
    `test_sdpa_matches_eager_outputs_and_gradients`)."""
    reference = build("eager")
    sdpa = with_implementation(reference, "sdpa").train()
    fresh = with_implementation(reference, "sdpa").train()
    batches = [padded_batch(100, [150, 97]), padded_batch(100, [40, 23, 31]), padded_batch(100, [120, 150, 3])]

    def gradients(model, steps, keep, threaded=False):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        with dispatch.switched(KEEP_WORKSPACE=keep):
            losses = [model(**batch).last_hidden_state.square().mean() for batch in steps]
            if threaded:  # the backward on a thread other than the forward's
                worker = threading.Thread(target=lambda: sum(losses).backward())
                worker.start()
                worker.join()
            else:
                sum(losses).backward()
        return {
            name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None
        }

    for index, steps in enumerate([batches[:1], batches[1:2], batches[::2], batches[2:], batches[:1]]):
        if index == 2:  # inference in between: its buffers, made in inference mode, are replaced in training
            with torch.inference_mode():
                sdpa.eval()(**batches[1])
            sdpa.train()
        actual = gradients(sdpa, steps, keep=True, threaded=index == 3)
        expected = gradients(fresh, steps, keep=False)
        assert actual.keys() == expected.keys() and all(torch.equal(actual[name], expected[name]) for name in actual)
    assert {"c2p", "p2c"} <= workspace.kept_workspace(sdpa.encoder).keys()
    sdpa.release_workspace()
    assert not workspace.kept_workspace(sdpa.encoder)


def test_kept_workspace_is_per_thread(cpu_inference_path):
    """Two threads running one model at once each get their own buffers and the single-thread outputs."""
    sdpa = build("sdpa")
    batches = [padded_batch(100, [150, 97]), padded_batch(100, [140, 150], seed=1)]
    with torch.no_grad():
        expected = [sdpa(**batch).last_hidden_state for batch in batches]
    results, workspaces = {}, {}
    start = threading.Barrier(2)  # both threads call the model at the same time

    def serve(index):
        start.wait()
        with torch.no_grad():
            for _ in range(3):
                results[index] = sdpa(**batches[index]).last_hidden_state
        workspaces[index] = workspace.kept_workspace(sdpa.encoder)

    threads = [threading.Thread(target=serve, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(results[index], expected[index]) for index in range(2))
    table = P2C_BUFFER[cpu_inference_path]
    assert workspaces[0][table].data_ptr() != workspaces[1][table].data_ptr()


def blocked_attention_inputs(dtype=torch.float64, length=12, batch=2, heads=3, dim=4, buckets=8):
    """Inputs of `BlockedAttention`: keys already reversed, log buckets from |d| >= buckets / 2 on (max_position twice
    the buckets), one padded sequence."""
    positions = disentangled_attention.RelativePositions.build(length, buckets, buckets, 2 * buckets, "cpu")
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype, requires_grad=True)

    query, key, value = (tensor(batch, heads, length, dim) for _ in range(3))
    pos_key, pos_query = (tensor(heads, positions.width, dim) for _ in range(2))  # Kr, Qr
    keep = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    keep[1, ..., : length // 3] = False  # reversed keys: padding comes first
    return query, key, value, pos_key, pos_query, keep, positions


def reference_attention(
    query, key, value, pos_key, pos_query, keep, positions, scaling, dropout_keep=None, dropout=0.0
):
    """softmax(q k'ᵀ scaled + c2p + p2c, masked) (dropout) @ v with the whole tables c2p = q Krᵀ, p2c = k' Qrᵀ
    and the dense Hankel index: [B, L, H, D]."""
    length = query.shape[-2]
    c2p, p2c = query @ pos_key.mT, key @ pos_query.mT
    index = blocks._hankel(positions, 0, length, length)  # column of (i, j'), keys reversed
    c2p_bias = c2p.gather(-1, index.expand(*c2p.shape[:2], length, length))
    p2c_bias = p2c.mT.gather(-2, index.expand(*p2c.shape[:2], length, length))
    scores = (query * scaling) @ key.mT + c2p_bias + p2c_bias
    probs = torch.softmax(scores.masked_fill(~keep, torch.finfo(scores.dtype).min), dim=-1)
    if dropout_keep is not None:
        probs = probs * dropout_keep / (1 - dropout)
    return (probs @ value).transpose(1, 2)


@pytest.mark.parametrize("block_elements", [None, 3 * 12 * 5])  # one block per batch; blocks of 5 rows
def test_blocked_attention_gradients_with_dropout(block_elements):
    """CPU training's own backward (dS into the position tables by scatter_add) against numerical gradients
    in float64, with padding, several blocks and dropout (the seed is reset for each call, so every call
    drops the same entries)."""
    *tensors, keep, positions = blocked_attention_inputs()

    def attention(*inputs):
        torch.manual_seed(1)
        return cpu_training.BlockedAttention.apply(*inputs, keep, positions, 0.3, 0.25, block_elements, False)

    assert torch.autograd.gradcheck(attention, tuple(tensors), eps=1e-6, atol=1e-5)


def assert_matches_the_dense_formula(actual, tensors, keep, positions, dropout_keep, dropout):
    """BlockedAttention's context `actual` (scaling 0.3) and its gradients, against random output weights, equal the
    dense formula's (`reference_attention`) in float32: within 1e-5 of each one's largest entry (at least 1)."""
    expected = reference_attention(*tensors, keep, positions, 0.3, dropout_keep, dropout)
    weights = torch.randn_like(expected)
    actual_grads = torch.autograd.grad((actual * weights).sum(), tensors)
    expected_grads = torch.autograd.grad((expected * weights).sum(), tensors)
    assert (actual - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())
    for name, got, want in zip(("query", "key", "value", "Kr", "Qr"), actual_grads, expected_grads):
        assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item()), name


def training_kernel(monkeypatch, kernel: bool) -> list:
    """The list the calls of CPU training's compiled kernel are counted in (skips where it does not build)."""
    if kernel and not native.available():
        pytest.skip(f"the kernel does not run here: {native.why_unavailable()}")
    calls = []
    for name in ("hankel_bias", "hankel_bias_backward"):
        function = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *args, f=function, n=name: calls.append(n) or f(*args))
    return calls


@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch", "kernel"])
@pytest.mark.parametrize("length", [20, 40])  # blocks of 7 rows; of 20 rows, whole 16 x 16 tiles and ragged edges
def test_blocked_attention_matches_the_dense_formula(monkeypatch, kernel, length):
    """Forward and gradients against the dense formula, without dropout, and with the same dropout mask; with the
    compiled kernel making each block's bias and its tables' gradients, and with gather / scatter_add."""
    calls = training_kernel(monkeypatch, kernel)
    *tensors, keep, positions = blocked_attention_inputs(torch.float32, length=length)
    block_elements = 2 * 3 * length * (7 if length == 20 else 20)
    for dropout in (0.0, 0.2):
        torch.manual_seed(3)
        actual = cpu_training.BlockedAttention.apply(*tensors, keep, positions, 0.3, dropout, block_elements, kernel)
        dropout_keep = None
        if dropout:  # the same draws: one mask over the whole [B, H, L, L] when one block holds it all
            torch.manual_seed(3)
            dropout_keep = cpu_training.dropout_keep_mask((2, 3, length, length), dropout, "cpu")
            torch.manual_seed(3)
            whole = 2 * 3 * length * length
            actual = cpu_training.BlockedAttention.apply(*tensors, keep, positions, 0.3, dropout, whole, kernel)
        assert_matches_the_dense_formula(actual, tensors, keep, positions, dropout_keep, dropout)
    assert {"hankel_bias", "hankel_bias_backward"} == set(calls) if kernel else not calls


@pytest.mark.parametrize("lines", [16, 32])
@pytest.mark.parametrize("batch, length, block_rows", [(5, 70, 70), (3, 100, 23)])
def test_blocked_attention_with_banded_tables_matches_the_dense_formula(monkeypatch, lines, batch, length, block_rows):
    """CPU training's kernel with banded tables (`native.Band`, here wherever it can band): forward and gradients
    against the dense formula, with ragged last tiles, several groups of sequences (the last one smaller) or several
    blocks of rows per group, and dropout; the workspace's buffers handed out full of NaN."""
    calls = training_kernel(monkeypatch, True)
    bands = []
    kernel = native.hankel_bias
    monkeypatch.setattr(native, "hankel_bias", lambda *args: bands.append(args[5]) or kernel(*args))
    monkeypatch.setattr(cpu_training, "BAND_LINES", lines)
    monkeypatch.setattr(cpu_training, "BAND_MOST", 1.0)
    monkeypatch.setattr(cpu_training, "BAND_SEQUENCES", 1)
    scratch = cpu_training._scratch  # every buffer NaN when handed out: nothing may read what it did not write
    monkeypatch.setattr(cpu_training, "_scratch", lambda *args: scratch(*args).fill_(float("nan")))
    *tensors, keep, positions = blocked_attention_inputs(torch.float32, length=length, batch=batch, buckets=64)
    group = 2 if block_rows == length else 1  # sequences per group: 2, 2 and 1 of 5; or one each, in 4 blocks
    block_elements = group * 3 * length * block_rows
    for dropout in (0.0, 0.2):
        torch.manual_seed(3)
        actual = cpu_training.BlockedAttention.apply(*tensors, keep, positions, 0.3, dropout, block_elements, True)
        dropout_keep = None
        if dropout:  # the same draws: each block draws its own mask, in the blocks' order
            torch.manual_seed(3)
            dropout_keep = torch.empty(batch, 3, length, length, dtype=torch.bool)
            for sequences, first, last in blocks._tiles(tensors[0], block_elements):
                shape = (sequences.stop - sequences.start, 3, last - first, length)
                dropout_keep[sequences, :, first:last] = cpu_training.dropout_keep_mask(shape, dropout, "cpu")
        assert_matches_the_dense_formula(actual, tensors, keep, positions, dropout_keep, dropout)
    band = cpu_training._band_width(positions)
    assert band is not None and band < positions.width and {"hankel_bias", "hankel_bias_backward"} == set(calls)
    assert bands and all(b is not None and b.lines == lines for b in bands)
    assert any(int(b.c2p_first.max()) > 0 for b in bands)  # the bands do move along the table


@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch", "kernel"])
@pytest.mark.parametrize("dropout", [0.1, 0.5, 0.9])
def test_dropout_keep_mask_keeps_each_entry_with_the_keep_probability(switch, monkeypatch, dropout, kernel):
    """Four entries per 64-bit draw: every lane of the draw (entry index mod 4) and the whole mask keep 1 - p of
    the entries (within 5 standard deviations), neighbouring entries and draws are uncorrelated, two masks differ,
    and the seed reproduces one; from PyTorch's generator, and from the compiled kernel's seeded by it."""
    if kernel and not native.available():
        pytest.skip(f"the kernel does not run here: {native.why_unavailable()}")
    switch(DROPOUT_KERNEL=kernel)
    calls, function = [], native.keep_mask
    monkeypatch.setattr(native, "keep_mask", lambda *args: calls.append(1) or function(*args))
    torch.manual_seed(0)
    shape = (3, 5, 257, 263)  # an odd entry count: the last draw is used in part
    keep = cpu_training.dropout_keep_mask(shape, dropout, "cpu")
    assert keep.shape == shape and keep.dtype == torch.bool
    expected = round((1 - dropout) * 2**cpu_training.DROPOUT_BITS) / 2**cpu_training.DROPOUT_BITS
    assert abs(expected - (1 - dropout)) <= 2**-cpu_training.DROPOUT_BITS
    flat = keep.flatten()[: keep.numel() // 4 * 4].view(-1, 4).double()
    for fraction, count in [(keep.double().mean(), keep.numel())] + [(lane.mean(), len(lane)) for lane in flat.T]:
        assert abs(fraction - expected) <= 5 * math.sqrt(expected * (1 - expected) / count), (fraction, expected)
    centred = keep.flatten().double() - expected
    bound = 5 * expected * (1 - expected) / math.sqrt(keep.numel())  # 5 standard deviations of a product's mean
    for lag in (1, 4, 263):  # the next entry, the next draw's same lane, the next row
        assert abs((centred[:-lag] * centred[lag:]).mean()) <= bound, lag
    assert not torch.equal(keep, cpu_training.dropout_keep_mask(shape, dropout, "cpu"))
    torch.manual_seed(0)
    assert torch.equal(keep, cpu_training.dropout_keep_mask(shape, dropout, "cpu"))
    assert len(calls) == (3 if kernel else 0)


def test_model_dropout_on_the_cpu_drops_p_and_rescales_the_rest():
    """The model's hidden dropout (`Dropout`): in training, a fraction p of entries is zero and the rest are the
    input over 1 - p; in eval mode it is the identity."""
    from disentangled.modeling.modeling_disentangled import Dropout

    torch.manual_seed(0)
    hidden = torch.rand(4, 256, 512) + 1  # no zeros of its own
    dropout = Dropout(0.25).train()
    out = dropout(hidden)
    kept = out != 0
    assert torch.allclose(out[kept], hidden[kept] / 0.75)
    assert abs(1 - kept.double().mean().item() - 0.25) <= 5 * math.sqrt(0.25 * 0.75 / hidden.numel())
    assert torch.equal(dropout.eval()(hidden), hidden)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch", "kernel"])
def test_blocked_attention_in_bfloat16_with_dropout(monkeypatch, kernel, seed):
    """bfloat16 in, bfloat16 gradients out, close to float32 with the same dropout mask (a model cast to bf16),
    with and without the compiled kernels (the bias and its gradient, and dropout's draws), for 12 dropout seeds.
    Over them a gradient's worst element was up to 0.103 of its largest off (0.081 with the kernel's draws) and its
    norm-wise error up to 0.043: hence 0.12 and 0.05 (a wrong mask or dtype gives errors of the order of the gradient
    itself)."""
    calls = training_kernel(monkeypatch, kernel)
    *tensors, keep, positions = blocked_attention_inputs(torch.float32, length=20)
    low = [t.detach().bfloat16().requires_grad_() for t in tensors]
    results = []
    for inputs in (tensors, low):
        torch.manual_seed(seed)
        with dispatch.switched(DROPOUT_KERNEL=kernel):
            context = cpu_training.BlockedAttention.apply(*inputs, keep, positions, 0.3, 0.2, 2 * 3 * 20 * 7, kernel)
        grads = torch.autograd.grad(context.float().square().sum(), inputs)
        results.append((context, grads))
    (context, grads), (low_context, low_grads) = results
    assert low_context.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in low_grads)
    assert (low_context.float() - context).abs().max() <= 6e-2 * max(1.0, context.abs().max().item())
    for got, want in zip(low_grads, grads):
        assert (got.float() - want).abs().max() <= 0.12 * max(1.0, want.abs().max().item())
        assert (got.float() - want).norm() <= 5e-2 * want.norm()
    assert bool(calls) == kernel
