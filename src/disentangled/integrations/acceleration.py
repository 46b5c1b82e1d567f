"""Our attention inside transformers' own DeBERTa models: `accelerate(model)` in place, `enable()` for every model built.

Libraries such as GLiNER, sentence-transformers and `transformers.pipeline` build transformers' `DebertaModel` /
`DebertaV2Model` themselves. `accelerate(model)` walks `model.modules()` once and gives each DeBERTa encoder and each
of its self-attention modules a subclass of its own class (`module.__class__ = ...`) whose `forward` runs ours:

    A_ij = (c2c + c2p + p2c) / sqrt(head_dim * number_of_terms)

computed by our backends (sdpa by default: on the CPU the blocked paths and compiled kernels, on CUDA the fastest
path there) from the relative rows the input reaches, with no [L, L] index, bias or mask. Modules change, parameters
do not: the same tensors under the same names, so `state_dict()` keys, `save_pretrained` output (still `deberta` /
`deberta-v2`, loadable by plain transformers) and the optimizer's parameter list are unchanged. transformers' layers,
feed-forward blocks, LayerNorms, embeddings and heads run as they are (gradient checkpointing included).

`enable()` makes every DeBERTa model transformers builds for the rest of the process accelerated (the Auto classes,
`from_pretrained`, `pipeline`, and so the libraries above); `disable()` undoes it for models built later.
`restore(model)` undoes `accelerate(model)` on a model in hand, accelerated either way: each swapped module gets its
transformers class back and the attributes our setup set or changed are put back as they were (the parameters were
never touched), so the model computes what transformers computes.

Padded query rows: transformers masks the pairs (i, j) where either token is padding, so a padded query attends
uniformly; our backends mask padded keys only. The outputs at real tokens are the same; those at padded positions
(which no real token reads, and every head ignores) are not.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.deberta import modeling_deberta as deberta_v1
from transformers.models.deberta_v2 import modeling_deberta_v2 as deberta_v2

from ..configuration import DisentangledConfig
from ..configuration.configuration_disentangled import deberta_v1_fields
from ..modeling.disentangled_attention import RelativePositions, head_scaling, warn_once
from ..modeling.modeling_disentangled import (
    DISENTANGLED_ATTENTION_FUNCTIONS,
    DisentangledEncoder,
    DisentangledModel,
    DisentangledSelfAttention,
)

IMPLEMENTATIONS = tuple(DISENTANGLED_ATTENTION_FUNCTIONS)  # eager, sdpa, flex_attention
DEFAULT_IMPLEMENTATION = "sdpa"  # the fastest path on every device (on CUDA it takes the fused kernel where it can run)


def disentangled_config(config) -> DisentangledConfig:
    """Our config for a transformers `DebertaConfig` / `DebertaV2Config`, fields with transformers' meaning.

    Raises ValueError for what our attention does not compute as transformers does."""
    fields = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "auto_map", "torch_dtype", "dtype"):
        fields.pop(key, None)
    terms = fields.get("pos_att_type") or []
    terms = [t.strip() for t in terms.lower().split("|")] if isinstance(terms, str) else list(terms)
    if "p2p" in terms:
        raise ValueError(
            "pos_att_type lists p2p, which transformers' DeBERTa does not compute (it only counts it in the scaling): "
            "accelerating it would change the outputs; remove p2p from config.pos_att_type, or convert the checkpoint "
            "with `disentangled convert` and use our p2p"
        )
    if getattr(config, "talking_head", False):
        raise ValueError("talking_head=True (DeBERTa v1) is not supported by our attention; set talking_head=False")
    if config.model_type == "deberta":
        ours = DisentangledConfig(**deberta_v1_fields(fields))
    else:
        ours = DisentangledConfig.from_dict({**fields, "model_type": "deberta-v2"})
    ours.validate_for_model()
    return ours


# ---------------------------------------------------------------------------------------------------------------
# The subclasses a module is given. Each keeps transformers' class as a base (isinstance, _init_weights and saving
# see no difference) and puts ours first, so that our forward runs.


class AcceleratedSelfAttention(DisentangledSelfAttention):
    """transformers' self-attention (v2 layout: query_proj, key_proj, value_proj, pos_key_proj, pos_query_proj),
    computed by our `DisentangledSelfAttention.forward` with its own parameters."""

    transformers_class: type[nn.Module]

    def setup(self, config: DisentangledConfig, implementation: str, layer_idx: int) -> None:
        """The settings our forward reads; no parameter is made or replaced."""
        terms = config.pos_att_type
        self.disentangled_config = config
        self.implementation = implementation
        self.layer_idx = layer_idx
        self.is_causal = False
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_size
        self.use_c2p = config.relative_attention and "c2p" in terms
        self.use_p2c = config.relative_attention and "p2c" in terms
        self.use_p2p = False  # refused in `disentangled_config`
        self.share_att_key = config.share_att_key
        self.scaling = head_scaling(self.head_dim, 1 + len(terms))  # transformers counts every listed term
        self.dropout_p = config.attention_probs_dropout_prob
        self._position_cache = None
        if not hasattr(self, "pos_dropout"):  # transformers makes it only with relative attention
            self.pos_dropout = nn.Dropout(config.hidden_dropout_prob)

    def attn_implementation(self) -> str:
        return self.implementation

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None,
        output_attentions: bool = False,
        query_states: Tensor | None = None,
        relative_pos: RelativePositions | Tensor | None = None,
        rel_embeddings: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """transformers' signature. Called by our encoder, `relative_pos` is the forward's `RelativePositions` and
        `attention_mask` our boolean key mask (or None); called with transformers' own [L, L] index and mask (code of
        transformers' that we do not replace), it runs transformers' forward."""
        if isinstance(relative_pos, Tensor) or (attention_mask is not None and attention_mask.dtype != torch.bool):
            return self.transformers_class.forward(
                self, hidden_states, attention_mask, output_attentions, query_states, relative_pos, rel_embeddings
            )
        return DisentangledSelfAttention.forward(
            self, hidden_states, rel_embeddings, attention_mask, relative_pos, output_attentions, None, query_states
        )


class AcceleratedDebertaV2SelfAttention(AcceleratedSelfAttention, deberta_v2.DisentangledSelfAttention):
    transformers_class = deberta_v2.DisentangledSelfAttention


class AcceleratedDebertaSelfAttention(AcceleratedSelfAttention, deberta_v1.DisentangledSelfAttention):
    """DeBERTa v1's layout: `in_proj` fuses q, k, v head by head (no bias; `q_bias`, `v_bias` apart), `pos_proj`
    (no bias) and `pos_q_proj` project the relative embeddings."""

    transformers_class = deberta_v1.DisentangledSelfAttention

    def project(self, hidden_states: Tensor, query_states: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        heads, dim = self.num_heads, self.head_dim
        per_head = self.in_proj.weight.view(heads, 3, dim, -1)  # rows of head h: its query, key, value
        if query_states is None:
            qkv = self.in_proj(hidden_states).unflatten(-1, (heads, 3, dim)).transpose(1, 2)  # [B, H, L, 3, D]
            query, key, value = qkv.unbind(-2)
        else:
            query = (query_states @ per_head[:, 0].flatten(0, 1).T).unflatten(-1, (heads, dim)).transpose(1, 2)
            key = (hidden_states @ per_head[:, 1].flatten(0, 1).T).unflatten(-1, (heads, dim)).transpose(1, 2)
            value = (hidden_states @ per_head[:, 2].flatten(0, 1).T).unflatten(-1, (heads, dim)).transpose(1, 2)
        query = query + self.q_bias.view(heads, 1, dim)
        value = value + self.v_bias.view(heads, 1, dim)
        return query, key, value

    def relative_projections(self) -> tuple[nn.Module | None, nn.Module | None]:
        return getattr(self, "pos_proj", None), getattr(self, "pos_q_proj", None)


class AcceleratedEncoder(DisentangledEncoder):
    """transformers' encoder: the relative rows the input reaches and each distance's column made once per forward
    (`RelativePositions`, no [L, L] index), the relative embeddings normalised at those rows only, a [B, 1, 1, L]
    key mask, then transformers' own layers, whose self-attention is ours."""

    transformers_class: type[nn.Module]

    def setup(self, config: DisentangledConfig) -> None:
        self.disentangled_config = config
        self.span = config.relative_span
        self._rel_cache = None

    def position_config(self) -> DisentangledConfig:
        return self.disentangled_config

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor,
        output_hidden_states: bool = True,
        output_attentions: bool = False,
        query_states: Tensor | None = None,
        relative_pos: Tensor | None = None,
        return_dict: bool = True,
    ) -> BaseModelOutput | tuple:
        """transformers' signature; a separate query stream or a given [L, L] index runs transformers' forward."""
        if query_states is not None or relative_pos is not None:
            return self.transformers_class.forward(
                self, hidden_states, attention_mask, output_hidden_states, output_attentions, query_states,
                relative_pos, return_dict,
            )  # fmt: skip
        conv_mask = attention_mask if attention_mask.dim() <= 2 else attention_mask.sum(-2) > 0  # as transformers
        _, key_mask = DisentangledModel._masks(attention_mask, hidden_states.shape[:2])  # [B, 1, 1 | L, L] or None
        rel_index = self.get_rel_index(hidden_states.shape[1], hidden_states.device)
        rel_embeddings = self.get_rel_embedding(rel_index.rows) if rel_index is not None else None
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        output_states = hidden_states
        conv = getattr(self, "conv", None)
        for i, layer in enumerate(self.layer):
            # positionally: reentrant checkpointing hands back the gradients of positional tensors only
            output_states, probs = layer(output_states, key_mask, None, rel_index, rel_embeddings, output_attentions)
            if i == 0 and conv is not None:
                output_states = conv(hidden_states, output_states, conv_mask)
            if output_hidden_states:
                all_hidden_states += (output_states,)
            if output_attentions:
                all_attentions += (probs,)
        if not return_dict:
            return tuple(v for v in (output_states, all_hidden_states, all_attentions) if v is not None)
        return BaseModelOutput(
            last_hidden_state=output_states, hidden_states=all_hidden_states, attentions=all_attentions
        )


class AcceleratedDebertaV2Encoder(AcceleratedEncoder, deberta_v2.DebertaV2Encoder):
    transformers_class = deberta_v2.DebertaV2Encoder


class AcceleratedDebertaEncoder(AcceleratedEncoder, deberta_v1.DebertaEncoder):
    transformers_class = deberta_v1.DebertaEncoder


ENCODERS = {
    deberta_v2.DebertaV2Encoder: AcceleratedDebertaV2Encoder,
    deberta_v1.DebertaEncoder: AcceleratedDebertaEncoder,
}
ATTENTIONS = {
    deberta_v2.DisentangledSelfAttention: AcceleratedDebertaV2SelfAttention,
    deberta_v1.DisentangledSelfAttention: AcceleratedDebertaSelfAttention,
}
BASE_MODELS = (deberta_v2.DebertaV2Model, deberta_v1.DebertaModel)


def is_accelerated(model: nn.Module) -> bool:
    """Whether any DeBERTa encoder in `model` runs our attention."""
    return any(isinstance(module, AcceleratedEncoder) for module in model.modules())


def _check_implementation(attn_implementation: str | None) -> str:
    implementation = attn_implementation or DEFAULT_IMPLEMENTATION
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} is not one of ours: choose one of {list(IMPLEMENTATIONS)} "
            "(or None for the default, sdpa)"
        )
    return implementation


def _accelerate(model: nn.Module, implementation: str, already: str, unsupported: str = "raise") -> int:
    """Swap every DeBERTa base model's encoder and self-attention classes; `already`: "raise" or "skip" a model
    accelerated before; `unsupported`: "raise" for a config our attention does not compute as transformers does, or
    "warn" (once) and leave that model to transformers' attention. Returns how many base models were accelerated now.
    Every check runs before any swap."""
    bases = [(name, module) for name, module in model.named_modules() if isinstance(module, BASE_MODELS)]
    todo = []
    for name, base in bases:
        where = name or type(model).__name__
        if type(base.encoder) not in ENCODERS:
            if isinstance(base.encoder, AcceleratedEncoder):
                if already == "raise":
                    raise ValueError(
                        f"{where} ({type(base).__name__}) is accelerated already: call disentangled.accelerate "
                        "once per model (models built after disentangled.enable() are accelerated as they are built; "
                        "disentangled.restore(model) undoes it)"
                    )
                continue
            raise ValueError(
                f"{where}.encoder is a {type(base.encoder).__name__}, not transformers' DeBERTa encoder: "
                "it cannot be accelerated in place"
            )
        try:
            config = disentangled_config(base.config)
        except ValueError as error:
            message = f"{where} ({type(base).__name__}) cannot be accelerated: {error}"
            if unsupported == "raise":
                raise ValueError(message) from None
            warn_once(message + "; it runs transformers' own attention")
            continue
        todo.append((base, config))
    for base, config in todo:
        encoder = base.encoder
        _swap(encoder, ENCODERS[type(encoder)], config)
        for index, layer in enumerate(encoder.layer):
            attention = layer.attention.self
            _swap(attention, ATTENTIONS[type(attention)], config, implementation, index)
    return len(todo)


BEFORE = "_before_acceleration"  # the attribute where a swapped module keeps what `restore` puts back
_MISSING = object()  # no value: an attribute a module lacked before its setup; a class without its own post_init


def _swap(module: nn.Module, accelerated: type[nn.Module], *settings) -> None:
    """Give `module` its accelerated class and run its `setup(*settings)`, remembering which instance attributes the
    setup added or replaced (with their values before) and which submodules it added: exactly what `restore` undoes."""
    before, submodules = dict(vars(module)), set(module._modules)
    module.__class__ = accelerated
    module.setup(*settings)
    changed = {
        name: before.get(name, _MISSING)
        for name, value in vars(module).items()
        if name not in before or value is not before[name]
    }
    setattr(module, BEFORE, (changed, set(module._modules) - submodules))


def _unswap(module: nn.Module) -> None:
    """Undo `_swap`: transformers' class, the attributes as they were, the added submodules removed."""
    changed, added = getattr(module, BEFORE)
    delattr(module, BEFORE)
    for name, value in changed.items():
        if value is _MISSING:
            del module.__dict__[name]
        else:
            module.__dict__[name] = value
    for name in added:
        del module._modules[name]
    module.__class__ = module.transformers_class


def accelerate(model: nn.Module, attn_implementation: str | None = None) -> nn.Module:
    """Run our attention inside every transformers `DebertaModel` / `DebertaV2Model` in `model`, in place.

    `model` is any module holding one: a backbone, a head model, a GLiNER model, a CrossEncoder's `model`, a pipeline's
    `model`. Each DeBERTa encoder and self-attention module gets a subclass of its class whose forward is ours; the
    parameters, `state_dict()` keys and saved files are unchanged. `attn_implementation`: one of our backends, "eager",
    "sdpa" (the default: the fastest on each device) or "flex_attention". Returns `model`.

    Raises ValueError where there is no DeBERTa inside, where a model is accelerated already, or for a config our
    attention does not compute as transformers does (v1's `talking_head`, a `p2p` term).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"accelerate takes a torch.nn.Module, got {type(model).__name__}")
    implementation = _check_implementation(attn_implementation)
    if not any(isinstance(module, BASE_MODELS) for module in model.modules()):
        raise ValueError(
            f"{type(model).__name__} contains no transformers DebertaModel or DebertaV2Model: nothing to accelerate "
            "(our own Disentangled* models run our attention already)"
        )
    _accelerate(model, implementation, already="raise")
    return model


def restore(model: nn.Module) -> nn.Module:
    """Undo `accelerate(model)` (or `enable()`'s acceleration of a model built under it), in place: every DeBERTa
    encoder and self-attention module of `model` gets transformers' class back, with its attributes as they were before
    it was accelerated; the parameters are the same tensors throughout. The model then computes what transformers'
    DeBERTa computes, padded positions included. Returns `model`.

    Raises ValueError where nothing in `model` is accelerated."""
    encoders = [module for module in model.modules() if isinstance(module, AcceleratedEncoder)]
    if not encoders:
        raise ValueError(f"{type(model).__name__} has no accelerated DeBERTa inside: nothing to restore")
    for encoder in encoders:
        for layer in encoder.layer:
            _unswap(layer.attention.self)
        _unswap(encoder)
    return model


# ---------------------------------------------------------------------------------------------------------------
# enable() / disable(): every DeBERTa model transformers builds. transformers' models end their __init__ with
# `self.post_init()`; our hook on the two DeBERTa base classes accelerates the model after it. A head model's
# backbone is accelerated by the backbone's own post_init, before the head's: "skip" there.

PATCHED = (deberta_v2.DebertaV2PreTrainedModel, deberta_v1.DebertaPreTrainedModel)
_saved: dict[type, object] = {}  # class -> its own post_init before enable() (_MISSING: inherited)
_enabled: dict[str, str] = {}


def _post_init_hook(cls: type):
    def post_init(self) -> None:
        original = _saved.get(cls, _MISSING)
        original(self) if original is not _MISSING else super(cls, self).post_init()
        if "implementation" in _enabled:
            _accelerate(self, _enabled["implementation"], already="skip", unsupported="warn")

    post_init.__doc__ = "transformers' post_init, then `disentangled.accelerate` (installed by disentangled.enable())"
    return post_init


def enable(attn_implementation: str | None = None) -> None:
    """Accelerate every transformers DeBERTa model (v1, v2/v3) built from now on in this process: the Auto classes,
    `DebertaV2ForX.from_pretrained`, `pipeline(...)`, and libraries that build them (GLiNER, sentence-transformers).
    Calling it again changes the backend; `disable()` stops it (models built meanwhile stay accelerated). A model whose
    config our attention does not compute as transformers does (v1's `talking_head`, a `p2p` term) is built as it
    would be without `enable()`, with a warning, rather than refused."""
    implementation = _check_implementation(attn_implementation)
    if not _enabled:
        for cls in PATCHED:
            _saved[cls] = vars(cls).get("post_init", _MISSING)
            cls.post_init = _post_init_hook(cls)
    _enabled["implementation"] = implementation


def disable() -> None:
    """Undo `enable()`: the DeBERTa classes are as they were (models built meanwhile stay accelerated)."""
    if _enabled:
        for cls in PATCHED:
            original = _saved.pop(cls)
            if original is _MISSING:
                del cls.post_init
            else:
                cls.post_init = original
        _enabled.clear()


def enabled() -> bool:
    return bool(_enabled)
