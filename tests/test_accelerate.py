"""`disentangled.accelerate(model)`, `restore(model)` and `enable()` / `disable()` on transformers' own DeBERTa models.

Each accelerated model is compared with the same transformers model unaccelerated, on the same weights and inputs:
outputs at real tokens (float32, 1e-5 of their scale) and every parameter's gradient (1e-4), for every released
shape, v1 and v2/v3, every head and the attention variants. Then what must not change (the parameters themselves,
`state_dict` keys, the saved files, transformers' classes after `disable()`) and what must be refused.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from deberta_shapes import V1_SHAPES, V2_SHAPES, cut
from isolated import REPO, run_isolated, system_python
from parity import check_parity, inflate_weights, padded_batch
from safetensors.torch import load_file

import disentangled
from disentangled.integrations.acceleration import AcceleratedEncoder, AcceleratedSelfAttention, is_accelerated
from disentangled.modeling import disentangled_attention

LENGTHS = [300, 171]  # beyond position_buckets (256): log buckets exercised; one padded row
V2_HEADS = ["Model", "MaskedLM", "SequenceClassification", "TokenClassification", "QuestionAnswering", "MultipleChoice"]
V1_HEADS = ["Model", "MaskedLM", "SequenceClassification", "TokenClassification", "QuestionAnswering"]


def reference_model(version: int, shape: dict, head: str = "Model", seed: int = 0, **overrides) -> torch.nn.Module:
    """transformers' DeBERTa (v1 or v2) with inflated seeded weights, dropout off, eval mode."""
    config_class = transformers.DebertaConfig if version == 1 else transformers.DebertaV2Config
    num_labels = 2 if head == "QuestionAnswering" else 3
    config = config_class(**cut(dict(shape, **overrides)), num_labels=num_labels)
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    prefix = "Deberta" if version == 1 else "DebertaV2"
    name = prefix + ("Model" if head == "Model" else f"For{head}")
    torch.manual_seed(seed)
    model = getattr(transformers, name)(config)
    inflate_weights(model, seed)
    return model.eval()


def accelerated_copy(model: torch.nn.Module, implementation: str | None = None) -> torch.nn.Module:
    return disentangled.accelerate(copy.deepcopy(model), attn_implementation=implementation)


@pytest.mark.parametrize("head", V2_HEADS)
def test_v3_heads_match_transformers(head):
    reference = reference_model(2, V2_SHAPES["deberta-v3-xsmall"], head)
    check_parity(reference, accelerated_copy(reference), head, padded_batch(1000, LENGTHS))


@pytest.mark.parametrize("head", V1_HEADS)
def test_v1_heads_match_transformers(head):
    reference = reference_model(1, V1_SHAPES["deberta-base"], head)
    check_parity(reference, accelerated_copy(reference), head, padded_batch(1000, LENGTHS))


# One of each kind of released shape: v3 at two widths, v2-xlarge (convolution, attention_head_size), v1. The larger
# v3 and v1 shapes and mDeBERTa differ from these only in width, which the same code reads (tests/test_parity_v2.py
# runs every shape through our own model).
SHAPES = [(2, "deberta-v3-xsmall"), (2, "deberta-v3-base"), (2, "deberta-v2-xlarge"), (1, "deberta-base")]


@pytest.mark.parametrize(
    "version, shape_name, implementation",
    [(*shape, "sdpa") for shape in SHAPES] + [(2, "deberta-v3-xsmall", "eager"), (1, "deberta-base", "eager")],
    ids=str,
)
def test_every_released_shape_matches_transformers(version, shape_name, implementation):
    shapes = V2_SHAPES if version == 2 else V1_SHAPES
    reference = reference_model(version, shapes[shape_name])
    accelerated = accelerated_copy(reference, implementation)
    diffs = check_parity(reference, accelerated, "Model", padded_batch(1000, LENGTHS))
    print(f"{shape_name} {implementation}: {diffs}")


VARIANTS = {
    "separate-position-projections": (2, dict(share_att_key=False)),
    "clipped-distances": (2, dict(position_buckets=-1, max_relative_positions=64)),
    "c2p-only": (2, dict(pos_att_type="c2p")),
    "p2c-only": (2, dict(pos_att_type="p2c")),
    "absolute-positions-token-types": (2, dict(position_biased_input=True, type_vocab_size=2)),
    "no-relative-attention": (2, dict(relative_attention=False, pos_att_type=None)),
    "v1-c2p-only": (1, dict(pos_att_type=["c2p"])),
    "v1-clipped-short-reach": (1, dict(max_relative_positions=64)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attention_variants_match_transformers(variant):
    version, overrides = VARIANTS[variant]
    shape = V2_SHAPES["deberta-v3-xsmall"] if version == 2 else V1_SHAPES["deberta-base"]
    reference = reference_model(version, shape, **overrides)
    batch = padded_batch(1000, LENGTHS)
    if "token_type_ids" in str(overrides) or overrides.get("type_vocab_size"):
        batch["token_type_ids"] = (torch.arange(300) > 100).long().expand(2, 300).contiguous()
    check_parity(reference, accelerated_copy(reference), "Model", batch)


@pytest.mark.parametrize("version", [1, 2])
def test_parameters_keys_and_saved_files_unchanged(tmp_path, version):
    shape = V2_SHAPES["deberta-v3-xsmall"] if version == 2 else V1_SHAPES["deberta-base"]
    model = reference_model(version, shape, "SequenceClassification")
    model.save_pretrained(tmp_path / "before")
    before = {name: (param, param.data_ptr()) for name, param in model.named_parameters()}
    keys = list(model.state_dict())

    assert disentangled.accelerate(model) is model  # in place, the same object back
    assert is_accelerated(model)
    after = dict(model.named_parameters())
    assert list(after) == list(before) and list(model.state_dict()) == keys
    for name, (param, pointer) in before.items():  # the same Parameter objects, the same storage
        assert after[name] is param and param.data_ptr() == pointer, name
    for module in model.modules():  # the modules are still transformers' classes
        if isinstance(module, (AcceleratedEncoder, AcceleratedSelfAttention)):
            assert isinstance(module, module.transformers_class)

    model.save_pretrained(tmp_path / "after")
    config_before = json.loads((tmp_path / "before" / "config.json").read_text())
    config_after = json.loads((tmp_path / "after" / "config.json").read_text())
    assert config_after == config_before and "auto_map" not in config_after
    assert config_after["model_type"] == ("deberta" if version == 1 else "deberta-v2")
    saved_before = load_file(tmp_path / "before" / "model.safetensors")
    saved_after = load_file(tmp_path / "after" / "model.safetensors")
    assert saved_before.keys() == saved_after.keys()
    assert all(torch.equal(saved_before[k], saved_after[k]) for k in saved_before)


LOAD_PLAIN = """
import sys, torch, transformers
model = transformers.AutoModelForSequenceClassification.from_pretrained(sys.argv[1]).eval()
ids = torch.arange(5, 45).view(2, 20)
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[2])
"""


def test_saved_folder_loads_in_plain_transformers_without_the_package(tmp_path):
    reference = reference_model(2, V2_SHAPES["deberta-v3-xsmall"], "SequenceClassification")
    accelerated = accelerated_copy(reference)
    accelerated.save_pretrained(tmp_path / "saved")
    script = tmp_path / "load_plain.py"
    script.write_text(LOAD_PLAIN)
    result = run_isolated(system_python(), script, [str(tmp_path / "saved"), str(tmp_path / "logits.pt")], cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = reference(input_ids=torch.arange(5, 45).view(2, 20)).logits
    assert torch.allclose(torch.load(tmp_path / "logits.pt", weights_only=True), expected, atol=1e-6, rtol=0)


def test_refuses_what_it_cannot_take():
    reference = reference_model(2, V2_SHAPES["deberta-v3-xsmall"])
    accelerated = accelerated_copy(reference)
    with pytest.raises(ValueError, match="accelerated already"):
        disentangled.accelerate(accelerated)
    with pytest.raises(ValueError, match="contains no transformers DebertaModel or DebertaV2Model"):
        disentangled.accelerate(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="contains no transformers"):
        disentangled.accelerate(
            disentangled.DisentangledModel(disentangled.DisentangledConfig(**cut(V2_SHAPES["deberta-v3-xsmall"])))
        )
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2' is not one of ours"):
        disentangled.accelerate(copy.deepcopy(reference), attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="torch.nn.Module"):
        disentangled.accelerate("microsoft/deberta-v3-base")

    p2p = reference_model(2, V2_SHAPES["deberta-v3-xsmall"], pos_att_type="p2c|c2p|p2p")
    with pytest.raises(ValueError, match="p2p"):
        disentangled.accelerate(p2p)
    assert not is_accelerated(p2p)  # refused before any module changed
    talking = reference_model(1, V1_SHAPES["deberta-base"], talking_head=True)
    with pytest.raises(ValueError, match="talking_head"):
        disentangled.accelerate(talking)
    assert not is_accelerated(talking)


def test_a_model_holding_several_backbones_is_accelerated_whole():
    """A wrapper with two DeBERTa models (a bi-encoder, a GLiNER-like module with its own heads): both swapped."""
    first = reference_model(2, V2_SHAPES["deberta-v3-xsmall"])
    second = reference_model(1, V1_SHAPES["deberta-base"], seed=1)
    wrapper = torch.nn.ModuleDict({"first": copy.deepcopy(first), "second": copy.deepcopy(second)})
    disentangled.accelerate(wrapper)
    batch = padded_batch(1000, [40, 23])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        for name, reference in (("first", first), ("second", second)):
            expected = reference(**batch).last_hidden_state
            assert (wrapper[name](**batch).last_hidden_state - expected)[real].abs().max() < 1e-5 * expected.abs().max()


def test_output_attentions_runs_our_eager_reference():
    """Probabilities come from our eager reference (a documented fallback): equal to transformers' at real rows."""
    reference = reference_model(2, V2_SHAPES["deberta-v3-xsmall"])
    accelerated = accelerated_copy(reference)
    batch = padded_batch(1000, [60, 37])
    real = batch["attention_mask"].bool()
    disentangled_attention._warned.clear()  # warned once per process: another test's call may have warned already
    with torch.no_grad(), pytest.warns(UserWarning, match="output_attentions=True runs eager"):
        ours = accelerated(**batch, output_attentions=True)
    with torch.no_grad():
        theirs = reference(**batch, output_attentions=True)
    assert len(ours.attentions) == len(theirs.attentions)
    for mine, their in zip(ours.attentions, theirs.attentions):
        assert (mine - their).abs().permute(0, 2, 1, 3)[real].max() < 1e-6
    assert (ours.last_hidden_state - theirs.last_hidden_state)[real].abs().max() < 1e-5


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    reference = reference_model(2, V2_SHAPES["deberta-v3-xsmall"], "SequenceClassification")
    accelerated = accelerated_copy(reference)
    accelerated.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    accelerated.train()  # checkpointing runs in training mode; dropout is 0
    assert any(getattr(m, "gradient_checkpointing", False) for m in accelerated.modules())
    check_parity(reference, accelerated, "SequenceClassification", padded_batch(1000, [120, 77]))


def test_training_with_dropout_runs_and_differs_from_eval():
    """Attention dropout (fine-tuning's 0.1) goes through our backends: finite gradients, outputs that vary."""
    reference = reference_model(2, V2_SHAPES["deberta-v3-xsmall"], "SequenceClassification")
    reference.config.attention_probs_dropout_prob = 0.1
    accelerated = accelerated_copy(reference)
    for module in accelerated.modules():
        if isinstance(module, AcceleratedSelfAttention):
            module.dropout_p = 0.1  # copied from the config when accelerated; set here after the fact
    accelerated.train()
    batch = padded_batch(1000, [80, 51])
    first = accelerated(**batch).logits
    second = accelerated(**batch).logits
    first.sum().backward()
    assert not torch.equal(first, second)
    assert all(torch.isfinite(p.grad).all() for p in accelerated.parameters() if p.grad is not None)


def test_torch_compile_same_outputs():
    reference = reference_model(2, V2_SHAPES["deberta-v3-xsmall"])
    compiled = torch.compile(accelerated_copy(reference), backend="eager")
    batch = padded_batch(1000, [64, 33])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        actual = compiled(**batch).last_hidden_state
    assert (actual - expected)[real].abs().max() < 1e-5 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_error_within_twice_transformers_own(dtype):
    reference = reference_model(2, V2_SHAPES["deberta-v3-xsmall"])
    batch = padded_batch(1000, [200, 117])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        exact = reference(**batch).last_hidden_state
        low = copy.deepcopy(reference).to(dtype)
        their_error = (low(**batch).last_hidden_state.float() - exact)[real].abs().max().item()
        our_error = (disentangled.accelerate(low)(**batch).last_hidden_state.float() - exact)[real].abs().max().item()
    print(f"{dtype}: ours {our_error:.2e}, transformers {their_error:.2e}")
    assert our_error <= 2 * their_error


def _deberta_class_state() -> dict:
    """What enable() may touch, as it is: the DeBERTa classes' own attributes and the Auto mappings."""
    from transformers.models.auto import modeling_auto

    classes = {
        cls: dict(vars(cls))
        for cls in (transformers.DebertaV2PreTrainedModel, transformers.DebertaPreTrainedModel)
        + tuple(
            getattr(transformers, n) for n in ("DebertaV2Model", "DebertaModel", "DebertaV2ForSequenceClassification")
        )
    }
    mappings = {
        name: dict(getattr(modeling_auto, name)._extra_content)
        for name in (
            "MODEL_MAPPING",
            "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING",
            "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING",
        )
    }
    return {"classes": classes, "mappings": mappings}


def _every_output(model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    """Every layer's hidden states, padded positions included (there the two attentions differ by design)."""
    with torch.no_grad():
        return list(model(**batch, output_hidden_states=True).hidden_states)


@pytest.mark.parametrize("version", [2, 1])
def test_restore_gives_back_transformers_model(version):
    """`restore` undoes `accelerate`: transformers' classes and attributes, the same parameter tensors, and every
    output equal to the original's bit for bit, padded positions included, where the accelerated model's differ."""
    shape = V2_SHAPES["deberta-v3-xsmall"] if version == 2 else V1_SHAPES["deberta-base"]
    original = reference_model(version, shape, "SequenceClassification")
    model = copy.deepcopy(original)
    classes = [type(module) for module in model.modules()]
    attributes = [sorted(vars(module)) for module in model.modules()]
    tensors = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    batch = padded_batch(1000, [90, 41])
    expected = _every_output(original, batch)

    disentangled.accelerate(model)
    accelerated = _every_output(model, batch)
    assert not all(torch.equal(a, b) for a, b in zip(accelerated, expected))  # the check below would fail here
    assert disentangled.restore(model) is model

    assert not is_accelerated(model)
    assert [type(module) for module in model.modules()] == classes
    assert [sorted(vars(module)) for module in model.modules()] == attributes
    assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == tensors
    for restored, reference in zip(_every_output(model, batch), expected, strict=True):
        assert torch.equal(restored, reference)
    with pytest.raises(ValueError, match="nothing to restore"):
        disentangled.restore(model)
    disentangled.accelerate(model, attn_implementation="eager")  # and it can be accelerated again
    assert {m.implementation for m in model.modules() if isinstance(m, AcceleratedSelfAttention)} == {"eager"}


def test_restore_undoes_enable_on_a_model_built_under_it():
    config = transformers.DebertaV2Config(**cut(V2_SHAPES["deberta-v3-xsmall"]))
    try:
        disentangled.enable()
        model = transformers.DebertaV2Model(config)
    finally:
        disentangled.disable()
    assert is_accelerated(model)
    disentangled.restore(model)
    assert type(model.encoder) is transformers.models.deberta_v2.modeling_deberta_v2.DebertaV2Encoder
    assert not is_accelerated(model)


def test_enable_accelerates_models_built_afterwards_and_disable_restores(tmp_path):
    reference = reference_model(2, V2_SHAPES["deberta-v3-xsmall"], "SequenceClassification")
    reference.save_pretrained(tmp_path / "v3")
    reference_model(1, V1_SHAPES["deberta-base"]).save_pretrained(tmp_path / "v1")
    state = _deberta_class_state()
    batch = padded_batch(1000, [90, 41])
    real = batch["attention_mask"].bool()
    try:
        disentangled.enable()
        disentangled.enable()  # twice is the same as once
        auto = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "v3").eval()
        direct = transformers.DebertaV2ForSequenceClassification.from_pretrained(tmp_path / "v3").eval()
        v1 = transformers.AutoModel.from_pretrained(tmp_path / "v1")
        built = transformers.AutoModel.from_config(transformers.DebertaV2Config(**cut(V2_SHAPES["deberta-v3-xsmall"])))
        for model in (auto, direct, v1, built):
            assert is_accelerated(model), type(model).__name__
        attentions = [m for m in auto.modules() if isinstance(m, AcceleratedSelfAttention)]
        assert len(attentions) == auto.config.num_hidden_layers and {m.implementation for m in attentions} == {"sdpa"}
        with torch.no_grad():
            assert (auto(**batch).logits - reference(**batch).logits).abs().max() < 1e-5
        with pytest.raises(ValueError, match="accelerated already"):
            disentangled.accelerate(auto)
    finally:
        disentangled.disable()
    disentangled.disable()  # twice is harmless
    assert _deberta_class_state() == state
    plain = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "v3").eval()
    assert not is_accelerated(plain)
    with torch.no_grad():
        hidden = plain.deberta(**batch).last_hidden_state
        assert (accelerated_copy(plain).deberta(**batch).last_hidden_state - hidden)[real].abs().max() < 1e-5


def test_enable_with_another_backend():
    try:
        disentangled.enable("eager")
        model = transformers.DebertaV2Model(transformers.DebertaV2Config(**cut(V2_SHAPES["deberta-v3-xsmall"])))
    finally:
        disentangled.disable()
    assert {m.implementation for m in model.modules() if isinstance(m, AcceleratedSelfAttention)} == {"eager"}
    with pytest.raises(ValueError, match="not one of ours"):
        disentangled.enable("flash_attention_2")
    assert not disentangled.integrations.acceleration.enabled()


def test_enable_builds_an_unsupported_config_plain_with_a_warning():
    """Under enable(), a config accelerate() refuses (p2p listed) is built as transformers builds it, with a warning."""
    config = transformers.DebertaV2Config(**cut(dict(V2_SHAPES["deberta-v3-xsmall"], pos_att_type="p2c|c2p|p2p")))
    try:
        disentangled.enable()
        with pytest.warns(UserWarning, match="p2p.*runs transformers' own attention"):
            model = transformers.DebertaV2ForSequenceClassification(config)
    finally:
        disentangled.disable()
    assert not is_accelerated(model)
