"""Configuration of the disentangled-attention (DeBERTa) model family.

`DisentangledConfig` accepts every field of transformers' `DebertaConfig` (v1) and `DebertaV2Config`
(v2, v3, mDeBERTa) with the same meaning; its defaults describe DeBERTa-v3-base. Invalid values fail
here, at construction, with a ValueError that names the field and what is allowed; rules that tie fields together
(heads dividing the hidden size, the reach of log buckets) are checked by `validate_for_model` when a model is
built, as transformers does.

This file is shipped unchanged as Hub remote code: stdlib, `transformers` only.
"""

from __future__ import annotations

from transformers import PretrainedConfig

POSITION_TERMS = ("c2p", "p2c", "p2p")
REL_EMBEDDING_NORMS = ("none", "layer_norm")

# What a missing field means in a transformers DeBERTa config.json: DebertaV2 reads these with
# getattr(config, name, default), so a v2 config without them must not pick up our v3 defaults.
DEBERTA_V2_ABSENT_DEFAULTS = {
    "relative_attention": False,
    "max_relative_positions": -1,
    "position_buckets": -1,
    "pos_att_type": None,
    "share_att_key": False,
    "position_biased_input": True,
    "norm_rel_ebd": "none",
    "conv_kernel_size": 0,
    "conv_groups": 1,
    "conv_act": "tanh",
    "type_vocab_size": 0,
    "layer_norm_eps": 1e-7,
    "legacy": True,
    "max_position_embeddings": 512,
}


# DeBERTa-v3's fields beyond its sizes, as its released config.json writes them (our defaults, but not transformers'
# DebertaV2Config's): written once here for every place that builds a v3-shaped config of ours or of transformers from
# parts (the demo's stand-in, pretraining's presets, the memory table, the benchmarks); tests/deberta_shapes.py checks
# them against the released files' fields.
V3_FIELDS = dict(
    relative_attention=True,
    position_buckets=256,
    max_relative_positions=-1,
    pos_att_type="p2c|c2p",
    share_att_key=True,
    position_biased_input=False,
    norm_rel_ebd="layer_norm",
    max_position_embeddings=512,
    type_vocab_size=0,
    layer_norm_eps=1e-7,
)


class DisentangledConfig(PretrainedConfig):
    r"""Configuration for [`DisentangledModel`] and its heads.

    Args:
        vocab_size: Size of the token vocabulary.
        hidden_size: Width of the content stream H and of the relative embeddings P.
        num_hidden_layers: Number of transformer layers.
        num_attention_heads: Number of attention heads.
        intermediate_size: Width of the feed-forward layer.
        hidden_act: Feed-forward (and MLM transform) activation, a key of `transformers.activations.ACT2FN`.
        hidden_dropout_prob: Dropout on embeddings, residual branches and relative embeddings.
        attention_probs_dropout_prob: Dropout on attention probabilities.
        max_position_embeddings: Size of the absolute position table (only read when
            `position_biased_input` or `enhanced_mask_decoder`), and the relative span when
            `max_relative_positions < 1`.
        type_vocab_size: Number of token types; 0 disables token-type embeddings.
        initializer_range: Standard deviation of the normal weight initialisation.
        layer_norm_eps: LayerNorm epsilon.
        relative_attention: Enable the position terms (c2p, p2c, p2p) of disentangled attention.
        max_relative_positions: Largest relative distance k (v1, or v2 without buckets); < 1 means
            `max_position_embeddings`. With `position_buckets > 0` it is the distance the log buckets reach.
        position_buckets: Buckets per side of the log-bucketed relative distance (v2/v3: 256); <= 0 clips
            distances to `max_relative_positions` instead.
        pos_att_type: Position terms to add, from "c2p", "p2c", "p2p"; a list or a "c2p|p2c" string. "None" (or
            None, or an empty list) adds none, as in transformers.
        share_att_key: Project relative embeddings with the content query/key projections (v2/v3) instead
            of separate `pos_query_proj` / `pos_key_proj`.
        position_biased_input: Add absolute position embeddings to the input (v1 and v2 do, v3 does not).
        norm_rel_ebd: "layer_norm" to LayerNorm the relative embeddings (v2/v3), or "none".
        attention_head_size: Per-head width; defaults to `hidden_size // num_attention_heads`.
        conv_kernel_size: Kernel of the convolution added after the first layer (deberta-v2-xlarge: 3); 0 = none.
        conv_groups: Groups of that convolution.
        conv_act: Activation of that convolution.
        embedding_size: Width of the word embeddings; an `embed_proj` maps it to `hidden_size` when it differs.
        pooler_hidden_size: Width of the context pooler; defaults to `hidden_size`.
        pooler_dropout: Dropout before the context pooler's dense layer.
        pooler_hidden_act: Activation of the context pooler.
        cls_dropout: Dropout before the classifier of pooled heads; defaults to `hidden_dropout_prob`.
        legacy: MLM head layout: True is transformers' `cls.predictions`, False DeBERTa-v3's
            `lm_predictions.lm_head`.
        enhanced_mask_decoder: Masked-LM logits through DeBERTa's Enhanced Mask Decoder (Microsoft's
            `MaskedLanguageModel`): the last layer runs twice more on queries Z + H, with Z the absolute position
            embeddings and H the last layer's input. The masked-LM head then keeps `position_embeddings` also when
            `position_biased_input` is False (other heads build no table they would not read). Needs `legacy=False` and `embedding_size == hidden_size`.
        talking_head: Accepted for v1 configs; only False is supported (no released checkpoint uses it).
    """

    model_type = "disentangled"

    def __init__(
        self,
        vocab_size: int = 128100,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        hidden_act: str = "gelu",
        hidden_dropout_prob: float = 0.1,
        attention_probs_dropout_prob: float = 0.1,
        max_position_embeddings: int = 512,
        type_vocab_size: int = 0,
        initializer_range: float = 0.02,
        layer_norm_eps: float = 1e-7,
        relative_attention: bool = True,
        max_relative_positions: int = -1,
        position_buckets: int = 256,
        pos_att_type: str | list[str] | tuple[str, ...] | None = ("p2c", "c2p"),
        share_att_key: bool = True,
        position_biased_input: bool = False,
        norm_rel_ebd: str = "layer_norm",
        attention_head_size: int | None = None,
        conv_kernel_size: int = 0,
        conv_groups: int = 1,
        conv_act: str = "tanh",
        embedding_size: int | None = None,
        pooler_hidden_size: int | None = None,
        pooler_dropout: float = 0.0,
        pooler_hidden_act: str = "gelu",
        cls_dropout: float | None = None,
        legacy: bool = True,
        talking_head: bool = False,
        enhanced_mask_decoder: bool = False,
        pad_token_id: int = 0,
        **kwargs,
    ):
        if pos_att_type is None:
            pos_att_type = []
        if isinstance(pos_att_type, str):  # checkpoints store "p2c|c2p"; "None" is transformers' "no position terms"
            pos_att_type = [part.strip() for part in pos_att_type.lower().split("|") if part.strip()]
        # "none" is no term (transformers' DeBERTa-v2 tester and Microsoft's configs write "None"): dropped here, so
        # the scaling counts the terms that are there, as transformers' DeBERTa-v2 does.
        pos_att_type = [str(term).lower() for term in pos_att_type if term is not None and str(term).lower() != "none"]
        if unknown := set(pos_att_type) - set(POSITION_TERMS):
            raise ValueError(
                f'pos_att_type: unsupported entries {sorted(unknown)}; allowed: {list(POSITION_TERMS)}, or "none"'
            )
        if len(set(pos_att_type)) != len(pos_att_type):
            raise ValueError(f"pos_att_type: duplicate entries in {pos_att_type}")

        # A size of 0 is a config transformers accepts (its ConfigTester builds hidden_size=0): a model needs >= 1.
        for name, value in (
            ("vocab_size", vocab_size),
            ("hidden_size", hidden_size),
            ("num_hidden_layers", num_hidden_layers),
            ("num_attention_heads", num_attention_heads),
            ("intermediate_size", intermediate_size),
            ("max_position_embeddings", max_position_embeddings),
        ):
            _require_int(name, value, minimum=0)
        for name, value in (
            ("attention_head_size", attention_head_size),
            ("embedding_size", embedding_size),
            ("pooler_hidden_size", pooler_hidden_size),
        ):
            if value is not None:
                _require_positive_int(name, value)
        if not isinstance(type_vocab_size, int) or type_vocab_size < 0:
            raise ValueError(
                f"type_vocab_size must be an integer >= 0 (0 disables token types), got {type_vocab_size!r}"
            )
        if not isinstance(conv_kernel_size, int) or conv_kernel_size < 0:
            raise ValueError(
                f"conv_kernel_size must be an integer >= 0 (0 disables the conv layer), got {conv_kernel_size!r}"
            )
        if conv_kernel_size > 0 and conv_kernel_size % 2 == 0:
            raise ValueError(
                f"conv_kernel_size must be odd so the convolution keeps the length, got {conv_kernel_size}"
            )
        _require_positive_int("conv_groups", conv_groups)
        for name, value in (
            ("hidden_dropout_prob", hidden_dropout_prob),
            ("attention_probs_dropout_prob", attention_probs_dropout_prob),
            ("pooler_dropout", pooler_dropout),
            ("cls_dropout", cls_dropout),
        ):
            if value is not None and not 0.0 <= float(value) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if not float(layer_norm_eps) > 0:
            raise ValueError(f"layer_norm_eps must be > 0, got {layer_norm_eps!r}")
        norms = [part.strip() for part in str(norm_rel_ebd).lower().split("|") if part.strip()]
        if unknown := set(norms) - set(REL_EMBEDDING_NORMS):
            raise ValueError(
                f"norm_rel_ebd: unsupported entries {sorted(unknown)}; allowed: {list(REL_EMBEDDING_NORMS)}"
            )
        if not isinstance(enhanced_mask_decoder, bool):
            raise ValueError(f"enhanced_mask_decoder must be True or False, got {enhanced_mask_decoder!r}")
        if talking_head:
            raise ValueError(
                "talking_head=True is not supported (no released DeBERTa checkpoint uses it); set talking_head=False"
            )
        if isinstance(position_buckets, bool) or not isinstance(position_buckets, int):
            raise ValueError(f"position_buckets must be an integer (<= 0 disables buckets), got {position_buckets!r}")
        if position_buckets == 1:  # the log buckets divide by half of it
            raise ValueError(
                "position_buckets = 1 leaves no room for log buckets (they divide by position_buckets // 2): use 2 or "
                "more (DeBERTa-v3: 256), or <= 0 for clipped distances"
            )
        if isinstance(max_relative_positions, bool) or not isinstance(max_relative_positions, int):
            raise ValueError(
                f"max_relative_positions must be an integer (< 1 means max_position_embeddings), got "
                f"{max_relative_positions!r}"
            )

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.initializer_range = initializer_range
        self.layer_norm_eps = layer_norm_eps
        self.relative_attention = relative_attention
        self.max_relative_positions = max_relative_positions
        self.position_buckets = position_buckets
        self.pos_att_type = pos_att_type
        self.share_att_key = share_att_key
        self.position_biased_input = position_biased_input
        self.norm_rel_ebd = "|".join(norms) if norms else "none"
        self.attention_head_size = attention_head_size
        self.conv_kernel_size = conv_kernel_size
        self.conv_groups = conv_groups
        self.conv_act = conv_act
        self.embedding_size = embedding_size
        self.pooler_hidden_size = pooler_hidden_size
        self.pooler_dropout = pooler_dropout
        self.pooler_hidden_act = pooler_hidden_act
        self.cls_dropout = cls_dropout
        self.legacy = legacy
        self.talking_head = talking_head
        self.enhanced_mask_decoder = enhanced_mask_decoder
        kwargs.setdefault("tie_word_embeddings", True)  # the legacy MLM decoder is the word embedding matrix
        super().__init__(pad_token_id=pad_token_id, **kwargs)

    def validate_for_model(self) -> None:
        """The rules that tie fields together, checked when a model is built (`DisentangledModel.__init__`), not when
        a config is: configs are built in steps (`AutoConfig` then edits, `config.update`, hyper-parameter search),
        and transformers' own configs accept such intermediate states too. Raises a ValueError naming both fields."""
        for name in MODEL_SIZES:  # 0 passes the config (as in transformers); a model needs at least 1
            _require_int(name, getattr(self, name), minimum=1)
        if self.attention_head_size is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); change one of them or set attention_head_size explicitly"
            )
        if self.conv_kernel_size > 0 and self.hidden_size % self.conv_groups != 0:
            raise ValueError(f"conv_groups ({self.conv_groups}) must divide hidden_size ({self.hidden_size})")
        # log((reach - 1) / mid) must be > 0 for log buckets
        if (
            self.relative_attention
            and 0 < self.position_buckets
            and self.max_relative_distance <= self.position_buckets // 2 + 1
        ):
            source = "max_relative_positions" if self.max_relative_positions > 0 else "max_position_embeddings"
            raise ValueError(
                f"{source} ({self.max_relative_distance}) must exceed position_buckets // 2 + 1 "
                f"({self.position_buckets // 2 + 1}) for log buckets (max_relative_positions, or "
                "max_position_embeddings when it is -1); raise it or lower position_buckets"
            )

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict, dict]:
        """A transformers `deberta-v2` config.json (`DisentangledForX.from_pretrained(deberta_v2_folder)`) is read as
        what it is, before `from_pretrained` would warn that its model type is not ours."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        reject_deberta_v1(config_dict)  # before from_pretrained's model-type warning, too
        return _read_deberta_v2(config_dict), kwargs

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Also reads a transformers `deberta-v2` config dict, where an absent field has DebertaV2's meaning."""
        reject_deberta_v1(config_dict)
        return super().from_dict(_read_deberta_v2(config_dict), **kwargs)

    # Derived values the modules read; one definition each.
    @property
    def head_size(self) -> int:
        return self.attention_head_size or self.hidden_size // self.num_attention_heads

    @property
    def relative_span(self) -> int:
        """Buckets per side of the relative-distance table: `rel_embeddings` has 2 * span rows."""
        if self.position_buckets > 0:
            return self.position_buckets
        return self.max_relative_positions if self.max_relative_positions > 0 else self.max_position_embeddings

    @property
    def max_relative_distance(self) -> int:
        """The distance log buckets reach (`max_position` of DeBERTa's `make_log_bucket_position`)."""
        return self.max_relative_positions if self.max_relative_positions > 0 else self.max_position_embeddings

    @property
    def word_embedding_size(self) -> int:
        return self.embedding_size or self.hidden_size


def _read_deberta_v2(config_dict: dict) -> dict:
    """Our fields from a transformers `deberta-v2` config dict: the same names, and DebertaV2's meaning for absent
    ones. Other dicts are returned as they are."""
    if config_dict.get("model_type") != "deberta-v2":
        return config_dict
    config_dict = {**DEBERTA_V2_ABSENT_DEFAULTS, **config_dict}
    config_dict.pop("model_type")
    return config_dict


MODEL_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)


def _require_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _require_positive_int(name: str, value) -> None:
    _require_int(name, value, minimum=1)


__all__ = ["DisentangledConfig"]


def reject_deberta_v1(config_dict: dict) -> None:
    """A v1 folder (`model_type: deberta`) stores fused `in_proj` weights and clips distances unlike v2's defaults:
    loading it as is would leave the attention randomly initialised, so say how to convert it instead."""
    if config_dict.get("model_type") == "deberta":
        raise ValueError(
            "this is a DeBERTa v1 checkpoint (model_type 'deberta', fused in_proj weights), which this architecture "
            "does not load directly: convert it first with `disentangled convert SOURCE OUTPUT` and load OUTPUT"
        )


def deberta_v1_fields(config: dict) -> dict:
    """A DeBERTa v1 config (`model_type: deberta`) as our config's fields: clipped distances, separate position
    projections, no norm (the weights: `conversion/deberta_v1.py`)."""
    converted = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")}
    converted.update(
        relative_attention=config.get("relative_attention", False),
        max_relative_positions=config.get("max_relative_positions", -1),
        position_buckets=-1,
        share_att_key=False,
        norm_rel_ebd="none",
        pos_att_type=config.get("pos_att_type") or [],
        position_biased_input=config.get("position_biased_input", True),
        type_vocab_size=config.get("type_vocab_size", 0),
        conv_kernel_size=0,
        legacy=config.get("legacy", True),
        talking_head=config.get("talking_head", False),
    )
    return converted
