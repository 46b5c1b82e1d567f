"""Extractive question answering with a `...ForQuestionAnswering` model: the answers transformers 4.57's
`question-answering` pipeline gives, for transformers 5, which no longer ships that pipeline.

A long context is cut into windows of at most `max_seq_len` tokens that overlap by `doc_stride` tokens, each
window holding the whole question. In each window, start and end logits are masked outside the context (question,
special tokens and padding; [CLS] stays, as the "no answer" position), each goes through its own softmax, and a
span (s, e) scores

    P_start(s) * P_end(e),   s <= e < s + max_answer_len,

with [CLS] then excluded. A span is widened to whole words (`align_to_words`), and spans from different windows
that give the same text (case-insensitively) add their scores, as in the pipeline.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

MASKED_LOGIT = -10000.0  # the pipeline's value: masked positions keep a tiny, not zero, probability


def answer_question(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    question: str,
    context: str,
    *,
    top_k: int = 1,
    max_answer_len: int = 15,
    max_seq_len: int | None = None,
    doc_stride: int | None = None,
    max_question_len: int = 64,
    handle_impossible_answer: bool = False,
    align_to_words: bool = True,
) -> dict | list[dict]:
    """The best answer span(s) of `context` for `question`: `{"score", "start", "end", "answer"}` with
    `context[start:end] == answer`; a list when `top_k > 1`. Arguments mean what they mean in the pipeline."""
    if not question or not context:
        raise ValueError("question and context must be non-empty strings")
    if top_k < 1 or max_answer_len < 1:
        raise ValueError(f"top_k and max_answer_len must be >= 1, got {top_k} and {max_answer_len}")
    if not tokenizer.is_fast:
        raise ValueError("answer_question needs a fast tokenizer (it maps tokens to characters with its offsets)")
    if max_seq_len is None:
        max_seq_len = min(tokenizer.model_max_length, 384)
    if doc_stride is None:
        doc_stride = min(max_seq_len // 2, 128)
    if doc_stride > max_seq_len:
        raise ValueError(f"doc_stride ({doc_stride}) is larger than max_seq_len ({max_seq_len})")

    question_first = tokenizer.padding_side == "right"
    context_index = 1 if question_first else 0
    encoded = tokenizer(
        text=question if question_first else context,
        text_pair=context if question_first else question,
        truncation="only_second" if question_first else "only_first",
        max_length=max_seq_len,
        stride=doc_stride,
        padding=True,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        return_token_type_ids=True,
        return_tensors="pt",
    )
    inputs = {name: encoded[name].to(model.device) for name in tokenizer.model_input_names if name in encoded}
    with torch.no_grad():
        outputs = model(**inputs)
    start_logits = outputs.start_logits.float().cpu()
    end_logits = outputs.end_logits.float().cpu()

    # Some candidates disappear when aligned to words, or merge with others: look further than top_k.
    per_window = top_k * 2 + 10 if align_to_words else top_k
    answers: list[dict] = []
    null_score = 1_000_000.0
    for window in range(start_logits.shape[0]):
        sequence_ids = encoded.sequence_ids(window)
        allowed = torch.tensor([index == context_index for index in sequence_ids])  # [L]: context tokens
        allowed[encoded["input_ids"][window] == tokenizer.cls_token_id] = True
        allowed &= encoded["attention_mask"][window].bool()
        start = start_logits[window].masked_fill(~allowed, MASKED_LOGIT).softmax(-1)
        end = end_logits[window].masked_fill(~allowed, MASKED_LOGIT).softmax(-1)
        if handle_impossible_answer:
            null_score = min(null_score, (start[0] * end[0]).item())
        start[0] = end[0] = 0.0  # [CLS] is "no answer", never part of a span

        # [L, L]: P_start(s) * P_end(e) for s <= e < s + max_answer_len
        spans = torch.triu(torch.tril(start[:, None] * end[None, :], max_answer_len - 1))
        order = spans.flatten().argsort(descending=True, stable=True)[:per_window]
        length = spans.shape[1]
        for flat in order.tolist():
            s, e = divmod(flat, length)
            if not (allowed[s] and allowed[e]):
                continue
            score = spans[s, e].item()
            first, last = _char_span(encoded, window, s, e, context_index, align_to_words)
            text = context[first:last]
            same = next((answer for answer in answers if answer["answer"].lower() == text.lower()), None)
            if same is not None:
                same["score"] += score
            else:
                answers.append({"score": score, "start": first, "end": last, "answer": text})

    if handle_impossible_answer:
        answers.append({"score": null_score, "start": 0, "end": 0, "answer": ""})
    answers = sorted(answers, key=lambda answer: answer["score"], reverse=True)[:top_k]
    return answers[0] if len(answers) == 1 else answers


def _char_span(encoded, window: int, s: int, e: int, context_index: int, align_to_words: bool) -> tuple[int, int]:
    """Characters of the context that tokens s..e cover, widened to whole words when asked."""
    encoding = encoded.encodings[window]
    if align_to_words:
        start_word, end_word = encoding.token_to_word(s), encoding.token_to_word(e)
        if start_word is not None and end_word is not None:
            return (
                encoding.word_to_chars(start_word, sequence_index=context_index)[0],
                encoding.word_to_chars(end_word, sequence_index=context_index)[1],
            )
    return encoding.offsets[s][0], encoding.offsets[e][1]
