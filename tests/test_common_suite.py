"""transformers' own common model tests on every head: `ModelTesterMixin` and `ConfigTester`, three configurations.

This is the suite transformers runs on each of its models; a maintainer's first question about a custom architecture
is whether it passes it. The files come from the source distribution of the installed transformers (they are not in
the wheel): `python -m tests.common_suite_fetch` downloads and caches them (`.ci/run` does so before pytest); without
them this module is skipped, saying so.

Testers (tiny, as upstream's, so the whole module runs in a few minutes on two cores):
- `deberta_v2`: the configuration of transformers' own DeBERTa-v2 tester (tests/models/deberta_v2/): absolute
  positions and token types, no relative attention, `pos_att_type="None"`.
- `v3`: DeBERTa-v3-like: relative attention with a few log buckets (reached within the tester's sequences), shared
  keys, LayerNorm'd relative embeddings, no absolute positions, the `legacy=False` MLM head
  with the Enhanced Mask Decoder (as the v3 generators have it).
- `v1`: DeBERTa-v1-like: distances clipped to a span shorter than the sequences, separate position projections,
  absolute positions.

Not run, and why:
- `PipelineTesterMixin`: it loads tiny checkpoints of each architecture from the Hub, listed in
  tests/utils/tiny_model_summary.json (not in the source distribution); tests/test_pipelines.py runs our pipelines.
- transformers' torch.export tests (`ExportTesterMixin`, tests/exporters/, not in the source distribution; see
  tests/common_suite_fetch.py); tests/test_compile.py and tests/test_onnx_export.py export our models.
- The tests in `UPSTREAM_FAILURES`, which transformers' own DeBERTa-v2 fails on the same transformers version, each
  with the reason: none on 5.24 (`DISENTANGLED_COMMON_SUITE_UPSTREAM=all` adds `TestUpstreamDebertaV2`, the same
  suite and tester on transformers' DeBERTa-v2 classes, which is how that is known); none on 4.57 either. Nothing
  else is skipped by hand.
- Tests the mixin itself skips (no accelerator, flash attention, RoPE, MoE, deepspeed, ...): pytest lists them with
  transformers' reasons (`-rs`).

To test a new head: add it to `HEADS` (and to `disentangled.registration.AUTO_CLASSES`, which maps it to its task for
the mixin), and give `DisentangledModelTester.check_head` its output shape.
"""

from __future__ import annotations

import os
import sys
import unittest

import pytest
import torch
import transformers
from common_suite_fetch import is_fetched, suite_path

import disentangled
from disentangled import DisentangledConfig
from disentangled.registration import AUTO_CLASSES

VERSION = transformers.__version__
if not is_fetched() and os.environ.get("CI"):  # .ci/run fetches them first: their absence there is a failure
    raise RuntimeError(f"transformers {VERSION}'s common test files are missing; .ci/run fetches them before pytest")
if not is_fetched():
    pytest.skip(
        f"transformers {VERSION}'s common test files are not fetched (they are not in the wheel); "
        "run `python -m tests.common_suite_fetch` (needs the package index) and run pytest again",
        allow_module_level=True,
    )
pytest.importorskip("parameterized", reason="transformers' test_modeling_common.py imports parameterized")
sys.path.insert(0, str(suite_path()))

from transformers.testing_utils import torch_device  # noqa: E402
from transformers_common_tests.test_configuration_common import ConfigTester  # noqa: E402
from transformers_common_tests.test_modeling_common import ModelTesterMixin, ids_tensor  # noqa: E402

HEADS = (
    disentangled.DisentangledModel,
    disentangled.DisentangledForMaskedLM,
    disentangled.DisentangledForSequenceClassification,
    disentangled.DisentangledForTokenClassification,
    disentangled.DisentangledForQuestionAnswering,
    disentangled.DisentangledForMultipleChoice,
    disentangled.DisentangledForReplacedTokenDetection,
)
UPSTREAM_HEADS = (
    transformers.DebertaV2Model,
    transformers.DebertaV2ForMaskedLM,
    transformers.DebertaV2ForSequenceClassification,
    transformers.DebertaV2ForTokenClassification,
    transformers.DebertaV2ForQuestionAnswering,
    transformers.DebertaV2ForMultipleChoice,
)

# Shared by all testers: the sizes of transformers' DeBERTa-v2 tester.
SIZES = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    hidden_act="gelu",
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    initializer_range=0.02,
)
TESTERS = {
    "deberta_v2": dict(
        max_position_embeddings=512,
        type_vocab_size=16,
        relative_attention=False,
        position_biased_input=True,
        pos_att_type="None",
    ),
    "v3": dict(
        max_position_embeddings=512,
        type_vocab_size=0,
        relative_attention=True,
        position_buckets=4,  # distances of 2 and more fall into log buckets within the 7-token sequences
        max_relative_positions=16,
        pos_att_type="p2c|c2p",
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        legacy=False,
        enhanced_mask_decoder=True,  # as DeBERTa-v3's generators: the masked-LM head runs the decoder
    ),
    "v1": dict(
        max_position_embeddings=512,
        type_vocab_size=0,
        relative_attention=True,
        position_buckets=-1,
        max_relative_positions=3,  # distances beyond 3 are clipped within the 7-token sequences
        pos_att_type="c2p|p2c",
        share_att_key=False,
        norm_rel_ebd="none",
        position_biased_input=True,
        legacy=True,
    ),
}

# Tests that transformers' own DeBERTa-v2 fails on a transformers version (prefix) with the `deberta_v2` tester:
# skipped here, with the reason upstream fails. 5.24.0: none (TestUpstreamDebertaV2: 83 passed, 0 failed).
UPSTREAM_FAILURES: dict[str, dict[str, str]] = {}


def upstream_failures() -> dict[str, str]:
    """The skips that apply to this transformers version, each with its reason."""
    skips = {}
    for prefix, tests in UPSTREAM_FAILURES.items():
        if VERSION.startswith(prefix):
            skips.update({name: "transformers' DeBERTa-v2 fails it too: " + reason for name, reason in tests.items()})
    return skips


@pytest.fixture(autouse=True)
def task_names_for_the_mixin():
    """The mixin picks labels and inputs by class name from transformers' task tables (MODEL_FOR_..._MAPPING_NAMES),
    where a model of transformers itself is listed; list ours there, as registered with the Auto classes (per test,
    which costs nothing, so that the suite's tests spread over pytest's processes: tests/conftest.py)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()  # the suite reads transformers' warnings (conftest quiets them)
    added = []
    for auto_class, model_class in AUTO_CLASSES.values():
        names = auto_class._model_mapping._model_mapping  # the MAPPING_NAMES table of this Auto class
        if DisentangledConfig.model_type not in names:
            names[DisentangledConfig.model_type] = model_class.__name__
            added.append(names)
    yield
    for names in added:
        del names[DisentangledConfig.model_type]
    transformers.logging.set_verbosity(verbosity)


class DisentangledModelTester:
    """Builds a config and inputs as transformers' DeBERTa-v2 tester does, for one configuration of `TESTERS`."""

    def __init__(
        self,
        parent,
        fields: dict,
        config_class=DisentangledConfig,
        batch_size: int = 13,
        seq_length: int = 7,
        is_training: bool = True,
        num_labels: int = 3,
        num_choices: int = 4,
        type_sequence_label_size: int = 2,
    ):
        self.parent = parent
        self.fields = {**SIZES, **fields}
        self.config_class = config_class
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.num_labels = num_labels
        self.num_choices = num_choices
        self.type_sequence_label_size = type_sequence_label_size
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "type_vocab_size"):
            setattr(self, name, self.fields[name])

    def get_config(self):
        return self.config_class(**self.fields)

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = ids_tensor([self.batch_size, self.seq_length], vocab_size=2)
        token_type_ids = (
            ids_tensor([self.batch_size, self.seq_length], self.type_vocab_size) if self.type_vocab_size else None
        )
        sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
        token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
        choice_labels = ids_tensor([self.batch_size], self.num_choices)
        return self.get_config(), input_ids, token_type_ids, input_mask, sequence_labels, token_labels, choice_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, token_type_ids, input_mask, *_ = self.prepare_config_and_inputs()
        inputs = {"input_ids": input_ids, "attention_mask": input_mask}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        return config, inputs

    def check_head(self, model_class) -> None:
        """What upstream's create_and_check_deberta_* check: each head's output shape, and a scalar loss."""
        config, input_ids, token_type_ids, input_mask, sequence_labels, token_labels, choice_labels = (
            self.prepare_config_and_inputs()
        )
        config.num_labels = self.num_labels if model_class.__name__.endswith("Classification") else config.num_labels
        model = model_class(config).eval()
        inputs = dict(input_ids=input_ids, attention_mask=input_mask, token_type_ids=token_type_ids)
        batch, length = self.batch_size, self.seq_length
        name = model_class.__name__.removeprefix("Disentangled").removeprefix("DebertaV2")
        if name == "Model":
            expected = {"last_hidden_state": (batch, length, self.hidden_size)}
        elif name == "ForMaskedLM":
            inputs["labels"] = token_labels
            expected = {"logits": (batch, length, self.vocab_size), "loss": ()}
        elif name == "ForSequenceClassification":
            inputs["labels"] = sequence_labels
            expected = {"logits": (batch, self.num_labels), "loss": ()}
        elif name == "ForTokenClassification":
            inputs["labels"] = token_labels
            expected = {"logits": (batch, length, self.num_labels), "loss": ()}
        elif name == "ForQuestionAnswering":
            inputs.update(start_positions=sequence_labels, end_positions=sequence_labels)
            expected = {"start_logits": (batch, length), "end_logits": (batch, length), "loss": ()}
        elif name == "ForMultipleChoice":
            inputs = {
                k: v.unsqueeze(1).expand(-1, self.num_choices, -1).contiguous()
                for k, v in inputs.items()
                if v is not None
            }
            inputs["labels"] = choice_labels
            expected = {"logits": (batch, self.num_choices), "loss": ()}
        elif name == "ForReplacedTokenDetection":
            inputs["labels"] = ids_tensor([batch, length], 2)
            expected = {"logits": (batch, length), "loss": ()}
        else:
            raise NotImplementedError(f"add the output shapes of {model_class.__name__} to check_head")
        with torch.no_grad():
            output = model(**inputs)
        for key, shape in expected.items():
            self.parent.assertEqual(tuple(output[key].shape), shape, msg=f"{model_class.__name__}.{key}")
            self.parent.assertTrue(torch.isfinite(output[key]).all(), msg=f"{model_class.__name__}.{key}")


class CommonSuite(ModelTesterMixin):
    """transformers' ModelTesterMixin plus ConfigTester on all heads, for the tester `tester`."""

    tester: str
    all_model_classes = HEADS
    config_class = DisentangledConfig
    is_encoder_decoder = False
    # The flags of transformers' DeBERTa-v2 tester (read by transformers 4.57's mixin; 5.x dropped these tests):
    # DeBERTa has no head pruning or head masking, and is not tested with TorchScript.
    test_torchscript = False
    test_pruning = False
    test_head_masking = False

    def setUp(self):
        self.model_tester = DisentangledModelTester(self, TESTERS[self.tester], config_class=self.config_class)
        # Like upstream's ConfigTester(self, config_class=DebertaV2Config, hidden_size=32): the other fields keep
        # their defaults, so cross-field rules must wait until a model is built.
        self.config_tester = ConfigTester(self, config_class=self.config_class, hidden_size=32)

    def test_config(self):
        self.config_tester.run_common_tests()

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        """With labels, the replaced-token-detection head gets one per token (as transformers' ELECTRA tests give
        its discriminator); the mixin knows no labels for AutoModelForPreTraining classes."""
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        if return_labels and model_class is disentangled.DisentangledForReplacedTokenDetection:
            shape = (self.model_tester.batch_size, self.model_tester.seq_length)
            inputs_dict["labels"] = torch.zeros(shape, dtype=torch.long, device=torch_device)
        return inputs_dict

    def test_heads_output_shapes(self):
        for model_class in self.all_model_classes:
            with self.subTest(model_class.__name__):
                self.model_tester.check_head(model_class)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.config_class is DisentangledConfig:
            for name, reason in upstream_failures().items():
                setattr(cls, name, unittest.skip(reason)(_skipped))


def _skipped(self):
    pass


class TestDebertaV2Tester(CommonSuite, unittest.TestCase):
    tester = "deberta_v2"


class TestV3Tester(CommonSuite, unittest.TestCase):
    tester = "v3"


class TestV1Tester(CommonSuite, unittest.TestCase):
    tester = "v1"


if os.environ.get("DISENTANGLED_COMMON_SUITE_UPSTREAM") == "all":  # how UPSTREAM_FAILURES is made; not run otherwise

    class TestUpstreamDebertaV2(CommonSuite, unittest.TestCase):
        """The same suite and tester on transformers' DeBERTa-v2: what upstream itself fails."""

        tester = "deberta_v2"
        all_model_classes = UPSTREAM_HEADS
        config_class = transformers.DebertaV2Config
