"""Configs shaped like the released DeBERTa checkpoints, cut to 2 layers and a ~1000-token vocabulary.

Every attention field is kept as the released config.json has it, so a mistake in buckets, spans,
shared keys or scaling shows up in the parity tests.
"""

from __future__ import annotations

V3_COMMON = dict(
    relative_attention=True,
    max_relative_positions=-1,
    position_buckets=256,
    norm_rel_ebd="layer_norm",
    share_att_key=True,
    pos_att_type="p2c|c2p",
    position_biased_input=False,
    type_vocab_size=0,
    layer_norm_eps=1e-7,
    max_position_embeddings=512,
    hidden_act="gelu",
    pad_token_id=0,
)

# transformers' deberta-v2 config.json fields (model_type deberta-v2)
V2_SHAPES = {
    "deberta-v3-xsmall": dict(V3_COMMON, hidden_size=384, num_attention_heads=6, intermediate_size=1536),
    "deberta-v3-base": dict(V3_COMMON, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "deberta-v3-large": dict(V3_COMMON, hidden_size=1024, num_attention_heads=16, intermediate_size=4096),
    "mdeberta-v3-base": dict(V3_COMMON, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "deberta-v2-xlarge": dict(
        V3_COMMON,
        hidden_size=1536,
        num_attention_heads=24,
        intermediate_size=6144,
        attention_head_size=64,
        conv_kernel_size=3,
        conv_act="gelu",
    ),
}

# transformers' deberta (v1) config.json fields (model_type deberta)
V1_SHAPES = {
    "deberta-base": dict(
        hidden_size=768,
        num_attention_heads=12,
        intermediate_size=3072,
        relative_attention=True,
        max_relative_positions=-1,
        pos_att_type=["c2p", "p2c"],
        position_biased_input=False,
        type_vocab_size=0,
        layer_norm_eps=1e-7,
        max_position_embeddings=512,
        hidden_act="gelu",
        pad_token_id=0,
    ),
    "deberta-large": dict(
        hidden_size=1024,
        num_attention_heads=16,
        intermediate_size=4096,
        relative_attention=True,
        max_relative_positions=-1,
        pos_att_type=["c2p", "p2c"],
        position_biased_input=False,
        type_vocab_size=0,
        layer_norm_eps=1e-7,
        max_position_embeddings=512,
        hidden_act="gelu",
        pad_token_id=0,
    ),
}


def cut(shape: dict, num_hidden_layers: int = 2, vocab_size: int = 1000) -> dict:
    return dict(shape, num_hidden_layers=num_hidden_layers, vocab_size=vocab_size)
