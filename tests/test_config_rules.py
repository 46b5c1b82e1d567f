"""A config accepts what transformers' DeBERTa configs accept, with the same meaning; rules that tie fields together
are checked when a model is built; a transformers DeBERTa-v2 folder loads as what it is, without a warning."""

from __future__ import annotations

import pytest
import tiny_models
import torch
import transformers
from transformers.testing_utils import CaptureLogger

import disentangled
from disentangled import DisentangledConfig

TINY = dict(tiny_models.TINY, vocab_size=99, intermediate_size=37)


@pytest.mark.parametrize("spelling", ["None", "none", " NONE ", None, [], ["none"], ("None",), "none|none"])
def test_pos_att_type_none_means_no_position_terms(spelling):
    assert DisentangledConfig(pos_att_type=spelling).pos_att_type == []


@pytest.mark.parametrize("spelling", ["c2x", "c2p|c2x", ["c2p", "x2y"], "none|p2q"])
def test_pos_att_type_typos_are_still_rejected(spelling):
    with pytest.raises(ValueError, match=r"pos_att_type: unsupported entries \['(c2x|x2y|p2q)'\]"):
        DisentangledConfig(pos_att_type=spelling)


@pytest.mark.parametrize("relative_attention", [False, True])
def test_pos_att_type_none_scales_as_transformers_deberta_v2(relative_attention):
    """transformers' DeBERTa-v2 scales by sqrt(head_dim * (1 + number of c2p/p2c terms)): "None" counts none. Same
    weights, same outputs, in both the upstream tester's configuration and with relative embeddings that add nothing."""
    fields = dict(TINY, pos_att_type="None", relative_attention=relative_attention, position_biased_input=True)
    fields.update(type_vocab_size=16, max_position_embeddings=64)
    if relative_attention:
        fields.update(position_buckets=4, max_relative_positions=16, norm_rel_ebd="layer_norm", share_att_key=True)
    reference = transformers.DebertaV2Model(transformers.DebertaV2Config(**fields)).eval()
    ours = disentangled.DisentangledModel(DisentangledConfig(**fields)).eval()
    missing, unexpected = ours.load_state_dict(reference.state_dict(), strict=False)
    assert not missing and not unexpected
    assert ours.encoder.layer[0].attention.self.scaling == pytest.approx((32 // 4) ** -0.5)
    input_ids = torch.randint(1, 99, (3, 9))
    mask = torch.ones_like(input_ids).index_fill(1, torch.tensor([7, 8]), 0)
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=mask).last_hidden_state
        actual = ours(input_ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(actual[mask.bool()], expected[mask.bool()], rtol=1e-5, atol=1e-5)


# Rules between fields: a config holding them is fine (configs are built in steps); building a model is not.
CROSS_FIELD = [
    (dict(hidden_size=30, num_attention_heads=4), r"hidden_size \(30\) is not divisible by num_attention_heads \(4\)"),
    (
        dict(position_buckets=256, max_relative_positions=100),
        r"max_relative_positions \(100\) must exceed position_buckets // 2 \+ 1 \(129\)",
    ),
    (
        dict(position_buckets=256, max_relative_positions=-1, max_position_embeddings=64),
        r"max_position_embeddings \(64\) must exceed position_buckets // 2 \+ 1 \(129\)",
    ),
    (dict(hidden_size=32, conv_kernel_size=3, conv_groups=3), r"conv_groups \(3\) must divide hidden_size \(32\)"),
]


@pytest.mark.parametrize("fields, message", CROSS_FIELD)
@pytest.mark.parametrize("head", ["DisentangledModel", "DisentangledForSequenceClassification"])
def test_cross_field_rules_are_checked_when_a_model_is_built(fields, message, head):
    config = DisentangledConfig(**{**TINY, **fields})  # accepted: a config may be mid-edit
    with pytest.raises(ValueError, match=message):
        getattr(disentangled, head)(config)


def test_configs_built_in_steps_as_the_ecosystem_does():
    config = DisentangledConfig(hidden_size=32)  # 32 is not divisible by the default 12 heads: not yet a model
    config.update({"num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 37, "vocab_size": 99})
    config.position_buckets, config.max_relative_positions = 4, 16
    model = disentangled.DisentangledModel(config)
    assert model(torch.randint(1, 99, (1, 5))).last_hidden_state.shape == (1, 5, 32)
    with pytest.raises(ValueError, match="num_attention_heads"):  # an edit that breaks a rule shows at the next build
        config.num_attention_heads = 5
        disentangled.DisentangledModel(config)


def test_a_single_bad_field_still_fails_in_the_config():
    with pytest.raises(ValueError, match="position_buckets must be an integer"):
        DisentangledConfig(position_buckets=4.5)
    with pytest.raises(ValueError, match="hidden_size must be an integer >= 0"):
        DisentangledConfig(hidden_size=-1)


def test_a_zero_size_passes_the_config_and_fails_when_a_model_is_built():
    """transformers 4.57's ConfigTester builds Config(hidden_size=0) (as DebertaV2Config accepts it): a model needs 1."""
    for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        config = DisentangledConfig(**{name: 0})
        assert getattr(config, name) == 0
        with pytest.raises(ValueError, match=f"{name} must be a positive integer, got 0"):
            disentangled.DisentangledModel(config)


@pytest.mark.parametrize("head", ["Model", "ForMaskedLM", "ForSequenceClassification"])
def test_deberta_v2_folder_loads_directly_without_a_model_type_warning(tmp_path, head):
    fields = dict(TINY, relative_attention=True, position_buckets=4, max_relative_positions=16)
    fields.update(pos_att_type="p2c|c2p", share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False)
    reference = getattr(transformers, f"DebertaV2{head}")(transformers.DebertaV2Config(**fields)).eval()
    reference.save_pretrained(tmp_path)
    logger = transformers.logging.get_logger("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    try:
        with CaptureLogger(logger) as control:  # the warning exists, and would be seen here
            transformers.BertConfig.from_pretrained(tmp_path)
        with CaptureLogger(logger) as captured:
            ours, info = getattr(disentangled, f"Disentangled{head}").from_pretrained(
                tmp_path, output_loading_info=True
            )
    finally:
        transformers.logging.set_verbosity(verbosity)
    assert "to instantiate a model of type" in control.out
    assert "to instantiate a model of type" not in captured.out and "deberta-v2" not in captured.out
    assert ours.config.model_type == "disentangled" and ours.config.position_buckets == 4
    assert not info["missing_keys"] and not info["unexpected_keys"]
    input_ids = torch.randint(1, 99, (2, 9))
    with torch.no_grad():
        expected, actual = reference(input_ids)[0], ours.eval()(input_ids)[0]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_legacy_mlm_bias_is_declared_as_transformers_declares_it(tmp_path):
    """Untied (tie_word_embeddings=False) the decoder keeps its own bias through save and load; tied, one tensor."""
    tied = disentangled.DisentangledForMaskedLM(DisentangledConfig(**TINY))
    assert tied.cls.predictions.decoder.bias is tied.cls.predictions.bias
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    untied = disentangled.DisentangledForMaskedLM(DisentangledConfig(**TINY, tie_word_embeddings=False))
    with torch.no_grad():
        untied.cls.predictions.decoder.bias.normal_()
    untied.save_pretrained(tmp_path)
    loaded, info = disentangled.DisentangledForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert loaded.cls.predictions.decoder.bias is not loaded.cls.predictions.bias
    torch.testing.assert_close(loaded.cls.predictions.decoder.bias, untied.cls.predictions.decoder.bias)


def test_every_parameter_gets_a_gradient_without_relative_attention(tmp_path):
    """No relative attention, norm_rel_ebd at its default "layer_norm": no LayerNorm of relative embeddings that
    nothing reads (a parameter without gradient breaks DDP); DeBERTa-v2 checkpoints that hold one still load."""
    config = DisentangledConfig(**TINY, relative_attention=False, position_biased_input=True)
    model = disentangled.DisentangledForTokenClassification(config).train()
    model(torch.randint(1, 99, (2, 7)), labels=torch.zeros(2, 7, dtype=torch.long)).loss.backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []
    fields = dict(TINY, relative_attention=False, norm_rel_ebd="layer_norm", position_biased_input=True)
    reference = transformers.DebertaV2Model(transformers.DebertaV2Config(**fields)).eval()
    assert hasattr(reference.encoder, "LayerNorm")  # transformers builds it, unused, and saves it
    reference.save_pretrained(tmp_path)
    ours, info = disentangled.DisentangledModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    input_ids = torch.randint(1, 99, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(input_ids)[0], reference(input_ids)[0], rtol=1e-5, atol=1e-5)


def test_v3_fields_are_the_released_configs():
    """`V3_FIELDS`, the one home of DeBERTa-v3's fields beyond its sizes, against the released config.json's (as
    tests/deberta_shapes.py writes them down, field by field), and the config's defaults agree with it."""
    from deberta_shapes import V3_COMMON

    from disentangled.configuration.configuration_disentangled import V3_FIELDS

    assert V3_FIELDS == {name: V3_COMMON[name] for name in V3_FIELDS}
    built, defaults = DisentangledConfig(**V3_FIELDS), DisentangledConfig()
    assert all(getattr(built, name) == getattr(defaults, name) for name in V3_FIELDS)
