"""DeBERTa's disentangled attention as a transformers architecture: the model and its heads.

Content H and relative-position embeddings P are kept in separate streams; each attention layer scores

    A_ij = (c2c + c2p + p2c [+ p2p]) / sqrt(head_dim * number_of_terms)

with c2c = H_i Wq_c . H_j Wk_c, c2p = H_i Wq_c . P_δ(i,j) Wk_p, p2c = H_j Wk_c . P_δ(i,j) Wq_p and the optional
p2p = P_δ(i,j) Wq_p . P_δ(j,i) Wk_p (see `disentangled_attention.py` for the index convention). Relative
distances are clipped (v1) or log-bucketed (v2/v3 `position_buckets`).

The encoder builds the bucket index and the normalised relative embeddings once per forward; each layer
projects the 2S relative embeddings (never once per batch element) and hands its attention backend the
[B, H, L, 2S] position tables. Parameter names are those of transformers' DeBERTa-v2, so its checkpoints
load as they are.

In `modeling/`'s layering (`__init__.py`): the model above the attention layers, the dispatch to them here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import transformers
from torch import Tensor, nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput, logging

from ..configuration.configuration_disentangled import DisentangledConfig

# transformers 4.57 copies a local folder's remote code by the model file's own relative imports (not by theirs in
# turn), so this file imports every bundled sibling, cpu_inference.py (which only sdpa uses) included.
from .blocks import SDPA_BLOCK_ELEMENTS as _BLOCKS  # noqa: F401  (what the blocked paths share)
from .cpu_inference import CPU_FLASH_WITH_LSE  # noqa: F401
from .cpu_training import dropout_keep_mask
from .disentangled_attention import (
    PositionScores,
    RelativePositions,
    dense_position_bias,
    eager_disentangled,
    head_scaling,
    warn_once,
)
from .dispatch import Decision, call_facts, decide, native, switch_value, without_the_package
from .flex_attention import flex_disentangled
from .onnx_fused import fused_attention  # noqa: F401  (an ONNX export's fused graph; see cpu_inference above)
from .sdpa_attention import sdpa_disentangled
from .triton_attention import TRITON_AVAILABLE  # noqa: F401  (sdpa's CUDA kernel; see cpu_inference above)
from .triton_tiles import TILES as _TILES  # noqa: F401  (the Triton kernel's tiles per GPU; see cpu_inference above)
from .validation import (
    IGNORE_INDEX,
    input_shape,
    is_tracing,
    validate_classification_labels,
    validate_inputs,
    validate_labels,
    validate_span_positions,
)
from .workspace import _scratch, kept_workspace, release_workspace

try:  # transformers 5: initialisers that leave weights loaded from a checkpoint alone
    from transformers import initialization as init
except ImportError:  # transformers 4.57
    from torch.nn import init

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
# A fixed name, as dispatch's: the same in the package and in each folder's copy of the bundle, so that a line logged
# once (`warning_once`) is said once per process, however many models are loaded
logger = logging.get_logger("disentangled")

DISENTANGLED_ATTENTION_FUNCTIONS = {  # our backends; any other implementation gets one dense bias (`attend`)
    "eager": eager_disentangled,
    "sdpa": sdpa_disentangled,
    "flex_attention": flex_disentangled,
}


class Dropout(nn.Dropout):
    """`nn.Dropout`, with the mask drawn by `dropout_keep_mask` when training on the CPU (four decisions per
    random draw instead of one: PyTorch's CPU generator costs the same per element whatever its width).
    Elsewhere, while a graph is traced and for p = 1, `nn.Dropout` itself."""

    def forward(self, hidden: Tensor) -> Tensor:
        if not self.training or self.inplace or not 0 < self.p < 1 or hidden.device.type != "cpu" or is_tracing():
            return super().forward(hidden)
        keep = dropout_keep_mask(hidden.shape, self.p, hidden.device)
        # a 0 / 1 uint8 factor: cheaper than a `where`, and than a bool (first copied into a float tensor)
        return (hidden * keep.view(torch.uint8)).mul_(1 / (1 - self.p))


def weights_key(*tensors: Tensor | None) -> tuple | None:
    """What identifies the current values of some weights: storage and in-place version of each.

    Every in-place update through autograd's view of a parameter (optimizer steps, `load_state_dict`,
    `param.copy_` under no_grad) bumps `_version`; replacing a parameter or moving it changes the storage.
    None when a version is unreadable (tensors created under inference_mode) or a weight is not a tensor (a
    dynamically quantized linear's `weight` is a method): then nothing is cached.
    """
    if not all(isinstance(t, Tensor) for t in tensors if t is not None):
        return None
    try:
        return tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors if t is not None)
    except RuntimeError:
        return None


# The modules whose output `modules_key` reads from their weights alone
_PLAIN_MODULES = (nn.Linear, nn.Embedding, nn.LayerNorm)


def hooked(*modules: nn.Module) -> bool:
    """Whether a forward hook or pre-hook is on one of `modules`, or a global one is: something that may see (and
    keep, or change) what they take and return."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return True
    return any(module._forward_hooks or module._forward_pre_hooks for module in modules)


def modules_key(*modules: nn.Module | None) -> tuple | None:
    """`weights_key` of the modules' parameters, where each module's output depends on them alone: a plain
    `nn.Linear`, `nn.Embedding` or `nn.LayerNorm` (not a subclass) and no hook (`hooked`). None otherwise, and then
    nothing is cached: peft's LoRA layers add adapters that they switch on and off by attribute (`disable_adapter`,
    `set_adapter`), parametrizations and quantized layers compute their weight, and a hook may change the output."""
    present = [module for module in modules if module is not None]
    if hooked(*present) or any(type(module) not in _PLAIN_MODULES for module in present):
        return None
    return weights_key(*(tensor for module in present for tensor in module.parameters()))


def inference_cache_allowed(module: nn.Module) -> bool:
    """Position tables depend on weights only; cache them when no graph and no dropout can depend on them, and
    not while a compiler or exporter traces (module state written in a graph would guard and recompile)."""
    return not module.training and not torch.is_grad_enabled() and not is_tracing()


class DisentangledEmbeddings(nn.Module):
    """Word (+ absolute position) (+ token type) embeddings, projected to hidden_size, normalised, masked.

    The absolute table `position_embeddings` is added to the input with `position_biased_input`. Without it, the
    masked-LM head with the Enhanced Mask Decoder adds the table here for the decoder alone (Z in its queries Z + H);
    the other heads have no use for it and do not build it (an unused parameter would stall DDP).
    """

    def __init__(self, config: DisentangledConfig):
        super().__init__()
        size = config.word_embedding_size
        self.word_embeddings = nn.Embedding(config.vocab_size, size, padding_idx=config.pad_token_id)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, size) if config.position_biased_input else None
        )
        self.position_biased_input = config.position_biased_input
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size) if config.type_vocab_size > 0 else None
        self.embed_proj = nn.Linear(size, config.hidden_size, bias=False) if size != config.hidden_size else None
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        input_ids: Tensor | None,
        token_type_ids: Tensor | None,
        position_ids: Tensor | None,
        input_mask: Tensor,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        embeddings = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if self.position_biased_input:
            if position_ids is None:
                position_ids = torch.arange(embeddings.shape[1], device=embeddings.device).unsqueeze(0)
            embeddings = embeddings + self.position_embeddings(position_ids)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(input_mask.shape, dtype=torch.long, device=input_mask.device)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.embed_proj is not None:
            embeddings = self.embed_proj(embeddings)
        embeddings = self.LayerNorm(embeddings) * input_mask.unsqueeze(-1).to(embeddings.dtype)
        return self.dropout(embeddings)


class DisentangledSelfAttention(nn.Module):
    """Multi-head disentangled self-attention: the c2c, c2p, p2c (and p2p) terms, each named, then one backend."""

    def __init__(self, config: DisentangledConfig, layer_idx: int = 0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = False
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_size
        inner = self.num_heads * self.head_dim
        self.query_proj = nn.Linear(config.hidden_size, inner)
        self.key_proj = nn.Linear(config.hidden_size, inner)
        self.value_proj = nn.Linear(config.hidden_size, inner)

        terms = config.pos_att_type
        self.use_c2p = config.relative_attention and "c2p" in terms
        self.use_p2c = config.relative_attention and "p2c" in terms
        self.use_p2p = config.relative_attention and "p2p" in terms
        self.share_att_key = config.share_att_key
        if not self.share_att_key:  # v1/v2 checkpoints: separate projections of the relative embeddings
            if self.use_c2p or self.use_p2p:
                self.pos_key_proj = nn.Linear(config.hidden_size, inner)
            if self.use_p2c or self.use_p2p:
                self.pos_query_proj = nn.Linear(config.hidden_size, inner)
        self.pos_dropout = Dropout(config.hidden_dropout_prob)
        # Checkpoints count every listed term in the scaling, also with relative_attention off.
        self.scaling = head_scaling(self.head_dim, 1 + len(terms))
        self.dropout_p = config.attention_probs_dropout_prob
        self._position_cache: tuple | None = None  # inference only: (weights key, rel_embeddings, pos_key, pos_query)

    def heads(self, x: Tensor) -> Tensor:
        """[..., L, H * D] -> [..., H, L, D]."""
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-3, -2)

    def project(self, hidden_states: Tensor, query_states: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """The content streams q, k, v: [B, H, L, D] each; queries from `query_states` where given."""
        queries_from = hidden_states if query_states is None else query_states
        return (
            self.heads(self.query_proj(queries_from)),
            self.heads(self.key_proj(hidden_states)),
            self.heads(self.value_proj(hidden_states)),
        )

    def relative_projections(self) -> tuple[nn.Module | None, nn.Module | None]:
        """The projections of the relative embeddings: key side (Kr, for c2p), query side (Qr, for p2c)."""
        if self.share_att_key:
            return self.key_proj, self.query_proj
        return getattr(self, "pos_key_proj", None), getattr(self, "pos_query_proj", None)

    def position_projections(self, rel_embeddings: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The relative rows projected by the key and query projections, scaled: [H, W, D] each.

        In inference (eval mode, no grad), where the projections are plain layers (`modules_key`), they depend on
        the weights only and are kept until a weight changes (see `weights_key`); the encoder hands the same
        `rel_embeddings` tensor while its own weights are unchanged, so that tensor's identity stands for them.
        """
        key_proj, query_proj = self.relative_projections()
        cache_key = None
        if inference_cache_allowed(self):
            cache_key = modules_key(key_proj, query_proj)
            cached = self._position_cache
            if cache_key is not None and cached is not None and cached[0] == cache_key and cached[1] is rel_embeddings:
                return cached[2], cached[3]
        rel_embeddings_in = rel_embeddings
        rel_embeddings = self.pos_dropout(rel_embeddings)  # [W, hidden]
        # The scaling goes into the small [H, W, D] tables, never into [L, L] tensors.
        pos_key = self.heads(key_proj(rel_embeddings)) * self.scaling if self.use_c2p or self.use_p2p else None
        pos_query = self.heads(query_proj(rel_embeddings)) * self.scaling if self.use_p2c or self.use_p2p else None
        self._position_cache = (cache_key, rel_embeddings_in, pos_key, pos_query) if cache_key is not None else None
        return pos_key, pos_query

    def position_scores(
        self, query: Tensor, key: Tensor, rel_embeddings: Tensor, positions: RelativePositions
    ) -> PositionScores | None:
        """c2p, p2c and p2p scores against each reachable relative row, scaled (see `PositionScores`)."""
        if not (self.use_c2p or self.use_p2c or self.use_p2p):
            return None
        pos_key, pos_query = self.position_projections(rel_embeddings)  # [H, W, D]
        p2p = None
        if self.use_p2p:  # [H, 2L - 1] by distance d: Qr[δ(d)] . Kr[δ(-d)], both tables scaled, so once unscaled
            column = positions.column  # [2L - 1]; reversed, it is the column of -d
            p2p = (pos_query[:, column] * pos_key[:, column.flip(0)]).sum(-1) / self.scaling
        return PositionScores(  # c2p: q_i . Kr[δ(i,j)], p2c: k_j . Qr[δ(i,j)], built by the backend
            query=query,
            key=key,
            pos_key=pos_key if self.use_c2p else None,
            pos_query=pos_query if self.use_p2c else None,
            p2p=p2p,
            positions=positions,
        )

    def attn_implementation(self) -> str:
        """The implementation asked for: the model's (`config._attn_implementation`)."""
        return self.config._attn_implementation or "eager"

    def decide(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        position_scores: PositionScores | None,
        output_attentions: bool = False,
    ) -> Decision:
        """The path that serves this attention call (`dispatch.decide`, asked once per call): the configured
        implementation, or sdpa or eager where it cannot serve (warned once)."""
        dropout = self.dropout_p if self.training else 0.0
        implementation = self.attn_implementation()
        call = call_facts(
            query, key, value, attention_mask, position_scores, dropout, implementation, output_attentions
        )
        decision = decide(call)
        if decision.implementation != implementation:
            warn_once(decision.skipped[0][1])
        return decision

    def attend(
        self,
        decision: Decision,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        position_scores: PositionScores | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Run the implementation `decision` names, handing it the decision: [B, L, H, D] context, probabilities."""
        implementation = decision.implementation
        if implementation == "flex_attention":
            attend = functools.partial(flex_disentangled, compiled=decision.path == "flex")
        elif implementation in DISENTANGLED_ATTENTION_FUNCTIONS:
            attend = DISENTANGLED_ATTENTION_FUNCTIONS[implementation]
        else:  # an implementation registered with transformers: position terms and mask as one dense bias
            registered = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_disentangled)

            def attend(module, query, key, value, attention_mask, scaling, dropout, position_scores, **kwargs):
                bias = dense_position_bias(position_scores, attention_mask, query.dtype)
                return registered(module, query, key, value, bias, scaling=scaling, dropout=dropout)

        dropout = self.dropout_p if self.training else 0.0
        return attend(
            self,
            query,
            key,
            value,
            attention_mask,
            scaling=self.scaling,
            dropout=dropout,
            position_scores=position_scores,
            decision=decision,
        )

    def forward(
        self,
        hidden_states: Tensor,
        rel_embeddings: Tensor | None,
        attention_mask: Tensor | None,
        rel_index: RelativePositions | None,
        output_attentions: bool = False,
        cu_seqlens: tuple[int, ...] | None = None,
        query_states: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """`rel_index` is the forward's `RelativePositions`; `cu_seqlens` the bounds of packed sequences, where
        `hidden_states` is [1, total tokens, hidden] and each sequence attends only to itself. `query_states`
        (same shape as `hidden_states`) is a separate query stream, the Enhanced Mask Decoder's: queries (and so
        c2p) come from it, keys, values (and so p2c) from `hidden_states`. Each attention call is decided once
        (`decide`) and run by the implementation its decision names (`attend`)."""
        query, key, value = self.project(hidden_states, query_states)  # [B, H, L, D]
        position_scores = (
            self.position_scores(query, key, rel_embeddings, rel_index) if rel_embeddings is not None else None
        )
        if cu_seqlens is None:
            decision = self.decide(query, key, value, attention_mask, position_scores, output_attentions)
            context, probs = self.attend(decision, query, key, value, attention_mask, position_scores)
            return context.flatten(-2), probs  # [B, L, H * D]
        contexts = []
        for first, last in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # one sequence at a time: no padding, no cross terms
            tokens = slice(first, last)
            query_part, key_part, value_part = query[:, :, tokens], key[:, :, tokens], value[:, :, tokens]
            scores = position_scores.cut(first, last) if position_scores is not None else None
            decision = self.decide(query_part, key_part, value_part, None, scores, output_attentions)
            context, _ = self.attend(decision, query_part, key_part, value_part, None, scores)
            contexts.append(context)
        return torch.cat(contexts, dim=1).flatten(-2), None  # [1, T, H * D]


class DisentangledSelfOutput(nn.Module):
    def __init__(self, config: DisentangledConfig):
        super().__init__()
        self.dense = nn.Linear(config.num_attention_heads * config.head_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + residual)


class DisentangledAttention(nn.Module):
    def __init__(self, config: DisentangledConfig, layer_idx: int = 0):
        super().__init__()
        self.self = DisentangledSelfAttention(config, layer_idx)
        self.output = DisentangledSelfOutput(config)

    def forward(
        self,
        hidden_states: Tensor,
        rel_embeddings: Tensor | None,
        attention_mask: Tensor | None,
        rel_index: RelativePositions | None,
        output_attentions: bool = False,
        cu_seqlens: tuple[int, ...] | None = None,
        query_states: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """With a separate query stream, that stream is the residual (the decoder refines its queries)."""
        context, probs = self.self(
            hidden_states, rel_embeddings, attention_mask, rel_index, output_attentions, cu_seqlens, query_states
        )
        residual = hidden_states if query_states is None else query_states
        return self.output(context, residual), probs


class DisentangledIntermediate(nn.Module):
    def __init__(self, config: DisentangledConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = ACT2FN[config.hidden_act]
        self.exact_gelu = config.hidden_act == "gelu"

    def forward(self, hidden_states: Tensor, workspace: dict | None = None) -> Tensor:
        """`workspace`: the forward's buffers, which the product is written into where `DisentangledLayer` finds that
        nothing can hold it (`_product_into_workspace`)."""
        product = _product_into_workspace(self.dense, hidden_states, workspace) if workspace is not None else None
        hidden_states = self.dense(hidden_states) if product is None else product
        if self.exact_gelu and not hidden_states.requires_grad and self._nothing_sees_the_product():
            # the same GELU in place: the layer's largest activation is not allocated a second time (above 32 MiB,
            # 2,731 tokens of v3-base, glibc maps such a tensor afresh on every call and its pages fault in as it is
            # written)
            return torch.ops.aten.gelu_(hidden_states)
        return self.intermediate_act_fn(hidden_states)

    def _nothing_sees_the_product(self) -> bool:
        """No hook (the dense layer's own or a global one) may hold the product, and no graph is traced."""
        return not hooked(self.dense) and not is_tracing()


def _product_into_workspace(dense: nn.Module, hidden_states: Tensor, workspace: dict) -> Tensor | None:
    """`dense(hidden_states)` written into the buffer "intermediate" of the forward's workspace, which every layer
    and later call reuses: the feed-forward's [tokens, intermediate] product, a tensor that above 32 MiB (2,731
    tokens of v3-base in float32) glibc maps afresh on every allocation, its pages faulting in as the product
    writes them. In CPU inference through a plain `nn.Linear` without autocast, while nothing traces; None (the
    caller's own product) elsewhere. The caller has made sure that no hook can hold the
    product or what is made in place from it, since the next layer overwrites it."""
    if (
        hidden_states.device.type != "cpu"
        or type(dense) is not nn.Linear
        or torch.is_grad_enabled()
        or torch.is_autocast_enabled("cpu")
        or hidden_states.dtype != dense.weight.dtype
        or is_tracing()
    ):
        return None
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    product = _scratch(workspace, "intermediate", (flat.shape[0], dense.out_features), flat)
    if dense.bias is None:
        torch.mm(flat, dense.weight.t(), out=product)
    else:
        torch.addmm(dense.bias, flat, dense.weight.t(), out=product)
    return product.view(*hidden_states.shape[:-1], dense.out_features)


class DisentangledOutput(nn.Module):
    def __init__(self, config: DisentangledConfig):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + residual)


class DisentangledLayer(GradientCheckpointingLayer):
    """Attention, then feed-forward. The relative embeddings come in positionally, so that reentrant
    checkpointing hands their gradient back instead of backpropagating twice through the shared LayerNorm."""

    def __init__(self, config: DisentangledConfig, layer_idx: int = 0):
        super().__init__()
        self.attention = DisentangledAttention(config, layer_idx)
        self.intermediate = DisentangledIntermediate(config)
        self.output = DisentangledOutput(config)

    def forward(
        self,
        hidden_states: Tensor,
        rel_embeddings: Tensor | None,
        attention_mask: Tensor | None,
        rel_index: RelativePositions | None,
        output_attentions: bool = False,
        cu_seqlens: tuple[int, ...] | None = None,
        query_states: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """`query_states`: a separate query stream (the Enhanced Mask Decoder's); pass it positionally too."""
        attention_output, probs = self.attention(
            hidden_states, rel_embeddings, attention_mask, rel_index, output_attentions, cu_seqlens, query_states
        )
        # the intermediate product into the workspace only without gradients, and where no hook in the feed-forward
        # can keep it
        into_workspace = rel_index is not None and not torch.is_grad_enabled()
        into_workspace = into_workspace and not hooked(*self.intermediate.modules(), *self.output.modules())
        intermediate = self.intermediate(attention_output, rel_index.workspace if into_workspace else None)
        return self.output(intermediate, attention_output), probs


class ConvLayer(nn.Module):
    """deberta-v2-xlarge's convolution over the embeddings, added to the first layer's output."""

    def __init__(self, config: DisentangledConfig):
        super().__init__()
        kernel = config.conv_kernel_size
        self.conv = nn.Conv1d(
            config.hidden_size, config.hidden_size, kernel, padding=(kernel - 1) // 2, groups=config.conv_groups
        )
        self.conv_act = ACT2FN[config.conv_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, embeddings: Tensor, layer_output: Tensor, input_mask: Tensor) -> Tensor:
        mask = input_mask.unsqueeze(-1).to(layer_output.dtype)  # [B, L, 1]
        out = self.conv(embeddings.transpose(1, 2)).transpose(1, 2) * mask
        out = self.conv_act(self.dropout(out))
        return self.LayerNorm(layer_output + out) * mask


class DisentangledEncoder(nn.Module):
    def __init__(self, config: DisentangledConfig):
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList([DisentangledLayer(config, i) for i in range(config.num_hidden_layers)])
        self.relative_attention = config.relative_attention
        self.span = config.relative_span
        if self.relative_attention:
            self.rel_embeddings = nn.Embedding(2 * self.span, config.hidden_size)
        if self.relative_attention and "layer_norm" in config.norm_rel_ebd.split("|"):  # it normalises P only
            self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.conv = ConvLayer(config) if config.conv_kernel_size > 0 else None
        self.gradient_checkpointing = False
        self._rel_cache: tuple | None = None  # inference only: (weights key, normalised rows)

    def get_rel_embedding(self, rows: slice = slice(None)) -> Tensor | None:
        """The relative embeddings P (the rows `rows` of 2S), normalised once per forward for all layers.

        LayerNorm works row by row, so normalising only the reachable rows gives the same rows. In inference
        the result is kept while the weights are unchanged, and handed out as the same tensor, which lets the
        layers keep their projections of it too.
        """
        if not self.relative_attention:
            return None
        norm = getattr(self, "LayerNorm", None)
        cache_key = None
        if inference_cache_allowed(self):
            cache_key = modules_key(self.rel_embeddings, norm)
            cache_key = (rows.start, rows.stop, cache_key) if cache_key is not None else None
            if cache_key is not None and self._rel_cache is not None and self._rel_cache[0] == cache_key:
                return self._rel_cache[1]
        rel_embeddings = self.rel_embeddings.weight[rows]
        if norm is not None:
            rel_embeddings = norm(rel_embeddings)
        self._rel_cache = (cache_key, rel_embeddings) if cache_key is not None else None
        return rel_embeddings

    def position_config(self) -> DisentangledConfig:
        """The config whose bucket settings the relative positions follow."""
        return self.config

    def get_rel_index(self, length: int, device) -> RelativePositions | None:
        """Each distance's table column and the reachable relative rows, once per forward for all layers."""
        if not self.relative_attention:
            return None
        config = self.position_config()
        return RelativePositions.build(
            length,
            span=self.span,
            bucket_size=config.position_buckets,
            max_position=config.max_relative_distance,
            device=device,
            workspace=kept_workspace(self) if not is_tracing() and switch_value("KEEP_WORKSPACE") else None,
        )

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor,
        input_mask: Tensor,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        cu_seqlens: tuple[int, ...] | None = None,
    ) -> BaseModelOutput:
        """With `cu_seqlens`, `hidden_states` is [1, T, hidden]: packed sequences, bounds cu_seqlens[k:k + 2]."""
        if hidden_states.device.type == "cpu" and not is_tracing() and native is not None:  # once: bfloat16 emulated
            native.warn_if_bfloat16_is_emulated(hidden_states.dtype)
        if cu_seqlens is None:
            length = hidden_states.shape[1]
        else:
            length = max(last - first for first, last in zip(cu_seqlens[:-1], cu_seqlens[1:]))
        rel_index = self.get_rel_index(length, hidden_states.device)
        rel_embeddings = self.get_rel_embedding(rel_index.rows) if rel_index is not None else None
        embeddings = hidden_states
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for i, layer in enumerate(self.layer):
            hidden_states, probs = layer(
                hidden_states, rel_embeddings, attention_mask, rel_index, output_attentions, cu_seqlens
            )
            if i == 0 and self.conv is not None:
                hidden_states = self.conv(embeddings, hidden_states, input_mask)
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            if output_attentions:
                all_attentions += (probs,)
        return BaseModelOutput(
            last_hidden_state=hidden_states, hidden_states=all_hidden_states, attentions=all_attentions
        )


class DisentangledPreTrainedModel(PreTrainedModel):
    config_class = DisentangledConfig
    base_model_prefix = "deberta"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DisentangledEmbeddings", "DisentangledLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True  # a model-local score_mod reads the position tables (flex_attention.py)
    _supports_flash_attn = False  # flash kernels take no arbitrary additive bias, and the position terms are one
    _supports_attention_backend = True
    # The heads average their loss over the batch themselves and ignore `num_items_in_batch`; without this, Trainer
    # reads the `**kwargs` of `forward` as "normalises by num_items_in_batch" and scales the loss by the number of
    # processes (DDP) and not by the gradient-accumulation steps.
    accepts_loss_kwargs = False
    # transformers' DeBERTa checkpoints carry the absolute table and the RTD head also where a class reads neither,
    # and DeBERTa-v2 builds (and saves) the relative embeddings' encoder.LayerNorm also without relative attention,
    # where ours has none.
    _keys_to_ignore_on_load_unexpected = [r"position_embeddings", r"mask_predictions\.", r"encoder\.LayerNorm\."]

    def release_workspace(self) -> None:
        """Free the buffers that sdpa on the CPU keeps between calls on this thread (in inference U's bands and two
        block buffers, in training a block's c2p table and a group's p2c table, growing with the input; the next
        call allocates them again)."""
        release_workspace(self)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, (LegacyMLMPredictionHead, MLMPredictionHead)):
            init.zeros_(module.bias)


class DisentangledModel(DisentangledPreTrainedModel):
    def __init__(self, config: DisentangledConfig):
        config.validate_for_model()  # cross-field rules (heads divide hidden size, bucket reach) when a model is built
        super().__init__(config)
        if (missing := without_the_package()) is not None:  # the Hub bundle: what it lacks, once per process
            logger.warning_once(missing)
        self.embeddings = DisentangledEmbeddings(config)
        self.encoder = DisentangledEncoder(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.embeddings.word_embeddings = new_embeddings

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        cu_seqlens = packed_bounds(kwargs)
        tokens = input_ids if input_ids is not None else inputs_embeds
        if cu_seqlens is not None and tokens is not None:  # packed: [1, T], no padding, each sequence to itself
            if (
                tokens.shape[0] != 1
                or cu_seqlens[-1] != tokens.shape[1]
                or (attention_mask is not None and not attention_mask.all())
            ):
                raise ValueError("packed sequences are one row of tokens, [1, cu_seqlens[-1]], without padding")
            if self.config.conv_kernel_size > 0:
                raise ValueError("packed sequences do not support the convolution layer (conv_kernel_size > 0); pad")
            if position_ids is None and self.config.position_biased_input:  # positions restart with each sequence
                position_ids = packed_position_ids(cu_seqlens, tokens.device)
            attention_mask = None
        validate_inputs(self.config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        if attention_mask is None:
            input_mask, pair_mask = torch.ones(shape, dtype=torch.bool, device=device), None
        else:
            input_mask, pair_mask = self._masks(attention_mask, shape)

        embeddings = self.embeddings(input_ids, token_type_ids, position_ids, input_mask, inputs_embeds)
        outputs = self.encoder(
            embeddings, pair_mask, input_mask, output_hidden_states, output_attentions, cu_seqlens=cu_seqlens
        )
        if not return_dict:
            return tuple(
                v for v in (outputs.last_hidden_state, outputs.hidden_states, outputs.attentions) if v is not None
            )
        return outputs

    @staticmethod
    def _masks(attention_mask: Tensor, shape: torch.Size) -> tuple[Tensor, Tensor | None]:
        """[B, L] token mask and the boolean mask the backends take: [B, 1, 1, L] keys, or [B, 1, L, L] pairs."""
        if attention_mask.dim() == 2:
            input_mask = attention_mask != 0
            if not is_tracing() and input_mask.all():  # nothing to mask: the backends skip the masking work
                return input_mask, None
            return input_mask, input_mask[:, None, None, :]
        pair_mask = attention_mask != 0  # [B, L, L]
        return pair_mask.any(-2), pair_mask[:, None]


def _cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy over the labels that are not `ignore_index`; 0, not NaN, when all of them are (a batch
    with no masked token must not turn the gradients into NaN)."""
    losses = CrossEntropyLoss(reduction="none", ignore_index=ignore_index)(logits, labels)  # 0 where ignored
    return losses.sum() / (labels != ignore_index).sum().clamp(min=1)


def packed_bounds(kwargs: dict) -> tuple[int, ...] | None:
    """The bounds of packed sequences, from `cu_seqlens` or transformers' flattening collator
    (`DataCollatorWithFlattening(return_flash_attn_kwargs=True)` passes `cu_seq_lens_q`), as Python ints."""
    bounds = kwargs.get("cu_seqlens", kwargs.get("cu_seq_lens_q"))
    if bounds is None:
        return None
    bounds = tuple(int(b) for b in (bounds.tolist() if isinstance(bounds, Tensor) else bounds))
    if bounds[0] != 0 or any(last <= first for first, last in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and increase strictly, got {bounds}")
    return bounds


def packed_position_ids(cu_seqlens: tuple[int, ...], device) -> Tensor:
    """Positions that restart at 0 with every packed sequence: [1, T]."""
    return torch.cat(
        [torch.arange(last - first, device=device) for first, last in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    )[None]


def _loss_for_classification(config: DisentangledConfig, logits: Tensor, labels: Tensor) -> Tensor:
    """DeBERTa's classification loss. With `problem_type` unset: one label is regression, integer labels are
    cross-entropy over the examples whose label is >= 0, and per-class labels are soft targets."""
    num_labels = logits.shape[-1]
    if config.problem_type == "regression" or (config.problem_type is None and num_labels == 1):
        return (
            MSELoss()(logits.squeeze(-1), labels.squeeze(-1).to(logits.dtype))
            if num_labels == 1
            else MSELoss()(logits, labels.to(logits.dtype))
        )
    if config.problem_type == "single_label_classification":
        return _cross_entropy(logits.view(-1, num_labels), labels.view(-1))
    if config.problem_type == "multi_label_classification":
        return BCEWithLogitsLoss()(logits, labels.to(logits.dtype))
    if labels.dim() == 1 or labels.shape[-1] == 1:
        labels = labels.view(-1).long()
        labeled = labels >= 0
        # The mean over labeled examples (0 if none), without a data-dependent branch, so that it compiles.
        losses = CrossEntropyLoss(reduction="none")(logits.float(), labels.clamp(min=0))
        return (losses * labeled).sum() / labeled.sum().clamp(min=1)
    return -(torch.log_softmax(logits, dim=-1) * labels).sum(-1).mean()


class ContextPooler(nn.Module):
    """The hidden state of the first token, through dropout, a dense layer and an activation."""

    def __init__(self, config: DisentangledConfig):
        super().__init__()
        size = config.pooler_hidden_size or config.hidden_size
        self.dense = nn.Linear(size, size)
        self.dropout = Dropout(config.pooler_dropout)
        self.activation = ACT2FN[config.pooler_hidden_act]
        self.output_dim = size

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.activation(self.dense(self.dropout(hidden_states[:, 0])))


class LegacyMLMTransform(nn.Module):
    def __init__(self, config: DisentangledConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.word_embedding_size)
        self.transform_act_fn = ACT2FN[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.word_embedding_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))


class LegacyMLMPredictionHead(nn.Module):
    """transformers' layout (`cls.predictions`): transform, then a decoder tied to the word embeddings."""

    def __init__(self, config: DisentangledConfig):
        super().__init__()
        self.transform = LegacyMLMTransform(config)
        self.decoder = nn.Linear(config.word_embedding_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        # transformers 5 ties decoder.bias to bias through `_tied_weights_keys` when tie_word_embeddings is set (and
        # keeps them apart when not); 4.57 ties through this link and `_tie_weights`.
        if not TRANSFORMERS_5:
            self.decoder.bias = self.bias

    def _tie_weights(self) -> None:  # transformers 4.57 re-ties through this after loading
        self.decoder.bias = self.bias

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.decoder(self.transform(hidden_states))


class LegacyMLMHead(nn.Module):
    def __init__(self, config: DisentangledConfig):
        super().__init__()
        self.predictions = LegacyMLMPredictionHead(config)

    def forward(self, sequence_output: Tensor) -> Tensor:
        return self.predictions(sequence_output)


class MLMPredictionHead(nn.Module):
    """DeBERTa-v3's layout (`lm_predictions.lm_head`): transform, then the word embeddings themselves."""

    def __init__(self, config: DisentangledConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.word_embedding_size)
        self.transform_act_fn = ACT2FN[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.word_embedding_size, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: Tensor, word_embeddings: nn.Embedding) -> Tensor:
        hidden_states = self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))
        return hidden_states @ word_embeddings.weight.T + self.bias


class MLMHead(nn.Module):
    def __init__(self, config: DisentangledConfig):
        super().__init__()
        self.lm_head = MLMPredictionHead(config)

    def forward(self, sequence_output: Tensor, word_embeddings: nn.Embedding) -> Tensor:
        return self.lm_head(sequence_output, word_embeddings)


_LEGACY_TIES = {  # target: source, as transformers' DebertaV2ForMaskedLM declares them
    "cls.predictions.decoder.bias": "cls.predictions.bias",
    "cls.predictions.decoder.weight": "deberta.embeddings.word_embeddings.weight",
}


class DisentangledForMaskedLM(DisentangledPreTrainedModel):
    """Masked-LM logits from the last hidden state, or with `config.enhanced_mask_decoder` through DeBERTa's
    Enhanced Mask Decoder (see `enhanced_mask_decoder`), as Microsoft's `MaskedLanguageModel` computes them.

    `forward(..., labels=labels, sparse_prediction=True)` runs the head only where a label is (labels != -100), as
    Microsoft's `MaskedLanguageModel` and transformers' ModernBERT (`sparse_prediction`) do in pretraining: logits
    [M, V] for the M labelled tokens in row-major order, the same loss, and no [B * L, V] tensor, which at DeBERTa-v3's
    128,100-piece vocabulary is the largest of a pretraining step (2 GiB in float32 at 8 x 512 tokens)."""

    _tied_weights_keys = _LEGACY_TIES if TRANSFORMERS_5 else list(_LEGACY_TIES)

    def __init__(self, config: DisentangledConfig):
        if config.enhanced_mask_decoder and config.legacy:
            raise ValueError(
                "enhanced_mask_decoder=True needs legacy=False: the decoder feeds DeBERTa's own MLM head "
                "(lm_predictions.lm_head), not transformers' cls.predictions; set legacy=False"
            )
        if config.enhanced_mask_decoder and config.word_embedding_size != config.hidden_size:
            raise ValueError(
                f"enhanced_mask_decoder=True adds the absolute position embeddings (embedding_size="
                f"{config.word_embedding_size}) to hidden states of hidden_size={config.hidden_size}; they must be "
                "equal (set embedding_size to hidden_size, or enhanced_mask_decoder=False)"
            )
        super().__init__(config)
        self.legacy = config.legacy
        self.use_decoder = config.enhanced_mask_decoder and not config.position_biased_input
        self.deberta = DisentangledModel(config)
        if self.use_decoder:  # the decoder's Z, under the name checkpoints give it
            self.deberta.embeddings.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.word_embedding_size
            )
        if self.legacy:
            self.cls = LegacyMLMHead(config)
        else:  # the head reads the word embeddings directly: nothing to tie
            self._tied_weights_keys = {} if TRANSFORMERS_5 else []
            self.lm_predictions = MLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear | None:
        return self.cls.predictions.decoder if self.legacy else None

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        if not self.legacy:
            raise ValueError("the legacy=False MLM head reads the input embeddings; use set_input_embeddings")
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, **kwargs
    ) -> nn.Embedding:
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, **kwargs)
        vocab = embeddings.weight.shape[0]
        head = self.cls.predictions if self.legacy else self.lm_predictions.lm_head
        if head.bias.shape[0] != vocab:  # pad new tokens' bias with zeros, or cut it
            bias = torch.zeros(vocab, dtype=head.bias.dtype, device=head.bias.device)
            keep = min(vocab, head.bias.shape[0])
            bias[:keep] = head.bias.data[:keep]
            head.bias = nn.Parameter(bias)
        if self.legacy and (self.config.tie_word_embeddings or not TRANSFORMERS_5):
            head.decoder.bias = head.bias
        return embeddings

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        sparse_prediction: bool = False,
        **kwargs,
    ) -> MaskedLMOutput | tuple:
        if labels is not None:
            validate_labels(
                "labels", labels, [input_shape(input_ids, inputs_embeds)], 0, self.config.vocab_size, IGNORE_INDEX
            )
        elif sparse_prediction:
            raise ValueError("sparse_prediction=True keeps the logits where a label is: give `labels` too")
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        cu_seqlens = packed_bounds(kwargs)
        if self.use_decoder:  # the absolute positions Z, checked before the encoder runs
            position_ids = self.decoder_positions(position_ids, input_shape(input_ids, inputs_embeds), cu_seqlens)
        outputs = self.deberta(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states or self.use_decoder,  # the decoder reads the last layer's input
            return_dict=True,
            **kwargs,  # packed sequences: cu_seqlens, or the flattening collator's cu_seq_lens_q
        )
        sequence_output = outputs.last_hidden_state
        if self.use_decoder:
            sequence_output = self.enhanced_mask_decoder(
                outputs.hidden_states[-2], attention_mask, position_ids, cu_seqlens
            )
            if not output_hidden_states:
                outputs.hidden_states = None
        if sparse_prediction:  # the head at the labelled tokens only: [B, L, hidden] -> [M, hidden], labels [M]
            predicted = labels != IGNORE_INDEX
            sequence_output, labels = sequence_output[predicted], labels[predicted]
        if self.legacy:
            logits = self.cls(sequence_output)
        else:
            logits = self.lm_predictions(sequence_output, self.deberta.embeddings.word_embeddings)
        loss = _cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1)) if labels is not None else None
        return _finish(MaskedLMOutput, return_dict, loss, outputs, logits=logits)

    def decoder_positions(
        self, position_ids: Tensor | None, shape: list[int], cu_seqlens: tuple[int, ...] | None = None
    ) -> Tensor:
        """The rows of the absolute table the decoder reads ([1 or B, L]), within `max_position_embeddings`."""
        limit = self.config.max_position_embeddings
        device = self.deberta.embeddings.position_embeddings.weight.device
        if position_ids is not None:
            validate_labels("position_ids", position_ids, [list(position_ids.shape)], 0, limit)
            return position_ids
        if cu_seqlens is not None:  # positions restart with every packed sequence
            longest = max(last - first for first, last in zip(cu_seqlens[:-1], cu_seqlens[1:]))
            position_ids = packed_position_ids(cu_seqlens, device)
        else:
            longest = shape[-1]
            position_ids = torch.arange(longest, device=device)[None]
        if longest > limit:
            raise ValueError(
                f"the enhanced mask decoder reads absolute positions: a sequence of {longest} tokens exceeds "
                f"max_position_embeddings={limit}; truncate the input"
            )
        return position_ids

    def enhanced_mask_decoder(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor,
        cu_seqlens: tuple[int, ...] | None = None,
    ) -> Tensor:
        """DeBERTa's Enhanced Mask Decoder: the states the MLM head reads, [B, L, hidden].

        H = `hidden_states`, the input of the last layer (the second-to-last layer's output; the embeddings in a
        one-layer model, where Microsoft's `encoder_layers[-2]` does not exist). The query stream starts as
        Z + H, Z the absolute position embeddings (the table's rows, before any LayerNorm); the last layer runs
        twice, queries from the stream and keys/values from H, each run's output the next run's queries:

            Q_1 = Z + H,   Q_2 = Layer_L(Q_1; H),   out = Layer_L(Q_2; H)

        Relative positions and the key mask are the encoder's (the query and key lengths are equal).
        """
        encoder = self.deberta.encoder
        length = hidden_states.shape[1]
        if cu_seqlens is not None or attention_mask is None:
            pair_mask = None
        else:
            pair_mask = self.deberta._masks(attention_mask, hidden_states.shape[:2])[1]
        if cu_seqlens is not None:
            length = max(last - first for first, last in zip(cu_seqlens[:-1], cu_seqlens[1:]))
        rel_index = encoder.get_rel_index(length, hidden_states.device)
        rel_embeddings = encoder.get_rel_embedding(rel_index.rows) if rel_index is not None else None
        z = self.deberta.embeddings.position_embeddings(position_ids).to(hidden_states.dtype)  # Z: [B or 1, L, hidden]
        query_states = z + hidden_states
        last_layer = encoder.layer[-1]
        for _ in range(2):  # positional arguments: checkpointing hands the gradients of all of them back
            query_states, _ = last_layer(
                hidden_states, rel_embeddings, pair_mask, rel_index, False, cu_seqlens, query_states
            )
        return query_states


class ReplacedTokenDetectionHead(nn.Module):
    """Microsoft's `LMMaskPredictionHead` (`mask_predictions`): one logit per token, "was this token replaced?".

    logit_i = classifier(act(dense(LayerNorm(h_[CLS] + h_i))))
    """

    def __init__(self, config: DisentangledConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = ACT2FN[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.classifier = nn.Linear(config.hidden_size, 1)

    def forward(self, hidden_states: Tensor, first_token: Tensor | None = None) -> Tensor:
        """[B, L, hidden] -> [B, L]. `first_token` ([L] indices) picks each token's own [CLS] in packed rows."""
        cls = hidden_states[:, :1] if first_token is None else hidden_states[:, first_token]  # [B, 1 or L, hidden]
        states = self.transform_act_fn(self.dense(self.LayerNorm(cls + hidden_states)))
        return self.classifier(states).squeeze(-1)


@dataclass
class ReplacedTokenDetectionOutput(ModelOutput):
    """Output of [`DisentangledForReplacedTokenDetection`].

    Args:
        loss: Binary cross-entropy with logits, averaged over labelled (not -100), unpadded tokens.
        logits: [batch, length]; > 0 means "replaced" (sigmoid gives the probability).
        hidden_states: The embeddings and each layer's output, with `output_hidden_states=True`.
        attentions: Each layer's attention probabilities, with `output_attentions=True`.
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


class DisentangledForReplacedTokenDetection(DisentangledPreTrainedModel):
    """DeBERTa-v3's discriminator: the encoder and Microsoft's replaced-token-detection head (`mask_predictions`).

    `labels` [batch, length]: 1 = replaced, 0 = original, -100 = ignored. The loss is the mean binary
    cross-entropy with logits over labelled tokens that are not padding (attention_mask 0).
    """

    def __init__(self, config: DisentangledConfig):
        super().__init__(config)
        self.deberta = DisentangledModel(config)
        self.mask_predictions = ReplacedTokenDetectionHead(config)
        self.post_init()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> ReplacedTokenDetectionOutput | tuple:
        shape = input_shape(input_ids, inputs_embeds)
        if labels is not None:
            validate_labels("labels", labels, [shape], 0, 2, IGNORE_INDEX)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.deberta(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
            return_dict=True,
            **kwargs,  # packed sequences: cu_seqlens, or the flattening collator's cu_seq_lens_q
        )
        hidden_states = outputs.last_hidden_state
        first_token = None
        if (cu_seqlens := packed_bounds(kwargs)) is not None:  # each token's own sequence start: [T]
            starts = torch.tensor(cu_seqlens[:-1], device=hidden_states.device)
            lengths = torch.tensor(cu_seqlens[1:], device=hidden_states.device) - starts
            first_token = starts.repeat_interleave(lengths)
        logits = self.mask_predictions(hidden_states, first_token)
        loss = None
        if labels is not None:
            counted = labels != IGNORE_INDEX
            if attention_mask is not None and cu_seqlens is None:
                counted = counted & self.deberta._masks(attention_mask, logits.shape)[0]
            losses = BCEWithLogitsLoss(reduction="none")(logits.float(), labels.clamp(min=0).to(torch.float32))
            loss = (losses * counted).sum() / counted.sum().clamp(min=1)  # 0, not NaN, when nothing is labelled
        return _finish(ReplacedTokenDetectionOutput, return_dict, loss, outputs, logits=logits)


class DisentangledForSequenceClassification(DisentangledPreTrainedModel):
    def __init__(self, config: DisentangledConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.deberta = DisentangledModel(config)
        self.pooler = ContextPooler(config)
        self.classifier = nn.Linear(self.pooler.output_dim, config.num_labels)
        self.dropout = Dropout(config.cls_dropout if config.cls_dropout is not None else config.hidden_dropout_prob)
        self.post_init()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput | tuple:
        """With packed sequences (`cu_seqlens`, see `DisentangledModel`), one logit row per sequence: [N, labels]."""
        cu_seqlens = packed_bounds(kwargs)
        batch = len(cu_seqlens) - 1 if cu_seqlens is not None else input_shape(input_ids, inputs_embeds)[0]
        if labels is not None:
            validate_classification_labels(self.config, labels, batch=batch)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.deberta(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
            return_dict=True,
            **kwargs,  # packed sequences: cu_seqlens, or the flattening collator's cu_seq_lens_q
        )
        hidden_states = outputs.last_hidden_state
        if cu_seqlens is not None:  # the pooler reads each sequence's first token: [N, 1, hidden]
            hidden_states = hidden_states[0, list(cu_seqlens[:-1])].unsqueeze(1)
        logits = self.classifier(self.dropout(self.pooler(hidden_states)))
        loss = _loss_for_classification(self.config, logits, labels) if labels is not None else None
        return _finish(SequenceClassifierOutput, return_dict, loss, outputs, logits=logits)


class DisentangledForTokenClassification(DisentangledPreTrainedModel):
    def __init__(self, config: DisentangledConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.deberta = DisentangledModel(config)
        self.dropout = Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> TokenClassifierOutput | tuple:
        if labels is not None:
            validate_labels("labels", labels, [input_shape(input_ids, inputs_embeds)], 0, self.num_labels, IGNORE_INDEX)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.deberta(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
            return_dict=True,
            **kwargs,  # packed sequences: cu_seqlens, or the flattening collator's cu_seq_lens_q
        )
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        loss = None
        if labels is not None:
            loss = _cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return _finish(TokenClassifierOutput, return_dict, loss, outputs, logits=logits)


class DisentangledForQuestionAnswering(DisentangledPreTrainedModel):
    def __init__(self, config: DisentangledConfig):
        super().__init__(config)
        if config.num_labels != 2:
            raise ValueError(
                f"question answering predicts a start and an end logit: num_labels must be 2, got {config.num_labels}"
            )
        self.num_labels = config.num_labels
        self.deberta = DisentangledModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        start_positions: Tensor | None = None,
        end_positions: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput | tuple:
        validate_span_positions(start_positions, end_positions, batch=input_shape(input_ids, inputs_embeds)[0])
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.deberta(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
            return_dict=True,
        )
        logits = self.qa_outputs(outputs.last_hidden_state)
        start_logits, end_logits = (part.squeeze(-1).contiguous() for part in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]  # positions outside the input are ignored
            start_positions = start_positions.view(-1).clamp(0, ignored)
            end_positions = end_positions.view(-1).clamp(0, ignored)
            start_loss = _cross_entropy(start_logits, start_positions, ignore_index=ignored)
            loss = (start_loss + _cross_entropy(end_logits, end_positions, ignore_index=ignored)) / 2
        return _finish(
            QuestionAnsweringModelOutput, return_dict, loss, outputs, start_logits=start_logits, end_logits=end_logits
        )


class DisentangledForMultipleChoice(DisentangledPreTrainedModel):
    def __init__(self, config: DisentangledConfig):
        super().__init__(config)
        self.deberta = DisentangledModel(config)
        self.pooler = ContextPooler(config)
        self.classifier = nn.Linear(self.pooler.output_dim, 1)
        self.dropout = Dropout(config.cls_dropout if config.cls_dropout is not None else config.hidden_dropout_prob)
        self.post_init()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MultipleChoiceModelOutput | tuple:
        validate_inputs(
            self.config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, batch_dims=2
        )
        batch, num_choices, _ = input_shape(input_ids, inputs_embeds, batch_dims=2)
        validate_labels("labels", labels, [[batch]], 0, num_choices, IGNORE_INDEX)
        return_dict = return_dict if return_dict is not None else self.config.return_dict

        def flat(x: Tensor | None) -> Tensor | None:  # [B, C, ...] -> [B * C, ...]
            return x.flatten(0, 1) if x is not None else None

        outputs = self.deberta(
            flat(input_ids),
            flat(attention_mask),
            flat(token_type_ids),
            flat(position_ids),
            flat(inputs_embeds),
            output_attentions,
            output_hidden_states,
            return_dict=True,
        )
        logits = self.classifier(self.dropout(self.pooler(outputs.last_hidden_state))).view(-1, num_choices)
        loss = _cross_entropy(logits, labels) if labels is not None else None
        return _finish(MultipleChoiceModelOutput, return_dict, loss, outputs, logits=logits)


def _finish(output_class, return_dict: bool, loss: Tensor | None, outputs: BaseModelOutput, **results):
    """The head's output dataclass, or transformers' tuple layout: (loss,) + results + (hidden_states, attentions)."""
    output = output_class(loss=loss, **results, hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    return output if return_dict else output.to_tuple()


__all__ = [
    "DisentangledPreTrainedModel",
    "DisentangledModel",
    "DisentangledForMaskedLM",
    "DisentangledForReplacedTokenDetection",
    "ReplacedTokenDetectionOutput",
    "DisentangledForSequenceClassification",
    "DisentangledForTokenClassification",
    "DisentangledForQuestionAnswering",
    "DisentangledForMultipleChoice",
]
