"""The converter's self-check for the heads transformers has no class for: the Enhanced Mask Decoder and RTD.

The encoder is checked as for every head, against transformers' own class (`DebertaModel` / `DebertaV2Model`) on
the source weights. The heads are then recomputed from the source tensors without our model's forward:

- replaced-token detection (Microsoft's `LMMaskPredictionHead`): classifier(act(dense(LayerNorm(h_[CLS] + h_i))))
  on transformers' last hidden state;
- the Enhanced Mask Decoder (Microsoft's `EnhancedMaskDecoder`): H = transformers' input of the last layer, queries
  Z + H with Z the source's absolute table, then transformers' own `DebertaV2Layer` run twice with `query_states`
  (keys and values from H), its relative embeddings, positions and mask from transformers' encoder; the MLM head
  (`lm_predictions.lm_head`) on the second output. That layer is a DeBERTa-v2 holding the converted weights (read
  from the folder's model, never run through its forward), which also represents v1 (transformers' v1 layer cannot
  take batched `query_states`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from transformers.activations import ACT2FN

POSITION_TABLE = "deberta.embeddings.position_embeddings.weight"


def decoder_twin(config, converted: dict[str, Tensor]) -> nn.Module:
    """transformers' DebertaV2Model holding the converted encoder weights (our names are DeBERTa-v2's)."""
    from .export import deberta_v2_config

    v2_config = deberta_v2_config(config.to_dict())
    v2_config.hidden_dropout_prob = v2_config.attention_probs_dropout_prob = 0.0
    twin = transformers.DebertaV2Model(v2_config)
    expected = twin.state_dict()
    weights = {key.removeprefix("deberta."): value.float() for key, value in converted.items()}
    missing = [key for key in expected if key not in weights]
    if missing:
        raise ValueError(f"the decoder check found no weights for {missing[:3]}")
    twin.load_state_dict({key: weights[key] for key in expected}, strict=True)
    twin.set_attn_implementation("eager")
    return twin.eval()


def emd_logits(reference: nn.Module, twin: nn.Module, config, source: dict[str, Tensor], batch: dict) -> Tensor:
    """Masked-LM logits through the Enhanced Mask Decoder, computed with transformers' layers."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    hidden = reference(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states[-2]
    length = hidden.shape[1]
    table = source[POSITION_TABLE].float()
    if config.position_biased_input:  # Microsoft's decoder is then the plain last layer
        states = reference(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    else:
        encoder = twin.encoder
        query_states = table[:length][None] + hidden  # Z + H
        mask = encoder.get_attention_mask(attention_mask)
        relative_pos = encoder.get_rel_pos(hidden)
        rel_embeddings = encoder.get_rel_embedding()
        for _ in range(2):
            query_states = encoder.layer[-1](
                hidden,
                mask,
                query_states=query_states,
                relative_pos=relative_pos,
                rel_embeddings=rel_embeddings,
            )
            if isinstance(query_states, tuple):  # transformers 4.x returns (states, attentions)
                query_states = query_states[0]
        states = query_states
    prefix = "lm_predictions.lm_head."
    states = ACT2FN[config.hidden_act](F.linear(states, source[prefix + "dense.weight"], source[prefix + "dense.bias"]))
    states = F.layer_norm(
        states,
        states.shape[-1:],
        source[prefix + "LayerNorm.weight"],
        source[prefix + "LayerNorm.bias"],
        config.layer_norm_eps,
    )
    return states @ source["deberta.embeddings.word_embeddings.weight"].float().T + source[prefix + "bias"]


def rtd_logits(reference: nn.Module, config, source: dict[str, Tensor], batch: dict) -> Tensor:
    """Replaced-token-detection logits [B, L] from transformers' last hidden state and the source's head."""
    hidden = reference(**batch).last_hidden_state
    prefix = "mask_predictions."
    states = F.layer_norm(
        hidden[:, :1] + hidden,
        hidden.shape[-1:],
        source[prefix + "LayerNorm.weight"],
        source[prefix + "LayerNorm.bias"],
        config.layer_norm_eps,
    )
    states = ACT2FN[config.hidden_act](F.linear(states, source[prefix + "dense.weight"], source[prefix + "dense.bias"]))
    return F.linear(states, source[prefix + "classifier.weight"], source[prefix + "classifier.bias"]).squeeze(-1)


def compare_head(
    task: str,
    reference: nn.Module,
    ours: nn.Module,
    config,
    source: dict[str, Tensor],
    batch: dict,
    dtype: str = "float32",
) -> dict[str, dict[str, float]]:
    """max |ours - reference| at real positions: the encoder's last hidden state, then the head's logits.

    `reference` is transformers' base model on the source weights, `source` the source tensors (rounded to `dtype`
    here, as `ours` was), `ours` the converted model."""
    from .convert import DTYPES

    rounding = DTYPES[dtype]
    source = {key: value.to(rounding).float() if value.is_floating_point() else value for key, value in source.items()}
    with torch.no_grad():
        expected = {"last_hidden_state": reference(**batch).last_hidden_state}
        if task == "replaced-token-detection":
            expected["logits"] = rtd_logits(reference, config, source, batch)
        else:
            twin = decoder_twin(config, ours.state_dict())
            expected["logits"] = emd_logits(reference, twin, config, source, batch)
        actual = {"last_hidden_state": ours.deberta(**batch).last_hidden_state, "logits": ours(**batch).logits}
    mask = batch["attention_mask"].bool()
    figures = {}
    for name, value in expected.items():
        got = actual[name].float()
        if not torch.isfinite(got).all():
            raise ValueError(f"{name}: the converted model produced NaN or inf")
        figures[name] = {
            "max_abs_diff": (got - value.float()).abs()[mask].max().item(),
            "max_abs_reference": value.abs().max().item(),
        }
    return figures
