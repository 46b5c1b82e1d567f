"""Small DeBERTa-v3 and v1 checkpoints in transformers' own format, as libraries find them on the Hub.

Each folder holds a transformers `DebertaV2*` (model_type deberta-v2, v3's attention fields) or `Deberta*` (v1) model
with seeded, inflated weights (`parity.inflate_weights`: attention far from uniform, so a wrong position term shows)
and the SentencePiece tokenizer trained at test time, as `microsoft/deberta-v3-*` ships it (spm.model and a
tokenizer_config.json). No `auto_map`: plain transformers builds them, which is what `disentangled.accelerate` and
`disentangled.enable()` act on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from deberta_shapes import V3_COMMON
from parity import inflate_weights
from tiny_models import TINY_SIZES, spm_model, tokenizer

from disentangled.integrations.tokenization import SPM_TOKENIZER_CONFIG

# deberta-v3's attention fields (deberta_shapes.V3_COMMON) at a tiny size; 16 buckets so that a sentence already
# reaches the log buckets
V3 = dict(V3_COMMON, **TINY_SIZES, max_position_embeddings=128, position_buckets=16)
# deberta-base's (v1): no buckets, separate position projections, absolute positions added to the input
V1 = dict(
    TINY_SIZES,
    max_position_embeddings=128,
    relative_attention=True,
    max_relative_positions=12,
    pos_att_type=["c2p", "p2c"],
    position_biased_input=True,
    type_vocab_size=0,
    layer_norm_eps=1e-7,
    hidden_act="gelu",
)
NLI_LABELS = {0: "entailment", 1: "neutral", 2: "contradiction"}
NER_LABELS = {0: "O", 1: "B-LOC", 2: "I-LOC", 3: "B-PER", 4: "I-PER"}


def save_checkpoint(folder: Path, class_name: str, seed: int = 0, **config) -> Path:
    """transformers' `class_name` (e.g. "DebertaV2ForSequenceClassification") with seeded inflated weights, and the
    tokenizer, saved to `folder`; config fields: V3 or V1 by the class, then `config`."""
    tok = tokenizer()
    v1 = not class_name.startswith("DebertaV2")
    config_class = transformers.DebertaConfig if v1 else transformers.DebertaV2Config
    fields = {**(V1 if v1 else V3), "vocab_size": len(tok), "pad_token_id": tok.pad_token_id, **config}
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config_class(**fields))
    inflate_weights(model, seed)
    model.save_pretrained(folder)
    (Path(folder) / "spm.model").write_bytes(spm_model().read_bytes())
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(SPM_TOKENIZER_CONFIG))
    return Path(folder)
