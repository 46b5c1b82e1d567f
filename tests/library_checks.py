"""sentence-transformers checks shared by the in-package test and the remote-code run (see pipeline_checks.py):
CrossEncoder scores and SentenceTransformer embeddings against a direct forward pass of the same model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from sentence_transformers import CrossEncoder, SentenceTransformer

PAIRS = [
    ("where is the capital of france", "paris is the capital of france"),
    ("where is the capital of france", "the dog sat on the mat"),
    ("which river", "the city is on a river"),
]


def check_cross_encoder(folder: Path, trust_remote_code: bool) -> None:
    """A reranker: one logit per (query, passage) pair, through a sigmoid."""
    encoder = CrossEncoder(str(folder), trust_remote_code=trust_remote_code, device="cpu")
    module = type(encoder.model).__module__
    assert module.startswith("transformers_modules" if trust_remote_code else "disentangled"), module
    scores = encoder.predict(PAIRS, convert_to_tensor=True)

    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=trust_remote_code)
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with torch.no_grad():
        logits = model(**tok([q for q, _ in PAIRS], [p for _, p in PAIRS], padding=True, return_tensors="pt")).logits
    torch.testing.assert_close(scores.float(), logits[:, 0].sigmoid(), rtol=1e-4, atol=1e-5)

    query, passages = PAIRS[0][0], [p for _, p in PAIRS]
    with torch.no_grad():
        logits = model(**tok([query] * len(passages), passages, padding=True, return_tensors="pt")).logits
    ranked = encoder.rank(query, passages)
    assert [r["corpus_id"] for r in ranked] == logits[:, 0].argsort(descending=True).tolist()


def check_sentence_transformer(folder: Path, trust_remote_code: bool) -> None:
    """Embeddings: the mean of the last hidden states over the real tokens; pairs scored by cosine."""
    encoder = SentenceTransformer(str(folder), trust_remote_code=trust_remote_code, device="cpu")
    first = encoder[0].auto_model
    assert type(first).__module__.startswith("transformers_modules" if trust_remote_code else "disentangled")
    texts = [q for q, _ in PAIRS] + [p for _, p in PAIRS]
    embeddings = encoder.encode(texts, convert_to_tensor=True)

    model = transformers.AutoModel.from_pretrained(folder, trust_remote_code=trust_remote_code)
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    encoded = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    expected = (hidden * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(embeddings, expected, rtol=1e-4, atol=1e-5)

    similarity = encoder.similarity(embeddings[:3], embeddings[3:]).diagonal()
    cosine = torch.nn.functional.cosine_similarity(expected[:3], expected[3:])
    assert similarity.tolist() == pytest.approx(cosine.tolist(), rel=1e-4, abs=1e-5)


def main(folders_json: str) -> None:
    sys.modules["disentangled"] = None  # as on a machine without the package
    folders = json.loads(folders_json)
    check_cross_encoder(Path(folders["reranker"]), trust_remote_code=True)
    print("check_cross_encoder: ok")
    check_sentence_transformer(Path(folders["base"]), trust_remote_code=True)
    print("check_sentence_transformer: ok")


if __name__ == "__main__":
    main(*sys.argv[1:])
