"""What a user expects of a PreTrainedModel: Auto classes, save/load, config checks, checkpointing, resizing."""

from __future__ import annotations

import pytest
import tiny_models
import torch
import transformers
from checkpointing import NO_OLD_NAMES, enable_checkpointing
from deberta_shapes import V2_SHAPES
from parity import inflate_weights, padded_batch

import disentangled
from disentangled import DisentangledConfig

TINY = dict(
    V2_SHAPES["deberta-v3-xsmall"], **tiny_models.TINY, vocab_size=128, position_buckets=8, max_relative_positions=32
)
AUTO_HEADS = {
    transformers.AutoModel: disentangled.DisentangledModel,
    transformers.AutoModelForMaskedLM: disentangled.DisentangledForMaskedLM,
    transformers.AutoModelForSequenceClassification: disentangled.DisentangledForSequenceClassification,
    transformers.AutoModelForTokenClassification: disentangled.DisentangledForTokenClassification,
    transformers.AutoModelForQuestionAnswering: disentangled.DisentangledForQuestionAnswering,
    transformers.AutoModelForMultipleChoice: disentangled.DisentangledForMultipleChoice,
}


def first_output(output) -> torch.Tensor:
    return output[0] if not hasattr(output, "logits") else output.logits


@pytest.mark.parametrize("auto_class", list(AUTO_HEADS), ids=lambda c: c.__name__)
def test_auto_classes_round_trip(tmp_path, auto_class):
    config = DisentangledConfig(**TINY)
    model = auto_class.from_config(config)
    assert type(model) is AUTO_HEADS[auto_class]
    inflate_weights(model)
    model.save_pretrained(tmp_path)
    assert transformers.AutoConfig.from_pretrained(tmp_path).model_type == "disentangled"
    loaded, info = auto_class.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    batch = padded_batch(128, [20, 13])
    if auto_class is transformers.AutoModelForMultipleChoice:
        batch = {k: v.unsqueeze(0) for k, v in batch.items()}
    with torch.no_grad():
        expected, actual = first_output(model.eval()(**batch)), first_output(loaded.eval()(**batch))
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_return_dict_false_gives_transformers_tuple_layout():
    model = disentangled.DisentangledForSequenceClassification(DisentangledConfig(**TINY, num_labels=3)).eval()
    batch = padded_batch(128, [9, 5])
    labels = torch.tensor([0, 2])
    as_dict = model(**batch, labels=labels, output_hidden_states=True, output_attentions=True)
    as_tuple = model(**batch, labels=labels, output_hidden_states=True, output_attentions=True, return_dict=False)
    assert len(as_tuple) == 4
    torch.testing.assert_close(as_tuple[0], as_dict.loss)
    torch.testing.assert_close(as_tuple[1], as_dict.logits)
    assert len(as_tuple[2]) == TINY["num_hidden_layers"] + 1 and len(as_tuple[3]) == TINY["num_hidden_layers"]


@pytest.mark.parametrize(
    "problem_type, labels, reference",
    [
        ("regression", torch.tensor([[0.5], [-1.0]]), "mse"),
        ("single_label_classification", torch.tensor([1, 0]), "ce"),
        ("multi_label_classification", torch.tensor([[1.0, 0.0], [1.0, 1.0]]), "bce"),
    ],
)
def test_classification_losses_follow_problem_type(problem_type, labels, reference):
    num_labels = labels.shape[-1] if problem_type != "single_label_classification" else 2
    config = DisentangledConfig(**TINY, num_labels=num_labels, problem_type=problem_type)
    model = disentangled.DisentangledForSequenceClassification(config).eval()
    output = model(**padded_batch(128, [9, 5]), labels=labels)
    logits = output.logits
    expected = {
        "mse": lambda: torch.nn.functional.mse_loss(logits.squeeze(-1), labels.squeeze(-1)),
        "ce": lambda: torch.nn.functional.cross_entropy(logits, labels),
        "bce": lambda: torch.nn.functional.binary_cross_entropy_with_logits(logits, labels),
    }[reference]()
    torch.testing.assert_close(output.loss, expected)


@pytest.mark.parametrize(
    "fields, names",
    [
        (dict(pos_att_type=["c2p", "x2y"]), "pos_att_type"),
        (dict(pos_att_type="c2p|q2q"), "pos_att_type"),
        (dict(hidden_size=-2), "hidden_size"),
        (dict(num_hidden_layers=-1), "num_hidden_layers"),
        (dict(vocab_size=1.5), "vocab_size"),
        (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob"),
        (dict(norm_rel_ebd="batch_norm"), "norm_rel_ebd"),
        (dict(conv_kernel_size=2), "conv_kernel_size"),
        (dict(type_vocab_size=-1), "type_vocab_size"),
        (dict(talking_head=True), "talking_head"),
    ],
)
def test_invalid_config_fails_at_construction_naming_the_field(fields, names):
    # Rules between fields (heads dividing hidden_size, log-bucket reach) wait for a model: tests/test_config_rules.py
    with pytest.raises(ValueError, match=names):
        DisentangledConfig(**fields)


def test_pos_att_type_string_and_list_forms_agree():
    assert DisentangledConfig(pos_att_type="P2C | c2p").pos_att_type == ["p2c", "c2p"]
    assert DisentangledConfig(pos_att_type=["c2p", "p2p"]).pos_att_type == ["c2p", "p2p"]
    assert DisentangledConfig(hidden_size=30, num_attention_heads=4, attention_head_size=8).head_size == 8


def test_deberta_v2_config_json_keeps_deberta_v2_meaning_of_absent_fields():
    reference = transformers.DebertaV2Config(hidden_size=32, num_attention_heads=4)
    config = DisentangledConfig.from_dict(reference.to_dict())
    assert config.relative_attention is False and config.position_buckets == -1 and config.share_att_key is False


def gradients(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(**batch).logits.pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@NO_OLD_NAMES
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    # norm_rel_ebd="layer_norm": the relative embeddings are normalised outside the checkpointed layers,
    # which breaks transformers' own DeBERTa-v2 under reentrant checkpointing.
    model = disentangled.DisentangledForTokenClassification(DisentangledConfig(**TINY, num_labels=3)).train()
    inflate_weights(model)
    batch = padded_batch(128, [20, 13])
    expected = gradients(model, batch)
    enable_checkpointing(model, use_reentrant)
    actual = gradients(model, batch)
    assert expected.keys() == actual.keys()
    assert any("rel_embeddings" in name for name in actual) and any("encoder.LayerNorm" in name for name in actual)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("legacy", [True, False])
def test_resize_token_embeddings_keeps_the_mlm_head_consistent(legacy):
    model = disentangled.DisentangledForMaskedLM(DisentangledConfig(**TINY, legacy=legacy)).eval()
    batch = padded_batch(128, [10, 6])
    with torch.no_grad():
        before = model(**batch).logits
    model.resize_token_embeddings(140)
    with torch.no_grad():
        after = model(**batch).logits
    assert after.shape[-1] == 140 and model.config.vocab_size == 140
    torch.testing.assert_close(after[..., :128], before)
    if legacy:  # the decoder is the word embedding matrix, and its bias is the head's bias
        assert model.cls.predictions.decoder.weight is model.deberta.embeddings.word_embeddings.weight
        assert model.cls.predictions.decoder.bias is model.cls.predictions.bias


def test_legacy_mlm_decoder_is_tied_to_word_embeddings_after_loading(tmp_path):
    model = disentangled.DisentangledForMaskedLM(DisentangledConfig(**TINY))
    model.save_pretrained(tmp_path)
    loaded = disentangled.DisentangledForMaskedLM.from_pretrained(tmp_path)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


def test_weight_init_is_deberta_like():
    model = disentangled.DisentangledForMaskedLM(DisentangledConfig(**TINY, initializer_range=0.02))
    query = model.deberta.encoder.layer[0].attention.self.query_proj
    assert abs(query.weight.std().item() - 0.02) < 0.006 and torch.count_nonzero(query.bias) == 0
    assert torch.count_nonzero(model.cls.predictions.bias) == 0
    assert torch.count_nonzero(model.deberta.embeddings.word_embeddings.weight[0]) == 0  # padding row


def test_feed_forward_product_goes_into_the_kept_workspace_only_where_nothing_can_hold_it():
    """In CPU inference every layer writes the feed-forward's [tokens, intermediate] product into one buffer of the
    encoder's workspace, kept between calls: the same output as a fresh product, bit for bit. Where a hook could
    keep the product (on the output layer's input here) or with gradients, each layer makes its own."""
    from disentangled.modeling import workspace

    config = DisentangledConfig(**TINY)
    torch.manual_seed(0)
    model = disentangled.DisentangledModel(config).eval()
    batch = padded_batch(config.vocab_size, [9, 6, 9])
    kept = workspace.kept_workspace(model.encoder)
    held = []  # what the output layers were given: each layer's own product, kept past the layer
    handles = [
        layer.output.dense.register_forward_pre_hook(lambda module, inputs: held.append(inputs[0]))
        for layer in model.encoder.layer
    ]
    with torch.no_grad():
        expected = model(**batch).last_hidden_state  # fresh products
    for handle in handles:
        handle.remove()
    assert "intermediate" not in kept
    assert len(held) == 2 and held[0].data_ptr() != held[1].data_ptr()
    with torch.no_grad():
        served = model(**batch).last_hidden_state
        buffer = kept["intermediate"]
        assert buffer.numel() == 3 * 9 * config.intermediate_size
        again = model(**batch).last_hidden_state
    assert kept["intermediate"] is buffer  # reused by the next call, as by every layer
    assert all(tensor.data_ptr() != buffer.data_ptr() for tensor in held)
    torch.testing.assert_close(served, expected, rtol=0, atol=0)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)

    workspace.release_workspace(model)
    kept = workspace.kept_workspace(model.encoder)
    trained = model(**batch).last_hidden_state  # gradients: a fresh product
    assert "intermediate" not in kept
    torch.testing.assert_close(trained, expected, rtol=1e-5, atol=1e-5)


def test_device_map_auto_loads(tmp_path):
    pytest.importorskip("accelerate")
    disentangled.DisentangledModel(DisentangledConfig(**TINY)).save_pretrained(tmp_path)
    model = transformers.AutoModel.from_pretrained(tmp_path, device_map="auto")
    assert model(**padded_batch(128, [7])).last_hidden_state.shape == (1, 7, 32)


def test_question_answering_needs_two_labels():
    with pytest.raises(ValueError, match="num_labels must be 2"):
        disentangled.DisentangledForQuestionAnswering(DisentangledConfig(**TINY, num_labels=3))


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new"])
def test_intermediate_gelu_runs_in_place_only_where_no_graph_needs_its_input(hidden_act):
    # In inference the exact GELU overwrites the dense layer's output (one [tokens, intermediate] tensor fewer);
    # where autograd needs that output, or for another activation, it is the module's own out-of-place function.
    config = DisentangledConfig(**{**TINY, "hidden_act": hidden_act})
    layer = disentangled.modeling.modeling_disentangled.DisentangledIntermediate(config)
    hidden = torch.randn(3, 5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = transformers.activations.ACT2FN[hidden_act](
        torch.nn.functional.linear(hidden, *layer.dense.parameters())
    )
    with torch.no_grad():
        served = layer(hidden)
    torch.testing.assert_close(served, expected, rtol=0, atol=0)
    assert served._version == (1 if hidden_act == "gelu" else 0)  # written once, in place, after the product
    seen = []  # a hook on the product keeps it as the dense layer made it
    handle = layer.dense.register_forward_hook(lambda module, inputs, output: seen.append(output))
    with torch.no_grad():
        torch.testing.assert_close(layer(hidden), expected, rtol=0, atol=0)
    handle.remove()
    torch.testing.assert_close(seen[0], torch.nn.functional.linear(hidden, *layer.dense.parameters()), rtol=0, atol=0)
    trained = layer(hidden)
    assert trained._version == 0
    torch.testing.assert_close(trained, expected, rtol=0, atol=0)
    trained.sum().backward()
    reference = torch.nn.Linear(config.hidden_size, config.intermediate_size)
    reference.load_state_dict(layer.dense.state_dict())
    transformers.activations.ACT2FN[hidden_act](reference(hidden)).sum().backward()
    torch.testing.assert_close(layer.dense.weight.grad, reference.weight.grad, rtol=1e-6, atol=1e-7)
