"""Build the small model folder behind the single-text `disentangled explain` pictures of docs/explain.md, and draw them.

    python docs/explain_example.py [--folder DIR] [--steps N]    # from the repository root

A DeBERTa-v3-shaped model (hidden 64, 2 layers, 4 heads, 256 log buckets, shared keys, 2 terms) with a
SentencePiece tokenizer trained on the tests' corpus, trained for a few hundred masked-LM steps so that its
position terms learn something (a masked piece of a word is predicted from its neighbours), saved as a model
folder, then explained with the command; the figures go to docs/explain/. Seeded: the same pictures each run.
Until `disentangled demo` writes a converted model folder, this stands in for it.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the SentencePiece fixture's corpus and trainer

from spm_fixture import corpus_lines, train_spm  # noqa: E402

from disentangled import DisentangledConfig, DisentangledForMaskedLM  # noqa: E402
from disentangled.cli import main  # noqa: E402
from disentangled.integrations.tokenization import tokenizer_from_spm  # noqa: E402

TEXT = "The quick brown fox sat on the mat by the river bank."


def build(folder: Path, steps: int, seed: int = 0) -> Path:
    """Train the tokenizer and the model (a few minutes on two CPU cores) and save both in `folder`."""
    torch.manual_seed(seed)
    tokenizer = tokenizer_from_spm(train_spm(folder / "_spm"))
    config = DisentangledConfig(  # deberta-v3's attention fields, small
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        legacy=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = DisentangledForMaskedLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    lines = corpus_lines()
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    for step in range(steps):
        batch = tokenizer(rng.sample(lines, 32), return_tensors="pt", padding=True, truncation=True, max_length=48)
        input_ids = batch["input_ids"]
        maskable = torch.tensor([[token not in special for token in row] for row in input_ids.tolist()])
        masked = maskable & (torch.rand(input_ids.shape) < 0.15)
        labels = torch.where(masked, input_ids, -100)
        inputs = torch.where(masked, tokenizer.mask_token_id, input_ids)
        loss = model(input_ids=inputs, attention_mask=batch["attention_mask"], labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step}: masked-LM loss {loss.item():.3f}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--folder", type=Path, default=None, help="model folder: built there unless it exists (default: temporary)"
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "explain")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.folder or Path(temporary)
        if not (folder / "config.json").is_file():  # an existing folder is reused as it is
            build(folder, args.steps)
        return main(["explain", str(folder), TEXT, "--layer", "0", "--head", "0", "--out", str(args.out)])


if __name__ == "__main__":
    sys.exit(run())
