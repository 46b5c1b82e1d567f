"""Pretraining's random draws made a function of the sequence, and its losses made a function of the global batch,
so that a run on N processes computes what one process computes on the same batches.

Masking (which tokens, and what replaces them) and the generator's samples are drawn, for each sequence, from a
generator seeded by the run's seed, the optimizer step and the sequence's own tokens:

    seed(sequence) = blake2b(seed, step, stream, tokens of the sequence without its padding)

so a sequence is masked the same way whichever process holds it, whatever else is in its batch and however much
padding that batch adds. Two equal sequences in one step are masked alike; the same sequence at another step is not.
A generator's sample takes one of these draws per masked token (`sample`, an inverse transform over the softmax of
its logits, a chunk of rows at a time), so sampling holds no [masked tokens, vocabulary] copy of the logits.

A loss averaged over each process's tokens, then averaged over the processes (what DDP, FSDP and ZeRO do to the
gradients), weighs tokens by how many their process had. `token_shares` gives the factor that turns each process's
mean into its part of the mean over all tokens of the step:

    loss_p * share_p = (sum_p / n_p) * (n_p * P / sum_q n_q),   and  (1/P) sum_p (loss_p * share_p) = sum / n
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

_PADDING_DRAW = 1.0  # padded positions draw 1.0: never below a masking probability


def sequence_generator(tokens: Tensor, seed: int, step: int, stream: str) -> torch.Generator:
    """A CPU generator for one unpadded sequence; `stream` names the use, so that each use draws independently."""
    digest = hashlib.blake2b(f"{seed}/{step}/{stream}/".encode(), digest_size=8)
    digest.update(tokens.to(device="cpu", dtype=torch.int64).contiguous().numpy().tobytes())
    return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") & (2**63 - 1))


def _per_sequence(input_ids: Tensor, attention_mask: Tensor, seed: int, step: int, stream: str, draw, fill) -> Tensor:
    """[B, L]: `draw(n, generator)` at each row's n unpadded tokens, from its own sequence's generator; `fill` at
    padded positions."""
    draws = torch.full(input_ids.shape, fill)
    for row, (tokens, kept) in enumerate(zip(input_ids.cpu(), attention_mask.cpu().bool())):
        draws[row, kept] = draw(int(kept.sum()), sequence_generator(tokens[kept], seed, step, stream))
    return draws.to(input_ids.device)


def uniform(input_ids: Tensor, attention_mask: Tensor, seed: int, step: int, stream: str) -> Tensor:
    """[B, L] draws in [0, 1): each row's from its own sequence's generator, in order over its unpadded tokens."""

    def draw(count, generator):
        return torch.rand(count, generator=generator)

    return _per_sequence(input_ids, attention_mask, seed, step, stream, draw, _PADDING_DRAW)


def randint(high: int, input_ids: Tensor, attention_mask: Tensor, seed: int, step: int, stream: str) -> Tensor:
    """[B, L] integers in [0, high), drawn per sequence as `uniform` draws; 0 at padded positions."""

    def draw(count, generator):
        return torch.randint(high, (count,), generator=generator)

    return _per_sequence(input_ids, attention_mask, seed, step, stream, draw, 0)


SAMPLE_CHUNK_ELEMENTS = 2**22  # entries of [rows, V] that `sample` takes at once: 48 MiB of float32 + float64


def sample(logits: Tensor, draws: Tensor, chunk_elements: int = SAMPLE_CHUNK_ELEMENTS) -> Tensor:
    """One index per row of `logits` [M, V], distributed as `torch.multinomial(softmax(logits), 1)`: the inverse
    transform of `draws` [M] in [0, 1), the index i with cdf[i - 1] < u * cdf[-1] <= cdf[i], where

        p = softmax(logits) in float32,   cdf = cumsum(p) in float64,   one row at a time per chunk of rows.

    Only a chunk of rows (about `chunk_elements` entries) is ever held as probabilities and sums, never [M, V]: at
    DeBERTa-v3's vocabulary (V = 128,100) and 64 x 512 tokens (M ~ 4,900 masked) the whole float64 copy and its sums
    were 10 GB. Each row's arithmetic is the same as the whole batch's, so the draws do not depend on the chunking.
    Logits in float16 / bfloat16 are widened per chunk: the sums are float64 whatever their dtype.

    Why not a race (argmax of logits + Gumbel noise, or of p / Exp(1) noise, as `torch.multinomial` draws one
    sample): it needs V random numbers per row instead of one, and in float32 they are too coarse at this vocabulary
    (a float32 uniform's largest value below 1 is 1 - 2^-24, so Gumbel noise stops at 16.6, which the largest of
    128,100 draws would pass in 0.8% of the rows, and the two largest uniforms tie in 0.5%); in float64 the noise is
    a [rows, V] float64 chunk, as the sums here are. The inverse transform draws one number per row, from the
    sequence's own stream, and keeps the draws this function gave when it took the probabilities [M, V] whole."""
    if logits.dim() != 2 or draws.shape != logits.shape[:1]:
        raise ValueError(f"sample takes logits [M, V] and draws [M], got {list(logits.shape)} and {list(draws.shape)}")
    vocabulary = logits.shape[-1]
    rows = max(1, chunk_elements // max(vocabulary, 1))
    picked = torch.empty(len(logits), dtype=torch.long, device=logits.device)
    for start in range(0, len(logits), rows):
        chunk = slice(start, start + rows)
        cdf = torch.softmax(logits[chunk].float(), dim=-1).double().cumsum_(-1)  # [rows, V]
        target = (draws[chunk].double() * cdf[:, -1]).unsqueeze(-1)  # [rows, 1]
        picked[chunk] = torch.searchsorted(cdf, target).squeeze(-1)
    return picked.clamp_(max=vocabulary - 1)


def token_shares(*counts: Tensor) -> list[Tensor]:
    """For each count of this process's tokens, n_p * P / (sum over processes of n_q): 1 on one process. One
    all-reduce for all counts; every process must call it (it is called in the objective's forward)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [torch.ones((), device=count.device) for count in counts]
    world = torch.distributed.get_world_size()
    mine = torch.stack([count.detach().double() for count in counts])
    total = mine.clone()
    torch.distributed.all_reduce(total)
    shares = (mine * world / total.clamp(min=1)).float()
    return list(shares.unbind())
