"""Tiny models with a SentencePiece tokenizer, saved as folders the ecosystem tests load like Hub checkpoints.

`TINY` is the tests' model size (hidden 32, 2 layers, 4 heads, no dropout): every test file builds its config from it
(or from `TINY_SIZES` where dropout stays on), overriding only what it tests. `save_tiny` writes a model in our format (loaded through the installed package); `export_remote_code` turns such a
folder into a flat remote-code folder (config.json `auto_map` + the bundled code) that loads with
`trust_remote_code=True`.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import torch
from spm_fixture import train_spm

from disentangled import DisentangledConfig
from disentangled.conversion.bundle import auto_map, write_bundle
from disentangled.integrations.tokenization import SPM_TOKENIZER_CONFIG, tokenizer_from_spm

TINY_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
TINY = dict(TINY_SIZES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
TINY_CONFIG = dict(TINY, max_position_embeddings=256, position_buckets=32, max_relative_positions=128)


@functools.cache
def spm_model() -> Path:
    """One SentencePiece model per test session (DeBERTa-v3's special ids, the fixture's words)."""
    return train_spm(Path(tempfile.mkdtemp(prefix="spm-")))


def tokenizer():
    """A fresh DeBERTa-v2 tokenizer over `spm_model()`."""
    return tokenizer_from_spm(spm_model(), check_text="the quick brown fox sat on the mat")


def tiny_config(tokenizer, **overrides) -> DisentangledConfig:
    return DisentangledConfig(
        **{**TINY_CONFIG, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, **overrides}
    )


def save_tiny(folder: Path, model_class, tokenizer, seed: int = 0, **config) -> Path:
    """A seeded tiny `model_class` and the tokenizer, saved to `folder`; the tokenizer as DeBERTa-v3 ships it on the
    Hub (spm.model + tokenizer_config.json naming the class), which transformers 4.57 and 5 both load."""
    torch.manual_seed(seed)
    model = model_class(tiny_config(tokenizer, **config)).eval()
    model.save_pretrained(folder)
    (Path(folder) / "spm.model").write_bytes(spm_model().read_bytes())
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(SPM_TOKENIZER_CONFIG))
    return Path(folder)


def export_remote_code(folder: Path) -> Path:
    """Add the converter's remote-code bundle and `auto_map` to a saved folder."""
    write_bundle(folder)
    config_file = Path(folder) / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = auto_map()
    config_file.write_text(json.dumps(config, indent=2))
    return Path(folder)
