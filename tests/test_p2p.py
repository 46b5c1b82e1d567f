"""The optional p2p term, checked by hand: P_δ(i,j) Wq_p . P_δ(j,i) Wk_p with explicit loops over i and j."""

from __future__ import annotations

import math

import pytest
import torch
from attention_capture import eager_scores
from parity import inflate_weights

from disentangled import DisentangledConfig, DisentangledModel

TINY_P2P = dict(
    vocab_size=30,
    hidden_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=16,
    pos_att_type=["p2p"],  # c2c + p2p alone: the captured score has nothing else in it
    share_att_key=False,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
CLIPPED = dict(position_buckets=-1, max_relative_positions=8)  # v1: δ clipped to [-8, 7]
LOG_BUCKETS = dict(position_buckets=4, max_relative_positions=16)  # v2/v3: log buckets, span 4


def bucket(distance: int, bucket_size: int, max_position: int) -> int:
    """DeBERTa-v2's log bucket of one distance, in plain Python; no buckets: the distance itself."""
    mid = bucket_size // 2
    if bucket_size <= 0 or abs(distance) <= mid:
        return distance
    far = math.ceil(math.log(abs(distance) / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    return int(math.copysign(far, distance))


def hand_scores(model: DisentangledModel, hidden: torch.Tensor) -> torch.Tensor:
    """c2c + p2p of layer 0 for one sequence [L, hidden], one (head, i, j) at a time: [H, L, L]."""
    config = model.config
    attention = model.encoder.layer[0].attention.self
    span, head_dim = config.relative_span, config.head_size
    rel = model.encoder.get_rel_embedding()  # P, normalised: [2S, hidden]
    query, key = attention.query_proj(hidden), attention.key_proj(hidden)  # H Wq_c, H Wk_c: [L, H * D]
    pos_query, pos_key = attention.pos_query_proj(rel), attention.pos_key_proj(rel)  # P Wq_p, P Wk_p: [2S, H * D]
    length = hidden.shape[0]
    scores = torch.zeros(config.num_attention_heads, length, length)
    for h in range(config.num_attention_heads):
        part = slice(h * head_dim, (h + 1) * head_dim)
        for i in range(length):
            for j in range(length):
                row_ij = min(
                    max(bucket(i - j, config.position_buckets, config.max_relative_distance) + span, 0), 2 * span - 1
                )
                row_ji = min(
                    max(bucket(j - i, config.position_buckets, config.max_relative_distance) + span, 0), 2 * span - 1
                )
                c2c = torch.dot(query[i, part], key[j, part])
                p2p = torch.dot(pos_query[row_ij, part], pos_key[row_ji, part])  # P_δ(i,j) Wq_p . P_δ(j,i) Wk_p
                scores[h, i, j] = (c2c + p2p) / math.sqrt(head_dim * 2)
    return scores


def model_and_scores(fields: dict, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    model = DisentangledModel(DisentangledConfig(**TINY_P2P, **fields)).eval()
    inflate_weights(model)
    input_ids = torch.randint(1, 30, (1, length))
    with torch.no_grad(), eager_scores() as captured:
        hidden = model(input_ids, output_hidden_states=True, output_attentions=True).hidden_states[0][0]
        expected = hand_scores(model, hidden)
    return captured[0][0], expected


@pytest.mark.parametrize("fields", [CLIPPED, LOG_BUCKETS], ids=["clipped", "log_buckets"])
def test_p2p_matches_the_formula_by_hand(fields):
    actual, expected = model_and_scores(fields, length=8)  # every |i - j| inside the span: nothing clipped
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "fields",
    [dict(position_buckets=-1, max_relative_positions=3), dict(position_buckets=4, max_relative_positions=6)],
    ids=["clipped", "log_buckets_saturated"],
)
def test_p2p_matches_the_formula_where_distances_are_clipped(fields):
    # Where i - j is clipped, one bucket of δ(i, j) meets two buckets of δ(j, i): p2p is kept by distance.
    actual, expected = model_and_scores(fields, length=12)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("share_att_key", [False, True])
def test_gradients_reach_the_position_projections_through_p2p(share_att_key):
    model = DisentangledModel(DisentangledConfig(**dict(TINY_P2P, share_att_key=share_att_key), **LOG_BUCKETS))
    inflate_weights(model)
    output = model(torch.randint(1, 30, (2, 10))).last_hidden_state
    (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum().backward()
    attention = model.encoder.layer[0].attention.self
    # With p2p alone, the relative embeddings reach the score through p2p only.
    reached = {"rel_embeddings": model.encoder.rel_embeddings.weight.grad}
    if not share_att_key:
        reached["pos_query_proj"] = attention.pos_query_proj.weight.grad
        reached["pos_key_proj"] = attention.pos_key_proj.weight.grad
    for name, grad in reached.items():
        assert grad is not None and grad.abs().max() > 1e-6, f"no gradient reaches {name}"
