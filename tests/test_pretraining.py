"""The pretraining objectives in-process: embedding sharing's gradients against standalone references, RTD labels,
the masking collator, the logged metrics, and the merged export."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tiny_models import TINY_CONFIG, tokenizer
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.modeling_outputs import MaskedLMOutput

from disentangled import DisentangledConfig, DisentangledForMaskedLM
from disentangled.modeling import DisentangledForReplacedTokenDetection
from disentangled.pretraining import (
    MaskingCollator,
    PaddingCollator,
    PretrainingMetrics,
    ReplacedTokenDetectionPretraining,
    SharedEmbedding,
    generator_config,
    roc_auc,
)

V3 = dict(position_buckets=32, legacy=False, pos_att_type="p2c|c2p", share_att_key=True, relative_attention=True)
RTD_WEIGHT = 10.0


def configs(position_biased_input: bool = False) -> tuple[DisentangledConfig, DisentangledConfig]:
    tok = tokenizer()
    config = DisentangledConfig(
        **{**TINY_CONFIG, **V3, "vocab_size": len(tok), "position_biased_input": position_biased_input}
    )
    return config, generator_config(config, num_layers=1)


def make_module(sharing: str, position_biased_input: bool = False, seed: int = 0) -> ReplacedTokenDetectionPretraining:
    config, gen_config = configs(position_biased_input)
    torch.manual_seed(seed)
    generator, discriminator = DisentangledForMaskedLM(gen_config), DisentangledForReplacedTokenDetection(config)
    module = ReplacedTokenDetectionPretraining(generator, discriminator, sharing, RTD_WEIGHT)
    for parameter in module.parameters():  # a trained-looking delta, so that E_D != E_G under gdes
        if parameter is getattr(module.discriminator.deberta.embeddings.word_embeddings, "delta", None):
            parameter.data.normal_(0, 0.02)
    return module


def batch(seed: int = 0) -> dict:
    tok = tokenizer()
    torch.manual_seed(seed)
    texts = ["the quick brown fox sat on the mat", "a dog ran under the tree by the river bank today"]
    encoded = [{"input_ids": ids} for ids in tok(texts)["input_ids"]]
    return MaskingCollator(tok, objective="rtd", mlm_probability=0.4)(encoded)


def grads(loss: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    found = torch.autograd.grad(loss, list(tensors.values()), allow_unused=True)
    return {name: torch.zeros_like(t) if g is None else g for (name, t), g in zip(tensors.items(), found)}


TABLES = ["word_embeddings", "position_embeddings"]


@pytest.mark.parametrize(
    "sharing,position_biased_input",
    [("gdes", False), ("gdes", True), ("es", False), ("es", True), ("none", False)],
    ids=lambda v: str(v),
)
def test_which_tables_each_loss_reaches(sharing, position_biased_input):
    """Gradients of L = L_MLM + w * L_RTD against standalone generator / discriminator copies (merged tables)."""
    module = make_module(sharing, position_biased_input)
    inputs = batch()
    torch.manual_seed(1)
    out = module(**inputs)

    gen_embeddings = module.generator.deberta.embeddings
    disc_embeddings = module.discriminator.deberta.embeddings
    tables = [name for name in TABLES if getattr(disc_embeddings, name) is not None]
    assert tables == (TABLES if position_biased_input else TABLES[:1])
    gen_tables = {name: getattr(gen_embeddings, name).weight for name in tables}
    if sharing == "gdes":
        disc_tables = {name: getattr(disc_embeddings, name).delta for name in tables}
    elif sharing == "none":
        disc_tables = {name: getattr(disc_embeddings, name).weight for name in tables}
    else:
        disc_tables = {}
    got_gen = grads(out.loss, gen_tables)
    got_disc = grads(out.loss, disc_tables) if disc_tables else {}

    # References: a standalone generator and a standalone discriminator with E_D = E_G (+ E_delta) merged, on the
    # very inputs the module used (the sample is in the output).
    generator = copy.deepcopy(module.generator)
    discriminator = module.export_discriminator().train()
    gen_loss = generator(**inputs).loss
    disc_loss = discriminator(
        input_ids=out.discriminator_input_ids,
        attention_mask=inputs["attention_mask"],
        labels=out.discriminator_labels,
    ).loss
    torch.testing.assert_close(gen_loss, out.generator_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(disc_loss, out.discriminator_loss, rtol=1e-5, atol=1e-6)
    ref_gen = grads(gen_loss, {name: getattr(generator.deberta.embeddings, name).weight for name in tables})
    ref_disc = grads(disc_loss, {name: getattr(discriminator.deberta.embeddings, name).weight for name in tables})

    for name in tables:
        assert ref_gen[name].abs().sum() > 0 and ref_disc[name].abs().sum() > 0
        if sharing == "es":  # one table: both losses
            expected_gen = ref_gen[name] + RTD_WEIGHT * ref_disc[name]
        else:  # gdes: sg(E_G) stops L_RTD; none: separate tables
            expected_gen = ref_gen[name]
        torch.testing.assert_close(got_gen[name], expected_gen, rtol=1e-4, atol=1e-7)
        if sharing in ("gdes", "none"):  # E_delta (or E_D) gets w * dL_RTD/dE_D and nothing from L_MLM
            torch.testing.assert_close(got_disc[name], RTD_WEIGHT * ref_disc[name], rtol=1e-4, atol=1e-7)


def test_shared_tables_are_saved_once_and_exported_merged():
    module = make_module("gdes")
    keys = list(module.state_dict())
    assert "discriminator.deberta.embeddings.word_embeddings.delta" in keys
    assert "discriminator.deberta.embeddings.word_embeddings.weight" not in keys
    shared = module.discriminator.deberta.embeddings.word_embeddings
    assert isinstance(shared, SharedEmbedding)
    exported = module.export_discriminator()
    expected = module.generator.deberta.embeddings.word_embeddings.weight + shared.delta
    torch.testing.assert_close(exported.deberta.embeddings.word_embeddings.weight, expected, rtol=0, atol=0)
    assert type(exported.deberta.embeddings.word_embeddings) is torch.nn.Embedding
    inputs = batch()
    module.eval()
    torch.testing.assert_close(
        exported(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits,
        module.discriminator(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits,
    )
    es = make_module("es")
    assert not any("discriminator.deberta.embeddings.word_embeddings" in key for key in es.state_dict())


def test_a_sample_equal_to_the_original_is_labelled_original():
    """The generator is replaced by one that predicts the original at even masked positions and token 7 (never the
    original there) at odd ones: labels are 0 / 1 accordingly, 0 at unmasked tokens, -100 at padding."""
    module = make_module("none")
    inputs = batch()
    labels = inputs["labels"]
    masked = labels != -100
    assert masked.sum() >= 4
    order = masked.flatten().cumsum(0).view_as(masked)  # 1, 2, 3 ... over the masked positions
    wrong = masked & (order % 2 == 0) & (labels != 7)
    vocab = module.generator.config.vocab_size

    def certain_generator(input_ids, attention_mask=None, token_type_ids=None, labels=None, sparse_prediction=False):
        assert sparse_prediction  # the objective asks for logits at the masked tokens only
        target = torch.where(wrong, 7, torch.where(masked, labels, input_ids))[masked]
        logits = torch.full((len(target), vocab), -1e4)
        logits.scatter_(-1, target.unsqueeze(-1), 1e4)  # sampling at temperature 1 returns the target
        return MaskedLMOutput(loss=logits.sum() * 0, logits=logits)

    module.generator.forward = certain_generator
    out = module(**inputs)
    expected = wrong.long().masked_fill(inputs["attention_mask"] == 0, -100)
    assert torch.equal(out.discriminator_labels, expected)
    assert (inputs["attention_mask"] == 0).any()  # padding was there to ignore
    original = torch.where(masked, labels, inputs["input_ids"])
    assert torch.equal(out.discriminator_input_ids, torch.where(wrong, 7, original))


class Allocations(TorchDispatchMode):
    """The shape of every tensor an operation returns while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [
            tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out]) if torch.is_tensor(t)
        ]
        return out


@pytest.mark.parametrize("objective", ["rtd", "mlm"])
def test_a_step_makes_no_tensor_of_every_token_by_the_vocabulary(objective):
    """Forward and backward of a masked batch: the generator's head runs at the M masked tokens only, so no
    [B, L, V] or [B * L, V] tensor is made (at DeBERTa-v3's vocabulary that is 2 GiB at 8 x 512), the logits are
    [M, V], and the logged accuracy counts the masked tokens."""
    from disentangled.pretraining import MaskedLMPretraining

    tok = tokenizer()
    masking = MaskingCollator(tok, objective=objective, seed=0)
    texts = ["the quick brown fox sat on the mat under a tree by the river", "a dog ran", "paris is the capital"] * 4
    padded = PaddingCollator(tok)([{"input_ids": ids} for ids in tok(texts)["input_ids"]])
    if objective == "rtd":
        module = make_module("gdes")
        module.masking = masking
    else:
        config, _ = configs()
        module = MaskedLMPretraining(DisentangledForMaskedLM(config), masking)
    vocab, (rows, length) = len(tok), padded["input_ids"].shape
    _, labels = masking.mask(padded["input_ids"], padded["attention_mask"])
    masked = int((labels != -100).sum())
    assert 0 < masked < rows * length
    with Allocations() as seen:
        out = module(**padded)
        out.loss.backward()
    assert out.generator_logits.shape == (masked, vocab)
    by_vocabulary = {shape for shape in seen.shapes if len(shape) > 1 and shape[-1] == vocab}  # E^T [hidden, V] too
    assert (masked, vocab) in by_vocabulary
    assert all(math.prod(shape[:-1]) < rows * length for shape in by_vocabulary), sorted(by_vocabulary)
    accuracy = module.metrics.compute()["generator_accuracy"]
    expected = (out.generator_logits.argmax(-1) == labels[labels != -100]).float().mean().item()
    assert accuracy == round(expected, 4)


def test_a_sequence_gets_the_same_samples_in_any_batch_and_padding():
    """With per-sequence draws (masking with a seed), the generator's samples for a sequence are the same alone,
    padded, and in a batch with others: the draw of each masked token comes from its own sequence's stream."""
    tok = tokenizer()
    module = make_module("gdes").eval()  # no dropout: the generator's logits are the sequence's own
    module.masking = MaskingCollator(tok, objective="rtd", seed=3, mlm_probability=0.5)
    texts = ["the quick brown fox sat on the mat under a tree", "a dog ran by the river bank today", "paris"]
    rows = tok(texts)["input_ids"]
    together = module(**PaddingCollator(tok)([{"input_ids": ids} for ids in rows]))
    replaced = 0
    for at, ids in enumerate(rows):
        longer = rows[0] + rows[1]  # another sequence in its batch, which pads this one
        alone = module(**PaddingCollator(tok)([{"input_ids": ids}, {"input_ids": longer}]))
        assert torch.equal(
            alone.discriminator_input_ids[0, : len(ids)], together.discriminator_input_ids[at, : len(ids)]
        )
        replaced += int(alone.discriminator_labels[0, : len(ids)].sum())
    assert replaced > 0  # some samples differ from the original: the comparison saw samples, not copies
    module.masking.step = 1
    assert not torch.equal(
        module(**PaddingCollator(tok)([{"input_ids": ids} for ids in rows])).discriminator_input_ids,
        together.discriminator_input_ids,
    )


def test_sampling_carries_no_gradient_and_sharing_needs_equal_widths():
    config, gen_config = configs()
    wide = copy.deepcopy(gen_config)
    wide.hidden_size, wide.intermediate_size = 64, 128
    for sharing in ("gdes", "es"):
        with pytest.raises(ValueError, match="wider than the discriminator"):
            ReplacedTokenDetectionPretraining(
                DisentangledForMaskedLM(wide), DisentangledForReplacedTokenDetection(config), sharing
            )
    ReplacedTokenDetectionPretraining(
        DisentangledForMaskedLM(wide), DisentangledForReplacedTokenDetection(config), "none"
    )
    module = make_module("gdes")
    out = module(**batch())
    assert not out.discriminator_input_ids.requires_grad and out.loss.requires_grad


def test_masking_collator_rates_special_tokens_and_whole_words():
    tok = tokenizer()
    torch.manual_seed(0)
    lines = ["the quick brown fox sat on the mat under a tree by the river"] * 400
    examples = [{"input_ids": ids} for ids in tok(lines)["input_ids"]]
    special = torch.tensor(tok.all_special_ids)

    mlm = MaskingCollator(tok, objective="mlm")(examples)
    picked = mlm["labels"] != -100
    original = torch.where(picked, mlm["labels"], mlm["input_ids"])
    assert not torch.isin(original[picked], special).any()
    content = ~torch.isin(original, special)
    assert abs(picked.sum() / content.sum() - 0.15) < 0.01
    as_mask = (mlm["input_ids"] == tok.mask_token_id) & picked
    unchanged = (mlm["input_ids"] == original) & picked
    assert abs(as_mask.sum() / picked.sum() - 0.8) < 0.03
    assert abs(unchanged.sum() / picked.sum() - 0.1) < 0.03  # (a random token may equal the original: rarely)
    assert torch.equal(mlm["input_ids"][~picked], original[~picked])

    rtd = MaskingCollator(tok, objective="rtd")(examples)
    picked = rtd["labels"] != -100
    assert torch.equal(rtd["input_ids"][picked], torch.full_like(rtd["input_ids"][picked], tok.mask_token_id))

    whole = MaskingCollator(tok, objective="mlm", whole_word_mask=True, mlm_probability=0.3)(examples)
    picked = whole["labels"] != -100
    pieces = tok.convert_ids_to_tokens(examples[0]["input_ids"])
    starts = torch.tensor([piece.startswith("▁") or piece in tok.all_special_tokens for piece in pieces])
    word = starts.long().cumsum(0)
    assert (~starts).any()  # some word has several pieces
    for row in picked:  # each word is picked whole or not at all
        for index in word.unique():
            assert row[word == index].all() or not row[word == index].any()
    assert abs(picked.float().mean() - 0.3 * content[0].float().mean()) < 0.05


def test_roc_auc_matches_the_pairwise_definition():
    torch.manual_seed(0)
    logits = torch.randn(4000)
    labels = (torch.rand(4000) < torch.sigmoid(2 * logits)).long()
    metrics = PretrainingMetrics()
    metrics.update_discriminator(torch.tensor(0.5), logits.view(40, 100), labels.view(40, 100))
    result = metrics.compute()
    positive, negative = logits[labels == 1], logits[labels == 0]
    pairwise = ((positive[:, None] > negative[None, :]).double().mean()).item()
    assert result["discriminator_auc"] == pytest.approx(pairwise, abs=1e-4)
    predicted = logits > 0
    true_positive = (predicted & (labels == 1)).sum().item()
    assert result["discriminator_precision"] == pytest.approx(true_positive / predicted.sum().item(), abs=1e-4)
    assert result["discriminator_recall"] == pytest.approx(true_positive / (labels == 1).sum().item(), abs=1e-4)
    assert metrics.compute() == {}  # reading resets


def test_roc_auc_is_exact_with_ties():
    # positives 0.9, 0.5, 0.5; negatives 0.5, 0.1: of the 6 pairs, 0.9 beats both (2), each 0.5 ties one 0.5 (0.5)
    # and beats 0.1 (1): AUC = (2 + 1.5 + 1.5) / 6
    scores = torch.tensor([0.9, 0.5, 0.5, 0.5, 0.1])
    labels = torch.tensor([1, 1, 0, 1, 0])
    assert roc_auc(scores, labels) == pytest.approx(5 / 6, abs=1e-12)
    assert roc_auc(torch.zeros(4), torch.tensor([1, 0, 1, 0])) == 0.5  # all tied: exactly a guess
    assert roc_auc(torch.tensor([3.0, 1.0]), torch.tensor([0, 1])) == 0.0
    assert roc_auc(torch.ones(3), torch.ones(3)).__ne__(roc_auc(torch.ones(3), torch.ones(3)))  # one class: NaN
    # logits that differ by less than a 1/1000 bin of probability are still ranked
    logits = torch.tensor([8.0, 8.001, 8.002, 8.003])
    assert roc_auc(logits, torch.tensor([0, 0, 1, 1])) == 1.0
    # the running metrics give the same exact AUC, summed over steps
    metrics = PretrainingMetrics()
    metrics.update_discriminator(torch.tensor(0.1), logits[:2].view(1, 2), torch.tensor([[0, 0]]))
    metrics.update_discriminator(torch.tensor(0.1), logits[2:].view(1, 2), torch.tensor([[1, -100]]))
    assert metrics.compute()["discriminator_auc"] == 1.0


def test_gdes_starts_with_the_generators_table_and_rtd_updates_only_e_delta():
    config, gen_config = configs()
    torch.manual_seed(0)
    generator, discriminator = DisentangledForMaskedLM(gen_config), DisentangledForReplacedTokenDetection(config)
    own_table = discriminator.deberta.embeddings.word_embeddings.weight.detach().clone()
    module = ReplacedTokenDetectionPretraining(generator, discriminator, "gdes", RTD_WEIGHT)
    shared = module.discriminator.deberta.embeddings.word_embeddings
    gen_table = module.generator.deberta.embeddings.word_embeddings.weight
    assert not torch.equal(own_table, gen_table)  # the two models were drawn with different tables
    torch.testing.assert_close(shared.weight, gen_table, rtol=0, atol=0)  # E_D = E_G at step 0
    assert shared.delta.abs().max() == 0
    # one optimizer step on the discriminator's loss alone: of the tables, only E_delta moves; no generator weight does
    generator_before = {name: p.detach().clone() for name, p in module.generator.named_parameters()}
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    torch.manual_seed(1)
    out = module(**batch())
    loss = (
        RTD_WEIGHT
        * module.discriminator(
            input_ids=out.discriminator_input_ids,
            attention_mask=batch()["attention_mask"],
            labels=out.discriminator_labels,
        ).loss
    )
    loss.backward()
    assert all(p.grad is None for p in module.generator.parameters())
    optimizer.step()
    for name, p in module.generator.named_parameters():
        torch.testing.assert_close(p.detach(), generator_before[name], rtol=0, atol=0)
    assert shared.delta.abs().max() > 0
    torch.testing.assert_close(shared.weight, gen_table.detach() + shared.delta, rtol=0, atol=0)
    # --init-from: a discriminator with its own table keeps it (E_delta = E_D - E_G)
    torch.manual_seed(0)
    generator, discriminator = DisentangledForMaskedLM(gen_config), DisentangledForReplacedTokenDetection(config)
    kept = ReplacedTokenDetectionPretraining(generator, discriminator, "gdes", keep_discriminator_tables=True)
    torch.testing.assert_close(kept.discriminator.deberta.embeddings.word_embeddings.weight, own_table)


def test_data_files_of_each_kind_give_the_same_sequences(tmp_path):
    from disentangled.demo.data import write_rows
    from disentangled.pretraining.data import check_data_files, load_texts, tokenize_and_group

    documents = ["the cat sat on the mat. a dog ran", "the quick brown fox", "paris is the capital of france"]
    (tmp_path / "lines.txt").write_text("\n".join(documents) + "\n")
    (tmp_path / "paragraphs.txt").write_text("\n\n".join(doc.replace(". ", ".\n") for doc in documents) + "\n")
    write_rows([{"body": doc, "id": str(i)} for i, doc in enumerate(documents)], tmp_path / "rows.csv")
    write_rows([{"body": doc} for doc in documents], tmp_path / "rows.jsonl")
    tok = tokenizer()
    pieces = [tok(doc, add_special_tokens=False)["input_ids"] for doc in documents]
    stream = [piece for doc in pieces for piece in (*doc, tok.sep_token_id)]
    expected = [
        [tok.cls_token_id, *stream[start : start + 6], tok.sep_token_id] for start in range(0, len(stream) - 5, 6)
    ]
    for name in ("lines.txt", "paragraphs.txt", "rows.csv", "rows.jsonl"):
        texts = load_texts(check_data_files([str(tmp_path / name)], "--train-file"), "body", "--train-file")
        assert len(texts) == 3, name
        got = tokenize_and_group(texts, tok, 8)["input_ids"]
        if name == "paragraphs.txt":  # a newline inside a document tokenizes as a space
            assert [len(sequence) for sequence in got] == [len(sequence) for sequence in expected]
        else:
            assert got == expected, name
    with pytest.raises(ValueError, match="no column 'text'"):
        load_texts([tmp_path / "rows.csv"], "text", "--train-file")


def test_a_discriminator_at_chance_after_warm_up_is_reported(tmp_path, caplog):
    from transformers import TrainingArguments

    from disentangled.pretraining import PretrainingTrainer

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=100, warmup_steps=20, report_to="none", use_cpu=True)
    trainer = PretrainingTrainer(model=make_module("none"), args=args)
    trainer.state.max_steps = 100
    for step, auc, warned in ((10, 0.5, False), (50, 0.51, False), (101, 0.51, True), (101, 0.8, False)):
        caplog.clear()
        trainer.state.global_step = step
        with caplog.at_level("WARNING", logger="disentangled.pretraining"):
            trainer._check_discriminator(auc, "")
        assert ("near 0.5 after warm-up" in caplog.text) == warned, (step, auc)
    # no warm-up at all: still nothing before a fifth of the run and 100 steps (the old check fired at step 5)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1000, report_to="none", use_cpu=True)
    trainer = PretrainingTrainer(model=make_module("none"), args=args)
    trainer.state.max_steps = 1000
    for step, warned in ((5, False), (150, False), (201, True)):
        caplog.clear()
        trainer.state.global_step = step
        with caplog.at_level("WARNING", logger="disentangled.pretraining"):
            trainer._check_discriminator(0.5, "")
        assert ("near 0.5 after warm-up" in caplog.text) == warned, step
