"""Per-sequence draws (disentangled.pretraining.sequence_draws) in-process: a sequence is masked and sampled alike whatever batch
holds it and however it is padded, the draws change with the step, the inverse-transform sample follows the
probabilities, and one process's token shares are 1."""

from __future__ import annotations

import torch
from tiny_models import tokenizer

from disentangled.pretraining import IGNORE_INDEX, MaskingCollator
from disentangled.pretraining.sequence_draws import sample, token_shares


def batch(rows: list[list[int]], pad: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.full((len(rows), length), pad)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for at, row in enumerate(rows):
        input_ids[at, : len(row)] = torch.tensor(row)
        attention_mask[at, : len(row)] = 1
    return input_ids, attention_mask


def test_a_sequence_is_masked_alike_in_any_batch_and_padding():
    tok = tokenizer()
    ordinary = [i for i in range(len(tok)) if i not in tok.all_special_ids]
    draws = torch.Generator().manual_seed(0)
    rows = [[tok.cls_token_id, *(ordinary[int(i)] for i in torch.randint(len(ordinary), (n,), generator=draws))]
            for n in (30, 22, 41, 35)]  # fmt: skip
    for objective, whole_word_mask in (("mlm", False), ("rtd", False), ("mlm", True)):
        masking = MaskingCollator(tok, objective=objective, whole_word_mask=whole_word_mask, seed=3, step=5)
        together = masking.mask(*batch(rows, tok.pad_token_id, 48))
        for at, row in enumerate(rows):  # alone, and padded to another length
            alone = masking.mask(*batch([row], tok.pad_token_id, len(row) + 3))
            assert torch.equal(alone[0][0, : len(row)], together[0][at, : len(row)])
            assert torch.equal(alone[1][0, : len(row)], together[1][at, : len(row)])
        assert (together[1] != IGNORE_INDEX).any()
        masking.step = 6
        assert not torch.equal(masking.mask(*batch(rows, tok.pad_token_id, 48))[1], together[1])


def test_the_inverse_transform_sample_follows_the_probabilities():
    probabilities = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(20000, 4)
    counts = torch.bincount(
        sample(probabilities, torch.rand(20000, generator=torch.Generator().manual_seed(1))), minlength=4
    )
    frequencies = counts / counts.sum()
    assert counts[1] == 0  # a token of probability 0 is never drawn
    # binomial standard deviation at 20000 draws is at most 0.0035: within 4 of them
    assert (frequencies - probabilities[0]).abs().max() < 0.014


def test_one_process_takes_the_whole_mean():
    assert [share.item() for share in token_shares(torch.tensor(7), torch.tensor(0))] == [1.0, 1.0]
