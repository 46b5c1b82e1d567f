"""The heads a conversion can produce and what the checks compare against: one home for the names `convert`,
`export`, `commands` and the model card all read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = 1e-4  # float32: max |ours - transformers| <= TOLERANCE * max(1, max |transformers|), per output


@dataclass(frozen=True)
class Head:
    suffix: str  # class name after "Disentangled" / "DebertaV2" / "Deberta"
    auto_class: str
    pipeline_tag: str | None


TASKS = {
    "base": Head("Model", "AutoModel", "feature-extraction"),
    "masked-lm": Head("ForMaskedLM", "AutoModelForMaskedLM", "fill-mask"),
    "sequence-classification": Head(
        "ForSequenceClassification", "AutoModelForSequenceClassification", "text-classification"
    ),
    "token-classification": Head("ForTokenClassification", "AutoModelForTokenClassification", "token-classification"),
    "question-answering": Head("ForQuestionAnswering", "AutoModelForQuestionAnswering", "question-answering"),
    "multiple-choice": Head("ForMultipleChoice", "AutoModelForMultipleChoice", None),
    "replaced-token-detection": Head("ForReplacedTokenDetection", "AutoModelForPreTraining", None),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --dtype
POSITION_TABLE = "deberta.embeddings.position_embeddings.weight"  # the absolute table (v2 inputs, the decoder)
TRANSFORMERS_PREFIX = {"deberta": "Deberta", "deberta-v2": "DebertaV2"}
