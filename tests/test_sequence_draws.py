"""Per-sequence draws (disentangled.pretraining.sequence_draws) in-process: a sequence is masked and sampled alike whatever batch
holds it and however it is padded, the draws change with the step, the inverse-transform sample follows the
probabilities, and one process's token shares are 1."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tokenizer
from torch.utils._python_dispatch import TorchDispatchMode

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


def chi_square_p_value(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    """Pearson's test of `counts` against multinomial `probabilities` (float64): P(chi2 >= the statistic) with
    (cells - 1) degrees of freedom, cells those of probability above 0."""
    cells = probabilities > 0
    expected = probabilities[cells] * counts.sum()
    statistic = ((counts[cells] - expected) ** 2 / expected).sum()
    freedom = torch.tensor(float(cells.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(freedom / 2, statistic / 2))


def logits_and_draws(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A 40-piece vocabulary (a wide spread of logits, one piece that is never drawn) repeated over `rows`, and
    seeded uniforms."""
    logits = torch.randn(40, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    logits[7] = float("-inf")
    draws = torch.rand(rows, generator=torch.Generator().manual_seed(1))
    return logits.to(dtype).expand(rows, 40), draws


def test_the_chi_square_helper_against_the_table():
    """The 5% critical values of chi-square with 1 and 10 degrees of freedom (3.841, 18.307)."""
    for statistic, freedom in ((3.841459, 1), (18.307038, 10)):
        p = torch.special.gammaincc(torch.tensor(freedom / 2, dtype=torch.float64), torch.tensor(statistic / 2))
        assert abs(float(p) - 0.05) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_sample_is_multinomial_over_the_softmax_of_the_logits(dtype):
    """60,000 draws, in chunks of 1,000 rows, against the exact probabilities of the logits as given (softmax in
    float64 of their float32 / bfloat16 / float16 values): Pearson's test does not reject them, and rejects samplers
    a little off with the same draws (temperature 1.1; an off-by-one index)."""
    logits, draws = logits_and_draws(60000, dtype)
    exact = torch.softmax(logits[0].double(), dim=-1)
    counts = torch.bincount(sample(logits, draws, chunk_elements=40 * 1000), minlength=40).double()
    assert counts[7] == 0  # a piece of probability 0 is never drawn
    assert chi_square_p_value(counts, exact) > 1e-3
    warmer = torch.bincount(sample(logits.float() / 1.1, draws), minlength=40).double()
    shifted = torch.bincount((sample(logits, draws) + 1) % 40, minlength=40).double()  # an off-by-one
    assert chi_square_p_value(warmer, exact) < 1e-6
    assert chi_square_p_value(shifted, exact) < 1e-6


def test_the_sample_does_not_depend_on_the_chunking_and_keeps_the_whole_batch_draws():
    """Any chunk of rows gives the same indices, and they are those of the inverse transform over the whole
    [M, V] float64 sums (how `sample` drew before it took chunks)."""
    logits = torch.randn(37, 5000, generator=torch.Generator().manual_seed(2)) * 4
    draws = torch.rand(37, generator=torch.Generator().manual_seed(3))
    cdf = torch.softmax(logits, dim=-1).double().cumsum(-1)
    whole = torch.searchsorted(cdf, (draws.double() * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    for chunk_elements in (1, 5000 * 4, 5000 * 36, 10**9):
        assert torch.equal(sample(logits, draws, chunk_elements=chunk_elements), whole)


class Allocations(TorchDispatchMode):
    """The (shape, dtype) of every tensor an operation returns while active."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.made.append((tuple(tensor.shape), tensor.dtype))
        return out


def test_the_sample_holds_one_chunk_of_rows_in_float64():
    logits = torch.randn(50, 3000, generator=torch.Generator().manual_seed(4))
    draws = torch.rand(50, generator=torch.Generator().manual_seed(5))
    with Allocations() as seen:
        sample(logits, draws, chunk_elements=4 * 3000)
    wide = [shape for shape, dtype in seen.made if dtype == torch.float64 and len(shape) == 2]
    assert wide and max(rows for rows, _ in wide) == 4  # float64 sums of 4 rows at a time, never 50
    assert not [shape for shape, _ in seen.made if shape == (50, 3000)]  # no copy of the logits' size
    with pytest.raises(ValueError, match=r"logits \[M, V\] and draws \[M\]"):
        sample(logits, draws[:3])


def test_one_process_takes_the_whole_mean():
    assert [share.item() for share in token_shares(torch.tensor(7), torch.tensor(0))] == [1.0, 1.0]
