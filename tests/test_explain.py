"""`explain_attention` and `disentangled explain`: the terms add up to the model's own eager scores, the
statistics read valid pairs only, small cases check by hand, and the command writes figures and JSON."""

from __future__ import annotations

import json
import math
import re

import pytest
import tiny_models
import torch
from attention_capture import eager_scores
from deberta_shapes import V1_SHAPES, V2_SHAPES
from parity import inflate_weights, padded_batch
from spm_fixture import train_spm
from test_p2p import bucket

from disentangled import DisentangledConfig, DisentangledForMaskedLM, DisentangledModel
from disentangled.cli import main
from disentangled.explain import explain_attention
from disentangled.explain.terms import STATISTICS

SMALL = dict(tiny_models.TINY, vocab_size=128)
V3 = dict(V2_SHAPES["deberta-v3-xsmall"], **SMALL, position_buckets=8, max_relative_positions=32)
CONFIGS = {
    "v3": V3,
    "v3_c2p_only": dict(V3, pos_att_type="c2p"),
    "v2_separate_keys": dict(V3, share_att_key=False, position_biased_input=True),
    "v2_xlarge_conv": dict(V2_SHAPES["deberta-v2-xlarge"], **SMALL, position_buckets=8, max_relative_positions=32),
    "v1_clipped": dict(
        V1_SHAPES["deberta-base"], **SMALL, position_buckets=-1, max_relative_positions=6
    ),  # 20 tokens: clipped
    "p2p_separate_keys": dict(V3, share_att_key=False, pos_att_type="c2p|p2c|p2p"),
    "p2p_shared_key": dict(V3, pos_att_type="p2c|c2p|p2p"),
    "p2p_saturated": dict(V3, pos_att_type="c2p|p2c|p2p", position_buckets=4, max_relative_positions=6),  # clipped
    "no_relative_attention": dict(V3, relative_attention=False, position_biased_input=True),
}
LENGTHS = [20, 13]  # padded; 20 tokens reach the log buckets of position_buckets=8


def explained(fields: dict, lengths=LENGTHS, head=DisentangledForMaskedLM):
    model = head(DisentangledConfig(**fields))
    inflate_weights(model)
    batch = padded_batch(128, lengths)
    return model, batch, explain_attention(model, **batch)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_terms_add_up_to_the_scores_of_the_eager_attention(name):
    model, batch, explanation = explained(CONFIGS[name])
    model.train()  # explain_attention runs in eval mode and restores the mode it found
    explanation = explain_attention(model, **batch)
    assert model.training
    with torch.no_grad(), eager_scores() as captured:
        expected_probabilities = model.eval()(**batch, output_attentions=True).attentions
    assert len(captured) == len(explanation.layers) == model.config.num_hidden_layers
    keys = batch["attention_mask"][:, None, None, :].bool().expand_as(captured[0])  # pairs the model did not mask
    for layer, scores, probabilities in zip(explanation.layers, captured, expected_probabilities):
        assert all(term.dtype == torch.float32 for term in layer.terms.values())
        torch.testing.assert_close(layer.scores[keys], scores[keys], rtol=0, atol=1e-5)
        masked = layer.scores.masked_fill(~keys, torch.finfo(torch.float32).min)
        torch.testing.assert_close(masked.softmax(-1), probabilities, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.probabilities, probabilities, rtol=0, atol=0)
    expected_terms = ("c2c",) if name == "no_relative_attention" else ("c2c", *model.config.pos_att_type)
    assert set(explanation.term_names) == set(expected_terms)


def test_pair_mask_and_base_model():
    model = DisentangledModel(DisentangledConfig(**V3))
    inflate_weights(model)
    input_ids = padded_batch(128, [12, 12])["input_ids"]
    pairs = torch.rand(2, 12, 12) > 0.3
    pairs |= torch.eye(12, dtype=torch.bool)  # every query keeps a key
    explanation = explain_attention(model, input_ids=input_ids, attention_mask=pairs.long())
    assert torch.equal(explanation.valid_pairs, pairs)
    with torch.no_grad(), eager_scores() as captured:
        model.eval()(input_ids=input_ids, attention_mask=pairs.long(), output_attentions=True)
    for layer, scores in zip(explanation.layers, captured):
        allowed = pairs[:, None].expand_as(scores)
        torch.testing.assert_close(layer.scores[allowed], scores[allowed], rtol=0, atol=1e-5)


def test_statistics_read_valid_pairs_only():
    model, batch, explanation = explained(V3)
    # Other tokens under the padding: the masked pairs change, the statistics must not.
    other = dict(batch, input_ids=torch.where(batch["attention_mask"].bool(), batch["input_ids"], 77))
    again = explain_attention(model, **other)
    for first, second in zip(explanation.layers, again.layers):
        # Exactly: the same shapes sum in the same order, a masked key's probability is exp(finfo.min - max) = 0
        # and its value adds an exact zero, so the real tokens' hidden states and terms keep every bit.
        assert first.statistics == second.statistics
        assert torch.equal(first.distances, second.distances)
    # By hand, from each sequence cut to its real tokens.
    layer = explanation.layers[1]
    for name, term in layer.terms.items():
        pieces = [term[b, :, :n, :n] for b, n in enumerate(LENGTHS)]
        values = torch.cat([piece.flatten() for piece in pieces]).double()
        total = torch.cat([layer.scores[b, :, :n, :n].flatten() for b, n in enumerate(LENGTHS)]).double()
        stats = layer.statistics[name]
        assert stats["mean_abs"] == pytest.approx(values.abs().mean().item(), rel=1e-6)
        assert stats["std"] == pytest.approx(values.std(correction=0).item(), rel=1e-6)
        covariance = ((values - values.mean()) * (total - total.mean())).mean()
        assert stats["share"] == pytest.approx((covariance / total.var(correction=0)).item(), rel=1e-6)
        head_values = torch.cat([piece[2].flatten() for piece in pieces]).double()
        # A float64 mean rounded to float32 once: within 2^-24 of it, inside approx's default 1e-6.
        assert layer.head_statistics[name]["mean_abs"][2].item() == pytest.approx(head_values.abs().mean().item())
        at_one = torch.cat([piece.diagonal(offset=-1, dim1=-2, dim2=-1).flatten() for piece in pieces]).double()
        # Each head's mean at i - j = 1 (float64 sums) is rounded to float32 once, by at most u = 2^-24 of its size;
        # every head has the same pairs, so their mean is within u * mean|x| of the exact one, however the terms
        # cancel (twice that: room for the float64 sums' own rounding). Averaged in float64 here.
        at_one_profile = layer.profile[name].double().mean(0)[layer.distances == 1].item()
        bound = 2 * 2.0**-24 * at_one.abs().mean().item()
        assert at_one_profile == pytest.approx(at_one.mean().item(), rel=0, abs=bound)
    for statistic in ("share", "row_share"):
        assert sum(stats[statistic] for stats in layer.statistics.values()) == pytest.approx(1.0)
    assert set(layer.statistics["c2c"]) == set(STATISTICS)


def test_c2p_and_p2c_by_hand_at_a_few_pairs():
    model, batch, explanation = explained(V3)
    config = model.config
    attention = model.deberta.encoder.layer[0].attention.self
    with torch.no_grad():
        hidden = model.deberta(**batch, output_hidden_states=True).hidden_states[0]
        rel = model.deberta.encoder.get_rel_embedding()
        query, key = attention.query_proj(hidden), attention.key_proj(hidden)  # [B, L, H * D]
        pos_query, pos_key = attention.query_proj(rel), attention.key_proj(rel)  # shared: [2S, H * D]
    span, d = config.relative_span, config.head_size
    for b, h, i, j in [(0, 0, 0, 0), (0, 1, 3, 2), (0, 2, 2, 3), (0, 3, 19, 1), (1, 1, 0, 12), (1, 2, 7, 7)]:
        part = slice(h * d, (h + 1) * d)
        row = bucket(i - j, config.position_buckets, config.max_relative_distance) + span
        c2p = torch.dot(query[b, i, part], pos_key[row, part]) * attention.scaling  # q_i . Kr[δ(i, j)]
        p2c = torch.dot(key[b, j, part], pos_query[row, part]) * attention.scaling  # k_j . Qr[δ(i, j)]
        assert explanation.layers[0].terms["c2p"][b, h, i, j].item() == pytest.approx(c2p.item(), abs=1e-5)
        assert explanation.layers[0].terms["p2c"][b, h, i, j].item() == pytest.approx(p2c.item(), abs=1e-5)


def test_zero_position_embeddings_give_zero_position_terms():
    fields = dict(V3, share_att_key=False, norm_rel_ebd="none", pos_att_type="c2p|p2c|p2p")
    model = DisentangledForMaskedLM(DisentangledConfig(**fields))
    inflate_weights(model)
    with torch.no_grad():  # P = 0 and no bias: Kr = Qr = 0
        model.deberta.encoder.rel_embeddings.weight.zero_()
        for layer in model.deberta.encoder.layer:
            layer.attention.self.pos_key_proj.bias.zero_()
            layer.attention.self.pos_query_proj.bias.zero_()
    explanation = explain_attention(model, **padded_batch(128, LENGTHS))
    for layer in explanation.layers:
        for name in ("c2p", "p2c", "p2p"):
            assert layer.terms[name].abs().max() == 0
            assert layer.statistics[name]["mean_abs"] == 0 and layer.statistics[name]["share"] == 0
        assert torch.equal(layer.scores, layer.terms["c2c"])
        assert layer.statistics["c2c"]["share"] == pytest.approx(1.0)


def test_zero_content_projections_give_zero_c2c():
    fields = dict(V3, share_att_key=False, pos_att_type="c2p|p2c|p2p")
    model = DisentangledForMaskedLM(DisentangledConfig(**fields))
    inflate_weights(model)
    with torch.no_grad():  # q = k = 0: c2c, c2p and p2c vanish; p2p reads positions only
        for layer in model.deberta.encoder.layer:
            for projection in (layer.attention.self.query_proj, layer.attention.self.key_proj):
                projection.weight.zero_()
                projection.bias.zero_()
    explanation = explain_attention(model, **padded_batch(128, LENGTHS))
    for layer in explanation.layers:
        for name in ("c2c", "c2p", "p2c"):
            assert layer.terms[name].abs().max() == 0
        assert layer.terms["p2p"].abs().max() > 0
        assert layer.statistics["p2p"]["share"] == pytest.approx(1.0)
        # p2p depends on i - j only: the same for both sequences and constant along each diagonal.
        assert torch.equal(layer.terms["p2p"][0], layer.terms["p2p"][1])
        assert layer.profile["p2p"].shape == (4, len(layer.distances))


# The command.


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    return train_spm(tmp_path_factory.mktemp("spm"))


def model_folder(folder, spm_model, **fields):
    from disentangled.integrations.tokenization import tokenizer_from_spm

    tokenizer = tokenizer_from_spm(spm_model)
    config = DisentangledConfig(**dict(V3, vocab_size=len(tokenizer), legacy=False, **fields))
    model = DisentangledForMaskedLM(config)
    inflate_weights(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


TEXT = "The quick brown fox sat on the mat."
PNG = b"\x89PNG\r\n\x1a\n"


def test_command_prints_the_table_and_writes_figures_and_json(tmp_path, spm_model, capsys):
    from matplotlib.image import imread

    folder = model_folder(tmp_path / "model", spm_model)
    out = tmp_path / "out"
    assert main(["explain", str(folder), TEXT, "--layer", "1", "--head", "2", "--out", str(out), "--json"]) == 0
    printed = capsys.readouterr().out
    assert "c2c + c2p + p2c" in printed and "share" in printed
    for term in ("c2c", "c2p", "p2c", "total"):
        assert sum(line.split()[-5:-4] == [term] for line in printed.splitlines()) == 2  # one row per layer
    for name in ("terms_layer1_head2.png", "term_shares.png", "distance_profile.png"):
        path = out / name
        assert path.read_bytes().startswith(PNG), name
        assert imread(path).shape[0] > 100
    statistics = json.loads((out / "statistics.json").read_text())
    assert set(statistics) == {
        "model",
        "text",
        "tokens",
        "terms",
        "relative_attention",
        "scaling",
        "statistics",
        "layers",
    }
    assert statistics["terms"] == ["c2c", "c2p", "p2c"] and statistics["tokens"][0] == "[CLS]"
    layer = statistics["layers"][1]
    assert set(layer) == {"layer", "terms", "total", "heads", "distance_profile"}
    assert set(layer["terms"]["c2p"]) == set(STATISTICS)
    assert sum(stats["share"] for stats in layer["terms"].values()) == pytest.approx(1.0)
    assert len(layer["heads"]) == 4 and set(layer["heads"][0]["terms"]) == {"c2c", "c2p", "p2c"}
    profile = layer["distance_profile"]
    assert 1 in profile["distance"] and len(profile["c2p"]) == len(profile["distance"])
    assert len(profile["by_head"]["p2c"]) == 4


def test_command_on_a_model_without_relative_attention_reports_c2c_only(tmp_path, spm_model, capsys):
    folder = model_folder(tmp_path / "model", spm_model, relative_attention=False, position_biased_input=True)
    out = tmp_path / "out"
    assert main(["explain", str(folder), TEXT, "--out", str(out), "--json", str(tmp_path / "s.json")]) == 0
    printed = capsys.readouterr().out
    assert "no relative attention: the score is c2c alone" in printed
    assert not re.search(r"c2p|p2c|p2p", printed)
    statistics = json.loads((tmp_path / "s.json").read_text())
    assert statistics["terms"] == ["c2c"] and statistics["relative_attention"] is False
    assert statistics["layers"][0]["terms"]["c2c"]["share"] == pytest.approx(1.0)
    assert (out / "distance_profile.png").read_bytes().startswith(PNG)


def test_command_rejects_a_layer_the_model_lacks(tmp_path, spm_model, capsys):
    folder = model_folder(tmp_path / "model", spm_model)
    assert main(["explain", str(folder), TEXT, "--layer", "5", "--no-plots"]) == 2
    assert "--layer 5" in capsys.readouterr().err


def test_command_reads_a_transformers_deberta_v2_folder_as_ours(tmp_path, spm_model, capsys):
    import transformers
    from spm_fixture import write_deberta_v3_tokenizer_files

    write_deberta_v3_tokenizer_files(tmp_path, spm_model)
    fields = {key: value for key, value in V3.items() if key != "vocab_size"}
    transformers.DebertaV2Model(transformers.DebertaV2Config(vocab_size=200, **fields)).save_pretrained(tmp_path)
    assert main(["explain", str(tmp_path), TEXT, "--no-plots"]) == 0
    assert "terms c2c + c2p + p2c" in capsys.readouterr().out


# Many texts: `explain_texts` and `disentangled explain --texts-file`.

TEXTS = [  # 11, 6, 15, 6 and (cut from 21) 18 tokens
    "The cat sat on the mat.",
    "A bird flew.",
    "Paris is the capital of France.",
    "Good film.",
    "The story was long but the book was good.",
]


def by_definition(model, tokenizer, texts, exclude_special):
    """Each text alone (no padding), its pairs concatenated across texts: per layer, term -> [H, N] values, the
    total, the row-centred values, and (term -> {distance: [H] sum}, {distance: pairs}) for the profile."""
    config = model.config
    layers = [{"values": {}, "rows": {}, "profile": {}, "pairs": {}} for _ in range(config.num_hidden_layers)]
    for text in texts:
        encoded = tokenizer(text, return_tensors="pt", truncation=True, max_length=18)
        n = encoded["input_ids"].shape[1]
        keep = list(range(1, n - 1)) if exclude_special else list(range(n))  # [CLS] first, [SEP] last
        explanation = explain_attention(model, **encoded)
        for layer, out in zip(explanation.layers, layers):
            for name, term in [*layer.terms.items(), ("total", layer.scores)]:
                x = term[0].double()  # [H, n, n], every pair valid
                out["values"].setdefault(name, []).append(x.flatten(1))
                out["rows"].setdefault(name, []).append((x - x.mean(-1, keepdim=True)).flatten(1))
                if name == "total":
                    continue
                profile = out["profile"].setdefault(name, {})
                for i in keep:
                    for j in keep:
                        d = bucket(i - j, config.position_buckets, config.max_relative_distance)
                        profile[d] = profile.get(d, 0) + x[:, i, j]
                        if name == "c2c":
                            out["pairs"][d] = out["pairs"].get(d, 0) + 1
    return layers


def assert_matches_definition(summary, reference, exclude_special):
    def share(x, a):  # Cov(x, a) / Var(a) over the last dimension
        return ((x - x.mean(-1, keepdim=True)) * (a - a.mean(-1, keepdim=True))).mean(-1) / a.var(-1, correction=0)

    for layer, ref in zip(summary.layers, reference):
        values = {name: torch.cat(parts, 1) for name, parts in ref["values"].items()}
        rows = {name: torch.cat(parts, 1) for name, parts in ref["rows"].items()}
        for name in summary.term_names:
            x, a = values[name], values["total"]
            expected_heads = {
                "mean_abs": x.abs().mean(-1),
                "std": x.std(-1, correction=0),
                "share": share(x, a),
                "row_share": share(rows[name], rows["total"]),
            }
            expected = {
                "mean_abs": x.abs().mean(),
                "std": x.std(correction=0),
                "share": share(x.flatten(), a.flatten()),
                "row_share": share(rows[name].flatten(), rows["total"].flatten()),
            }
            for statistic in STATISTICS:
                torch.testing.assert_close(
                    layer.head_statistics[name][statistic].double(), expected_heads[statistic], rtol=1e-5, atol=1e-5
                )
                assert layer.statistics[name][statistic] == pytest.approx(expected[statistic].item(), rel=1e-5)
            distances = sorted(ref["pairs"])
            assert layer.distances.tolist() == distances
            mean = torch.stack([ref["profile"][name][d] / ref["pairs"][d] for d in distances], -1)
            torch.testing.assert_close(layer.profile[name].double(), mean, rtol=1e-5, atol=1e-5)
        a = values["total"]
        assert layer.total["mean_abs"] == pytest.approx(a.abs().mean().item(), rel=1e-5)
        assert layer.total["std"] == pytest.approx(a.std(correction=0).item(), rel=1e-5)


@pytest.mark.parametrize("exclude_special", [True, False])
def test_statistics_over_texts_equal_those_of_the_concatenated_pairs(spm_model, tmp_path, exclude_special):
    from transformers import AutoTokenizer

    from disentangled.explain import explain_texts

    folder = model_folder(tmp_path / "model", spm_model)
    model, tokenizer = DisentangledForMaskedLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    reference = by_definition(model, tokenizer, TEXTS, exclude_special)
    lengths = [len(tokenizer(text, truncation=True, max_length=18)["input_ids"]) for text in TEXTS]
    assert len(set(lengths)) > 2 and max(lengths) > 12  # padded batches, and distances in the log buckets
    for batch_size in (1, 2, 5):  # batches of 2 and 5 are padded; the result must not depend on it
        summary = explain_texts(model, tokenizer, TEXTS, batch_size, max_length=18, exclude_special=exclude_special)
        assert_matches_definition(summary, reference, exclude_special)
        assert summary.texts == len(TEXTS) and summary.pairs == sum(n * n for n in lengths)
        assert summary.profile_pairs == sum((n - 2) ** 2 if exclude_special else n * n for n in lengths)
        for layer in summary.layers:
            assert sum(stats["share"] for stats in layer.statistics.values()) == pytest.approx(1.0)
    empty = explain_texts(model, tokenizer, [""], exclude_special=exclude_special)  # [CLS] [SEP] alone
    assert empty.pairs == 4 and empty.profile_pairs == (0 if exclude_special else 4)
    assert empty.layers[0].profile["c2p"].shape == (4, 0 if exclude_special else 3)
    # One text: the same statistics as explain_attention's.
    single = explain_attention(model, **tokenizer(TEXTS[0], return_tensors="pt", truncation=True, max_length=18))
    alone = explain_texts(model, tokenizer, TEXTS[:1], max_length=18, exclude_special=False)
    for first, second in zip(single.layers, alone.layers):
        for name in single.term_names:
            for statistic in STATISTICS:
                assert second.statistics[name][statistic] == pytest.approx(first.statistics[name][statistic], rel=1e-5)
        torch.testing.assert_close(second.profile["c2p"], first.profile["c2p"], rtol=1e-5, atol=1e-5)


def test_command_over_a_texts_file_prints_no_text(tmp_path, spm_model, capsys):
    folder = model_folder(tmp_path / "model", spm_model)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "out"
    command = ["explain", str(folder), "--texts-file", str(texts), "--batch-size", "2", "--max-texts", "4"]
    assert main([*command, "--out", str(out), "--json"]) == 0
    printed = capsys.readouterr().out
    assert "4 texts" in printed and "without [CLS]/[SEP]" in printed
    assert not re.search(r"cat|Paris|bird|story|▁|\[CLS\] ", printed)  # neither the texts nor their tokens
    for term in ("c2c", "c2p", "p2c", "total"):
        assert sum(line.split()[-5:-4] == [term] for line in printed.splitlines()) == 2
    for name in ("term_shares.png", "distance_profile.png"):
        assert (out / name).read_bytes().startswith(PNG), name
    statistics = json.loads((out / "statistics.json").read_text())
    assert statistics["texts"] == 4 and "tokens" not in statistics and "text" not in statistics
    assert statistics["profile_pairs"] < statistics["pairs"]
    rows = tmp_path / "texts.jsonl"
    rows.write_text("".join(json.dumps({"body": text}) + "\n" for text in TEXTS))
    jsonl = [
        *command[:3],
        str(rows),
        "--max-texts",
        "4",
        "--text-column",
        "body",
        "--no-exclude-special",
        "--json",
        "-",
    ]
    assert main([*jsonl, "--no-plots"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["pairs"] == again["profile_pairs"] == statistics["pairs"]
    # The same texts, read from .jsonl, at the default --batch-size (16): one batch padded to 15 tokens instead of
    # two padded to 11 and 15, so the float32 forward multiplies matrices of other shapes and its kernels sum the
    # same products in another order. The statistics are float64 sums of those float32 terms: they differ by the
    # terms' rounding. A float32 sum of n products is within about sqrt(n) * u of the exact one (u = 2^-24, rounding
    # errors as random; Higham & Mary 2019), and layer 1's terms come out of these sums after the embeddings:
    hidden, inner, keys = SMALL["hidden_size"], SMALL["intermediate_size"], 15
    head = hidden // SMALL["num_attention_heads"]
    sums = [hidden] * 2 + [hidden, head, keys, keys, hidden]  # LayerNorm; q/k/v, scores, softmax, context, output
    sums += [hidden] * 2 + [hidden, inner] + [hidden] * 2 + [hidden, head]  # LayerNorm, FFN, LayerNorm; layer 1 q.k
    # about 4.7e-6 relative to each term; twice that for the shares, each a ratio of two covariances.
    tolerance = 2 * 2.0**-24 * sum(math.sqrt(n) for n in sums)
    for name, stats in statistics["layers"][1]["terms"].items():
        assert again["layers"][1]["terms"][name] == pytest.approx(stats, rel=tolerance)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--texts-file", "missing.txt"], "--texts-file missing.txt: no such file"),
        (["--texts-file", "empty.txt"], "is empty"),
        (["--texts-file", "blank.jsonl"], "no text in the file"),
        ([TEXT, "--texts-file", "good.txt"], "either a text or --texts-file"),
        ([], "either a text or --texts-file"),
        (["--texts-file", "rows.jsonl"], "no column 'text'"),
        (["--texts-file", "good.txt", "--max-texts", "0"], "--max-texts must be at least 1"),
        (["--texts-file", "good.txt", "--batch-size", "0"], "--batch-size must be at least 1"),
    ],
)
def test_command_names_what_is_wrong_with_a_texts_file(tmp_path, spm_model, capsys, monkeypatch, arguments, message):
    folder = model_folder(tmp_path / "model", spm_model)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": "  "}\n')
    (tmp_path / "good.txt").write_text(TEXT + "\n")
    (tmp_path / "rows.jsonl").write_text('{"body": "a text"}\n')
    assert main(["explain", str(folder), *arguments, "--no-plots"]) == 2
    assert message in capsys.readouterr().err


def test_the_explain_terms_benchmark_runs_on_tiny_settings(tmp_path, monkeypatch, capsys):
    """studies/explain_terms.py, as docs/explain.md runs it, on the tests' corpus (reading the standard library's
    docstrings takes longer than the rest) and one pretraining step."""
    from spm_fixture import corpus_lines

    from benchmarks.records import read_records
    from studies import explain_terms

    lines = [{"text": line} for line in corpus_lines(400)]
    monkeypatch.setattr(explain_terms, "python_docs_split", lambda: (lines[:300], lines[300:]))
    run = explain_terms.run

    out, records = tmp_path / "figures", tmp_path / "records"
    tiny = ["--max-steps", "1", "--vocab-size", "120", "--max-texts", "4"]
    figures = run([*tiny, "--untrained-seeds", "0", "1", "--out", str(out), "--records", str(records)])
    assert read_records("explain_terms", folder=records)[-1]["figures"] == figures
    for name in ("pretrained", "untrained", "untrained-1"):
        layers = figures[name]["layers"]
        assert figures[name]["texts"] == 4 and len(layers) == 4
        assert sum(stats["share"] for stats in layers[0]["terms"].values()) == pytest.approx(1.0, abs=1e-3)
        assert set(layers[0]["profile"]["c2p"]) >= {"-1", "0", "1"}
    assert figures["pretraining"]["held_out_masked_accuracy"] is not None
    for name in ("pretrained/term_shares.png", "untrained/distance_profile.png", "compare_distance.png"):
        assert (out / name).read_bytes().startswith(PNG), name
    assert str(tmp_path) not in json.dumps(figures)
    capsys.readouterr()
    assert run(["--tables", "--records", str(records)]) == figures  # the page's tables, from the record
    tables = capsys.readouterr().out
    assert tables.count("| c2p |") == 8 and "| 3 | c2c |" in tables and "δ = -1" in tables
