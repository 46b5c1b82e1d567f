"""The SentencePiece tokenizers tests build: real pieces for ordinary words, DeBERTa-v3's special ids."""

from __future__ import annotations

import json

import pytest
import transformers
from spm_fixture import SPM_VOCAB_SIZE, train_spm, write_deberta_v3_tokenizer_files

from disentangled.integrations.tokenization import DEBERTA_V3_SPECIAL_IDS, tokenizer_from_spm


def test_tokenizer_from_spm_gets_real_pieces_and_v3_special_ids(tmp_path):
    tokenizer = tokenizer_from_spm(train_spm(tmp_path), check_text="The quick brown fox sat on the mat.")
    for token, expected_id in DEBERTA_V3_SPECIAL_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == expected_id
    assert tokenizer.mask_token_id == SPM_VOCAB_SIZE  # appended after the last piece, as 128000 in deberta-v3
    encoded = tokenizer("the cat sat", "on the mat")
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"])
    assert tokens[0] == "[CLS]" and tokens.count("[SEP]") == 2 and "[UNK]" not in tokens
    assert encoded["token_type_ids"][-1] == 1


def test_hub_layout_loads_with_auto_tokenizer(tmp_path):
    write_deberta_v3_tokenizer_files(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deberta-v2"}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer("Paris is the capital of France.", add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids and len(ids) >= 6


def test_bare_special_token_vocabulary_is_rejected(tmp_path):
    from disentangled.integrations.tokenization import check_tokenizer

    with pytest.raises(ValueError, match="special tokens"):
        check_tokenizer(transformers.DebertaV2Tokenizer())
