"""`disentangled demo`: build a small DeBERTa-v3-style model, run it on a batch and show what it computed."""

from __future__ import annotations

import argparse

import torch

from .configuration import DisentangledConfig
from .modeling import DisentangledForMaskedLM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights and the batch")


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    config = DisentangledConfig(  # deberta-v3-xsmall's attention, 2 layers, a small vocabulary
        vocab_size=1000, hidden_size=384, num_hidden_layers=2, num_attention_heads=6, intermediate_size=1536
    )
    model = DisentangledForMaskedLM(config).eval()
    lengths = [12, 7]
    input_ids = torch.randint(1, config.vocab_size, (len(lengths), max(lengths)))
    attention_mask = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
    print(
        f"model: {sum(p.numel() for p in model.parameters()):,} parameters, terms {config.pos_att_type}, "
        f"{config.position_buckets} position buckets, attention {model.config._attn_implementation}"
    )
    print(f"batch: {len(lengths)} sequences of lengths {lengths} (padded to {max(lengths)})")
    print(
        f"MLM logits {tuple(out.logits.shape)}; top token per position of sequence 0: "
        f"{out.logits[0, : lengths[0]].argmax(-1).tolist()}"
    )
    probs = out.attentions[-1][0, 0, : lengths[0], : lengths[0]]
    print(
        f"last layer, head 0: attention rows sum to {probs.sum(-1).mean():.4f}, "
        f"mean attention to padding {out.attentions[-1][1, :, : lengths[1], lengths[1] :].sum(-1).mean():.2e}"
    )
    return 0
