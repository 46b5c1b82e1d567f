"""DeBERTa's pretraining heads written out from Microsoft's code, for the tests: no module of ours is called.

- `decoder_layer`: one DeBERTa layer with queries from a separate stream (Microsoft's `DisentangledSelfAttention`
  with `query_states`): projections, relative indices from the bucketing formula, c2p and p2c gathered Microsoft's
  way, the pairwise mask, then the output and feed-forward sublayers (the query stream is the residual);
- `emd_states`: `EnhancedMaskDecoder.emd_context_layer`: queries Z + H, the last layer twice;
- `mlm_logits` (`BertLMPredictionHead`) and `rtd_logits` (`LMMaskPredictionHead`).

Weights come as plain tensors under DeBERTa-v2 names, so the same reference reads our models, transformers' v2
models and (through `v1_layer_weights`) transformers' v1 models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Spec:
    heads: int
    head_dim: int
    terms: list[str]
    position_buckets: int  # <= 0: clipped distances
    reach: int  # max_relative_positions, or max_position_embeddings when it is < 1
    share_att_key: bool
    eps: float

    @classmethod
    def of(cls, config) -> Spec:
        """From our config or a transformers DeBERTa (v1/v2) config."""
        terms = config.pos_att_type
        if isinstance(terms, str):
            terms = [t.strip() for t in terms.lower().split("|")]
        max_rel = getattr(config, "max_relative_positions", -1)
        return cls(
            heads=config.num_attention_heads,
            head_dim=getattr(config, "attention_head_size", None) or config.hidden_size // config.num_attention_heads,
            terms=[t for t in terms if t != "none"],
            position_buckets=getattr(config, "position_buckets", -1),
            reach=max_rel if max_rel > 0 else config.max_position_embeddings,
            share_att_key=getattr(config, "share_att_key", False),
            eps=config.layer_norm_eps,
        )


def log_bucket_position(rel: Tensor, bucket_size: int, max_position: int) -> Tensor:
    """Microsoft's `make_log_bucket_position`: exact within bucket_size // 2, logarithmic beyond."""
    sign = torch.sign(rel)
    mid = bucket_size // 2
    abs_pos = torch.where((rel < mid) & (rel > -mid), torch.full_like(rel, mid - 1), rel.abs())
    log_pos = torch.ceil(torch.log(abs_pos / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, rel, log_pos * sign).long()


def relative_position(spec: Spec, length: int) -> Tensor:
    """[L, L]: the (bucketed) i - j."""
    rel = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).double()
    if spec.position_buckets > 0:
        return log_bucket_position(rel, spec.position_buckets, spec.reach)
    return rel.long()


def linear(x: Tensor, w: dict, name: str) -> Tensor:
    return x @ w[name + ".weight"].T + w[name + ".bias"]


def layer_norm(x: Tensor, w: dict, name: str, eps: float) -> Tensor:
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]


def gelu(x: Tensor) -> Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def decoder_layer(
    w: dict, spec: Spec, rel_table: Tensor, hidden: Tensor, query_states: Tensor, input_mask: Tensor
) -> Tensor:
    """One layer, queries from `query_states`, keys and values from `hidden`. `w`: the layer's tensors by name."""
    batch, length, _ = hidden.shape

    def split(x):  # [B, L, H * D] or [W, H * D] -> [B, H, L, D] or [H, W, D]
        return x.view(*x.shape[:-1], spec.heads, spec.head_dim).transpose(-3, -2)

    query = split(linear(query_states, w, "attention.self.query_proj"))
    key = split(linear(hidden, w, "attention.self.key_proj"))
    value = split(linear(hidden, w, "attention.self.value_proj"))
    scale = math.sqrt(spec.head_dim * (1 + len(spec.terms)))
    scores = query @ key.transpose(-1, -2) / scale  # c2c

    relative = relative_position(spec, length)
    # v2/v3: every bucket row; v1: the rows within reach of this length
    att_span = spec.position_buckets if spec.position_buckets > 0 else min(length, spec.reach)
    table_span = rel_table.shape[0] // 2
    rel_rows = rel_table[table_span - att_span : table_span + att_span]
    key_proj = "attention.self.key_proj" if spec.share_att_key else "attention.self.pos_key_proj"
    query_proj = "attention.self.query_proj" if spec.share_att_key else "attention.self.pos_query_proj"
    if "c2p" in spec.terms:  # the query (from the query stream) against the relative key rows of i - j
        c2p = query @ split(linear(rel_rows, w, key_proj)).transpose(-1, -2) / scale  # [B, H, L, 2 span]
        index = torch.clamp(relative + att_span, 0, 2 * att_span - 1)
        scores = scores + torch.gather(c2p, -1, index.expand(batch, spec.heads, length, length))
    if "p2c" in spec.terms:  # the key (from H) against the relative query rows, gathered by -(j - i), transposed
        p2c = key @ split(linear(rel_rows, w, query_proj)).transpose(-1, -2) / scale  # [B, H, L, 2 span]
        index = torch.clamp(-relative + att_span, 0, 2 * att_span - 1)
        scores = scores + torch.gather(p2c, -1, index.expand(batch, spec.heads, length, length)).transpose(-1, -2)

    pair = (input_mask[:, None, :, None] & input_mask[:, None, None, :]).bool()  # Microsoft's [B, 1, L, L] mask
    scores = scores.masked_fill(~pair, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, -1).masked_fill(~pair, 0.0)
    context = (probs @ value).transpose(1, 2).reshape(batch, length, spec.heads * spec.head_dim)

    attention_output = layer_norm(  # the residual is the query stream
        linear(context, w, "attention.output.dense") + query_states, w, "attention.output.LayerNorm", spec.eps
    )
    intermediate = gelu(linear(attention_output, w, "intermediate.dense"))
    return layer_norm(linear(intermediate, w, "output.dense") + attention_output, w, "output.LayerNorm", spec.eps)


def emd_states(w: dict, spec: Spec, rel_table: Tensor, hidden: Tensor, table: Tensor, input_mask: Tensor) -> Tensor:
    """The decoder's output: queries Z + H (Z = the first L rows of the absolute `table`), the last layer twice."""
    query_states = table[: hidden.shape[1]][None] + hidden
    for _ in range(2):
        query_states = decoder_layer(w, spec, rel_table, hidden, query_states, input_mask)
    return query_states


def mlm_logits(w: dict, word_embeddings: Tensor, states: Tensor, eps: float) -> Tensor:
    """`lm_predictions.lm_head`: dense, gelu, LayerNorm, then the word embeddings and a bias."""
    states = layer_norm(gelu(linear(states, w, "dense")), w, "LayerNorm", eps)
    return states @ word_embeddings.T + w["bias"]


def rtd_logits(w: dict, hidden: Tensor, eps: float) -> Tensor:
    """`mask_predictions`: LayerNorm(h_[CLS] + h_i), dense, gelu, a one-unit classifier: [B, L]."""
    states = gelu(linear(layer_norm(hidden[:, :1] + hidden, w, "LayerNorm", eps), w, "dense"))
    return linear(states, w, "classifier").squeeze(-1)


def prefixed(state_dict: dict, prefix: str) -> dict:
    return {key.removeprefix(prefix): value for key, value in state_dict.items() if key.startswith(prefix)}


def v1_layer_weights(w: dict, heads: int) -> dict:
    """transformers' v1 layer (fused `in_proj`, `q_bias`/`v_bias`, `pos_proj`/`pos_q_proj`) under v2 names.

    `in_proj` rows are grouped head by head, each head's query, key and value in turn (as transformers splits
    them for `query_states`); the key projections have no bias."""
    out = {k: v for k, v in w.items() if not k.startswith("attention.self.")}
    fused = w["attention.self.in_proj.weight"].chunk(heads * 3, dim=0)
    for part, name in enumerate(("query_proj", "key_proj", "value_proj")):
        out[f"attention.self.{name}.weight"] = torch.cat([fused[h * 3 + part] for h in range(heads)])
    out["attention.self.query_proj.bias"] = w["attention.self.q_bias"]
    out["attention.self.key_proj.bias"] = torch.zeros_like(w["attention.self.q_bias"])
    out["attention.self.value_proj.bias"] = w["attention.self.v_bias"]
    out["attention.self.pos_key_proj.weight"] = w["attention.self.pos_proj.weight"]
    out["attention.self.pos_key_proj.bias"] = torch.zeros(w["attention.self.pos_proj.weight"].shape[0])
    out["attention.self.pos_query_proj.weight"] = w["attention.self.pos_q_proj.weight"]
    out["attention.self.pos_query_proj.bias"] = w["attention.self.pos_q_proj.bias"]
    return out
