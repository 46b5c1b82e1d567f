"""DeBERTa v1 (transformers' `deberta` format) to our parameter layout.

v1 fuses the content projections into `in_proj` (no bias) laid out head by head: for head h, rows
[3hD, 3hD + D) are its query, the next D its key, the next D its value. Query and value biases are
separate (`q_bias`, `v_bias`); the key has none. The position projections are `pos_proj` (key side,
no bias) and `pos_q_proj` (query side). v1 clips relative distances (no buckets), projects them with
these separate matrices and does not normalise the relative embeddings.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

V1_ATTENTION = re.compile(
    r"^(?P<prefix>.*\.attention\.self\.)(?P<name>in_proj\.weight|q_bias|v_bias|pos_proj\.weight|pos_q_proj\.(?:weight|bias))$"
)


def split_in_proj(weight: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """[3 * H * D, hidden] fused head by head -> query, key, value weights, each [H * D, hidden]."""
    per_head = weight.view(num_heads, 3, -1, weight.shape[-1])  # [H, (q, k, v), D, hidden]
    return tuple(per_head[:, part].reshape(-1, weight.shape[-1]) for part in range(3))


def convert_v1_state_dict(state_dict: dict[str, Tensor], num_heads: int) -> dict[str, Tensor]:
    """Rename and split v1 attention weights; every other key is already ours. Zero biases become explicit."""
    converted: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        match = V1_ATTENTION.match(key)
        if match is None:
            converted[key] = value
            continue
        prefix, name = match["prefix"], match["name"]
        if name == "in_proj.weight":
            query, key_weight, value_weight = split_in_proj(value, num_heads)
            converted[prefix + "query_proj.weight"] = query.contiguous()
            converted[prefix + "key_proj.weight"] = key_weight.contiguous()
            converted[prefix + "value_proj.weight"] = value_weight.contiguous()
            converted[prefix + "key_proj.bias"] = torch.zeros(key_weight.shape[0], dtype=value.dtype)
        elif name == "q_bias":
            converted[prefix + "query_proj.bias"] = value
        elif name == "v_bias":
            converted[prefix + "value_proj.bias"] = value
        elif name == "pos_proj.weight":
            converted[prefix + "pos_key_proj.weight"] = value
            converted[prefix + "pos_key_proj.bias"] = torch.zeros(value.shape[0], dtype=value.dtype)
        else:  # pos_q_proj.weight / .bias
            converted[prefix + name.replace("pos_q_proj", "pos_query_proj")] = value
    return converted

