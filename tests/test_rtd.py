"""Replaced-token detection (DeBERTa-v3's discriminator head) and the Enhanced Mask Decoder in the ecosystem.

The RTD head against `emd_reference.rtd_logits` (Microsoft's `LMMaskPredictionHead` written out) on padded batches,
outputs and gradients; the loss against a hand computation that skips -100 labels and padding; Auto classes
(`AutoModelForPreTraining` for RTD, `AutoModelForMaskedLM` for EMD) through save/load; fill-mask on an EMD model;
and both heads as Hub remote code in processes where `disentangled` cannot be imported, on this transformers and on
4.57. Reproduce the figures: `python -m pytest -q -s tests/test_rtd.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_models
import torch
import transformers
from emd_reference import prefixed, rtd_logits
from isolated import PYTHON_4_57, run_isolated, system_python
from parity import gradient_mismatches, inflate_weights, max_abs_diff, padded_batch
from safetensors.torch import load_file, save_file
from tiny_models import export_remote_code, save_tiny, tokenizer

import disentangled

HERE = Path(__file__).resolve().parent
V3 = dict(tiny_models.TINY, vocab_size=200, position_buckets=256, max_position_embeddings=512)
CONFIGS = {
    "v3 (log buckets, shared keys)": V3,
    "v1 (clipped distances, separate projections)": dict(
        V3, position_buckets=-1, max_relative_positions=16, share_att_key=False, norm_rel_ebd="none"
    ),
}
LENGTHS = [300, 171]


def build(**config) -> disentangled.DisentangledForReplacedTokenDetection:
    torch.manual_seed(0)
    model = disentangled.DisentangledForReplacedTokenDetection(disentangled.DisentangledConfig(**config))
    inflate_weights(model)
    return model.eval()


def hand_logits(model, batch: dict) -> torch.Tensor:
    hidden = model.deberta(**batch).last_hidden_state
    weights = dict(model.named_parameters())
    return rtd_logits(prefixed(weights, "mask_predictions."), hidden, model.config.layer_norm_eps)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rtd_head_matches_hand_computation(name):
    model = build(**CONFIGS[name])
    batch = padded_batch(200, LENGTHS)
    mask = batch["attention_mask"]
    weights = torch.linspace(-1, 1, mask.numel()).view_as(mask) * mask

    logits = model(**batch).logits
    assert logits.shape == mask.shape
    model.zero_grad()
    (logits * weights).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    expected = hand_logits(model, batch)
    model.zero_grad()
    (expected * weights).sum().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    relative = max_abs_diff(logits, expected, mask) / max(1.0, expected.abs().max().item())
    for n, p in model.named_parameters():
        p.grad = ours.get(n)
    problems = gradient_mismatches(model, reference, rtol=1e-4)
    overall = max(g.abs().max().item() for g in reference.values())
    gradient = max(
        (ours[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-3 * overall) for n, g in reference.items()
    )
    print(f"\nRTD {name}: logits max relative diff {relative:.2e}, max gradient relative diff {gradient:.2e}")
    assert relative <= 1e-5 and not problems, (relative, problems)
    assert reference["mask_predictions.classifier.weight"].abs().max() > 0


def test_rtd_loss_skips_ignored_labels_and_padding():
    model = build(**V3)
    batch = padded_batch(200, [12, 7])
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 2, (2, 12), generator=generator)
    labels[0, 3] = labels[1, 0] = -100
    labels[1, 7:] = 1  # labels on padding: not counted
    out = model(**batch, labels=labels)
    counted = (labels != -100) & batch["attention_mask"].bool()
    logits = out.logits.detach()[counted]
    target = labels[counted].float()
    by_hand = (-(target * logits.sigmoid().log() + (1 - target) * (1 - logits.sigmoid()).log())).mean()
    assert out.loss.item() == pytest.approx(by_hand.item(), rel=1e-5)

    nothing = model(**batch, labels=torch.full((2, 12), -100)).loss
    assert nothing.item() == 0.0  # no labelled token: 0, not NaN
    with pytest.raises(ValueError, match="labels"):
        model(**batch, labels=torch.full((2, 12), 2))
    with pytest.raises(ValueError, match="labels"):
        model(**batch, labels=torch.zeros(2, 11, dtype=torch.long))


def test_rtd_inputs_embeds_tuple_output_and_packing():
    model = build(**V3)
    batch = padded_batch(200, [12, 7])
    with torch.no_grad():
        expected = model(**batch).logits
        embeds = model.deberta.embeddings.word_embeddings(batch["input_ids"])
        assert torch.equal(model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).logits, expected)
        loss, logits, hidden_states = model(
            **batch, labels=torch.zeros(2, 12, dtype=torch.long), output_hidden_states=True, return_dict=False
        )
        assert torch.equal(logits, expected) and len(hidden_states) == 3 and loss.dim() == 0
        ids = torch.cat([batch["input_ids"][0], batch["input_ids"][1, :7]])[None]
        packed = model(input_ids=ids, cu_seqlens=[0, 12, 19]).logits
    assert max_abs_diff(packed[0, :12], expected[0]) <= 1e-5 * expected.abs().max()
    assert max_abs_diff(packed[0, 12:], expected[1, :7]) <= 1e-5 * expected.abs().max()


def test_auto_classes_round_trip(tmp_path):
    rtd = build(**V3)
    rtd.save_pretrained(tmp_path / "rtd")
    loaded = transformers.AutoModelForPreTraining.from_pretrained(tmp_path / "rtd").eval()
    assert type(loaded) is disentangled.DisentangledForReplacedTokenDetection
    assert "mask_predictions.classifier.weight" in loaded.state_dict()
    batch = padded_batch(200, [12, 7])
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, rtd(**batch).logits)

    torch.manual_seed(0)
    emd = disentangled.DisentangledForMaskedLM(
        disentangled.DisentangledConfig(**V3, legacy=False, enhanced_mask_decoder=True)
    )
    inflate_weights(emd)
    emd.eval().save_pretrained(tmp_path / "emd")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "emd")
    assert config.enhanced_mask_decoder is True
    loaded, info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "emd", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert torch.equal(loaded.eval()(**batch).logits, emd(**batch).logits)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    tok = tokenizer()
    root = tmp_path_factory.mktemp("heads")
    emd = save_tiny(
        root / "emd", disentangled.DisentangledForMaskedLM, tok, 0, legacy=False, enhanced_mask_decoder=True
    )
    rtd = save_tiny(root / "rtd", disentangled.DisentangledForReplacedTokenDetection, tok, 1)
    for folder, model_class in (
        (emd, disentangled.DisentangledForMaskedLM),
        (rtd, disentangled.DisentangledForReplacedTokenDetection),
    ):
        model = model_class.from_pretrained(folder)
        inflate_weights(model)  # non-trivial logits: the default init gives near-uniform attention
        model.save_pretrained(folder)
    return {"emd": emd, "rtd": rtd}


def test_fill_mask_pipeline_gives_the_decoder_predictions(folders):
    pipe = transformers.pipeline("fill-mask", model=str(folders["emd"]))
    model = pipe.model
    assert model.config.enhanced_mask_decoder and type(model) is disentangled.DisentangledForMaskedLM
    text = f"the cat sat on the {pipe.tokenizer.mask_token}."
    results = pipe(text, top_k=3)
    encoded = pipe.tokenizer(text, return_tensors="pt")
    where = encoded["input_ids"][0] == pipe.tokenizer.mask_token_id
    with torch.no_grad():
        emd = model(**encoded).logits[0, where][0]
        plain = model.lm_predictions(
            model.deberta(**encoded).last_hidden_state, model.deberta.embeddings.word_embeddings
        )[0, where][0]
    assert [r["token"] for r in results] == emd.softmax(-1).topk(3).indices.tolist()
    assert results[0]["score"] == pytest.approx(emd.softmax(-1).max().item(), rel=1e-4)
    assert not torch.allclose(emd, plain)  # the plain head on the last layer would predict differently


@pytest.mark.parametrize("version", ["latest", "4.57"])
def test_remote_code_without_the_package(folders, tmp_path, version):
    """AutoModelForPreTraining (RTD) and AutoModelForMaskedLM (EMD) with trust_remote_code=True in a process where
    `disentangled` cannot be imported: same logits as the package gives here."""
    if version == "4.57" and not PYTHON_4_57.exists():
        pytest.skip(f"no transformers 4.57 environment at {PYTHON_4_57} (.ci/run creates it)")
    batch = padded_batch(len(tokenizer()), [12, 7])
    save_file(batch, tmp_path / "inputs.safetensors")
    cases, expected = [], {}
    for name, auto_class, model_class in (
        ("emd", "AutoModelForMaskedLM", disentangled.DisentangledForMaskedLM),
        ("rtd", "AutoModelForPreTraining", disentangled.DisentangledForReplacedTokenDetection),
    ):
        folder = export_remote_code(folders[name])
        cases.append(
            {
                "name": name,
                "folder": str(folder),
                "auto_class": auto_class,
                "inputs": str(tmp_path / "inputs.safetensors"),
                "text": None,
            }
        )
        with torch.no_grad():
            expected[name] = model_class.from_pretrained(folder).eval()(**batch).logits
    (tmp_path / "manifest.json").write_text(json.dumps(cases))
    python = PYTHON_4_57 if version == "4.57" else system_python()
    result = run_isolated(
        python,
        HERE / "load_converted.py",
        [str(tmp_path / "manifest.json"), str(tmp_path / "outputs.safetensors")],
        env={"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.rsplit("REPORT ", 1)[1].splitlines()[0])
    outputs = load_file(tmp_path / "outputs.safetensors")
    mask = batch["attention_mask"].bool()
    for name in expected:
        assert report["cases"][name]["module"].startswith("transformers_modules.")
        error = max_abs_diff(outputs[f"{name}/logits"], expected[name], mask) / expected[name].abs().max()
        print(f"\n{name} as remote code on transformers {report['transformers']}: max relative diff {error:.2e}")
        assert error <= 1e-5
    assert "newly initialized" not in result.stdout + result.stderr
