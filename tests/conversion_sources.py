"""DeBERTa checkpoints as the converter meets them, built in the test from transformers models (no download).

- transformers' layouts: v1 (`deberta`, fused in_proj), v2 (deberta-v2-xlarge's conv and head size), v3 and
  mDeBERTa (`deberta-v2`), every head, safetensors (single and sharded) and `.bin`;
- the Hub layout of microsoft/deberta-v3-base: config.json without `architectures`, `pytorch_model.bin` with an
  MLM head in the legacy=False layout plus the unused RTD head, `spm.model` + `tokenizer_config.json`, no
  tokenizer.json;
- Microsoft's `DeBERTa` package layouts: `bert.`/`deberta.`/no key prefix, `model_config.json`, a config.json
  without model_type or a config inside the state dict, `padding_idx`, `pos_att_type` as "c2p|p2c",
  `lm_predictions.*` with the absolute `position_embeddings` (masked-LM models trained with the Enhanced Mask
  Decoder, whose reference is `EmdReference`), and an RTD discriminator (`mask_predictions.*`, with the
  `classifer` spelling of Microsoft's code);
- a DeBERTa-v3 discriminator as released on the Hub: transformers' layout with both heads, the absolute table and
  the GDES embedding delta (`word_embeddings._weight`), converted three ways (`--task replaced-token-detection`,
  `--enhanced-mask-decoder`, and `--generator` for the `pytorch_model.generator.bin` + `generator_config.json`
  beside it).

Shapes are small (hidden 64, 2 layers) but keep each generation's attention fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from deberta_shapes import V1_SHAPES, V2_SHAPES
from emd_reference import Spec, emd_states, layer_norm, mlm_logits, prefixed, rtd_logits, v1_layer_weights
from parity import inflate_weights
from spm_fixture import SPM_VOCAB_SIZE, write_deberta_v3_tokenizer_files

SMALL = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2)
GENERATIONS = {  # name -> (model_type, config fields)
    "v1": ("deberta", dict(V1_SHAPES["deberta-base"], **SMALL, vocab_size=200)),
    "v2": ("deberta-v2", dict(V2_SHAPES["deberta-v2-xlarge"], **SMALL, attention_head_size=16, vocab_size=200)),
    "v3": ("deberta-v2", dict(V2_SHAPES["deberta-v3-xsmall"], **SMALL, vocab_size=SPM_VOCAB_SIZE + 10)),
    "mdeberta": ("deberta-v2", dict(V2_SHAPES["mdeberta-v3-base"], **SMALL, vocab_size=300)),
}
HEADS = {  # suffix -> the Auto class that loads it
    "Model": "AutoModel",
    "ForMaskedLM": "AutoModelForMaskedLM",
    "ForSequenceClassification": "AutoModelForSequenceClassification",
    "ForTokenClassification": "AutoModelForTokenClassification",
    "ForQuestionAnswering": "AutoModelForQuestionAnswering",
    "ForMultipleChoice": "AutoModelForMultipleChoice",
}
PREFIX = {"deberta": "Deberta", "deberta-v2": "DebertaV2"}


@dataclass
class Case:
    name: str
    source: Path
    reference: torch.nn.Module  # transformers' model holding the source weights
    auto_class: str
    vocab_size: int
    multiple_choice: bool = False
    tokenizer: bool = False
    convert_args: tuple[str, ...] = ()


def build_model(generation: str, suffix: str, seed: int = 0, **overrides) -> torch.nn.Module:
    model_type, fields = GENERATIONS[generation]
    config_class = transformers.DebertaConfig if model_type == "deberta" else transformers.DebertaV2Config
    config = config_class(**dict(fields, **overrides), num_labels=2 if suffix == "ForQuestionAnswering" else 3)
    torch.manual_seed(seed)
    model = getattr(transformers, PREFIX[model_type] + suffix)(config)
    inflate_weights(model, seed=seed)
    return model.eval()


def transformers_cases(root: Path) -> list[Case]:
    cases = []
    for generation, (model_type, fields) in GENERATIONS.items():
        for suffix, auto_class in HEADS.items():
            if not hasattr(transformers, PREFIX[model_type] + suffix):
                continue  # transformers has no DebertaForMultipleChoice (v1)
            model = build_model(generation, suffix)
            name = f"{generation}-{suffix}"
            folder = root / name
            if name == "v2-Model":
                model.save_pretrained(folder, max_shard_size="100KB")  # sharded safetensors with an index
            elif name == "v1-ForMaskedLM":
                save_bin(model, folder)
            else:
                model.save_pretrained(folder)
            cases.append(
                Case(
                    name, folder, model, auto_class, fields["vocab_size"], multiple_choice=suffix == "ForMultipleChoice"
                )
            )
    return cases


def save_bin(model: torch.nn.Module, folder: Path, name: str = "pytorch_model.bin", config: dict | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, folder / name)
    (folder / "config.json").write_text(json.dumps(config if config is not None else model.config.to_dict()))


def hub_deberta_v3_base_case(root: Path, spm_model: Path | None = None) -> Case:
    """Laid out as microsoft/deberta-v3-base is on the Hub."""
    model = build_model("v3", "ForMaskedLM", seed=1, legacy=False)
    folder = root / "hub-v3-base"
    folder.mkdir(parents=True)
    state_dict = dict(model.state_dict())
    hidden = model.config.hidden_size
    state_dict["mask_predictions.dense.weight"] = torch.randn(hidden, hidden)  # the RTD head: not converted
    state_dict["mask_predictions.classifier.weight"] = torch.randn(1, hidden)
    torch.save(state_dict, folder / "pytorch_model.bin")
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("architectures", "transformers_version")}
    config["pos_att_type"] = "p2c|c2p"
    (folder / "config.json").write_text(json.dumps(config))
    write_deberta_v3_tokenizer_files(folder, spm_model)
    return Case("hub-v3-base", folder, model, "AutoModelForMaskedLM", model.config.vocab_size, tokenizer=True)


def microsoft_config(model: torch.nn.Module) -> dict:
    config = model.config.to_dict()
    fields = {
        k: config[k]
        for k in (*GENERATIONS["v3"][1], "attention_head_size", "conv_kernel_size", "conv_act", "layer_norm_eps")
        if k in config and k not in ("pad_token_id", "pos_att_type")
    }
    fields["padding_idx"] = config["pad_token_id"]
    fields["pos_att_type"] = "|".join(config["pos_att_type"])
    fields["vocab_size"] = config["vocab_size"]
    return fields


def microsoft_state_dict(model: torch.nn.Module, prefix: str) -> dict:
    """transformers keys -> Microsoft's: `deberta.` becomes `prefix`; their embeddings keep an absolute table."""
    state_dict = {}
    for key, value in model.state_dict().items():
        key = key.removeprefix("deberta.")
        state_dict[prefix + key if key.startswith(("embeddings.", "encoder.")) else key] = value.contiguous()
    hidden = model.config.hidden_size
    state_dict[prefix + "embeddings.position_embeddings.weight"] = torch.randn(
        model.config.max_position_embeddings, hidden
    )
    return state_dict


class EmdReference(torch.nn.Module):
    """Microsoft's masked-LM logits, through the Enhanced Mask Decoder, from a transformers MLM model's weights (the
    encoder and `lm_predictions.lm_head`) and the absolute table: `emd_reference`, no module of ours."""

    def __init__(self, model: torch.nn.Module, table: torch.Tensor):
        super().__init__()
        self.model, self.table, self.base, self.config = model, table, model.deberta, model.config

    def forward(self, input_ids, attention_mask, **_):
        config = self.model.config
        spec = Spec.of(config)
        weights = self.model.state_dict()
        hidden = self.base(input_ids, attention_mask, output_hidden_states=True).hidden_states[-2]
        layer = prefixed(weights, f"deberta.encoder.layer.{config.num_hidden_layers - 1}.")
        if config.model_type == "deberta":
            layer = v1_layer_weights(layer, config.num_attention_heads)
        rel_table = weights["deberta.encoder.rel_embeddings.weight"]
        if "layer_norm" in str(getattr(config, "norm_rel_ebd", "none")):
            rel_table = layer_norm(rel_table, weights, "deberta.encoder.LayerNorm", spec.eps)
        states = emd_states(layer, spec, rel_table, hidden, self.table, attention_mask.bool())
        head = prefixed(weights, "lm_predictions.lm_head.")
        word_embeddings = weights["deberta.embeddings.word_embeddings.weight"]
        return SimpleNamespace(logits=mlm_logits(head, word_embeddings, states, spec.eps))


class RtdReference(torch.nn.Module):
    """Microsoft's replaced-token-detection logits from a transformers base model and the head's tensors."""

    def __init__(self, base: torch.nn.Module, head: dict[str, torch.Tensor]):
        super().__init__()
        self.base, self.head, self.config = base, head, base.config

    def forward(self, input_ids, attention_mask, **_):
        hidden = self.base(input_ids, attention_mask).last_hidden_state
        return SimpleNamespace(logits=rtd_logits(self.head, hidden, self.base.config.layer_norm_eps))


def rtd_head(hidden: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "dense.weight": torch.randn(hidden, hidden, generator=generator) / hidden**0.5,
        "dense.bias": 0.1 * torch.randn(hidden, generator=generator),
        "LayerNorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        "LayerNorm.bias": 0.1 * torch.randn(hidden, generator=generator),
        "classifier.weight": torch.randn(1, hidden, generator=generator) / hidden**0.5,
        "classifier.bias": 0.1 * torch.randn(1, generator=generator),
    }


def microsoft_cases(root: Path, spm_model: Path | None = None) -> list[Case]:
    cases = []
    # v1 MLM as their package saves it: "bert." prefix, model_config.json, pytorch.model.bin; the decoder's table
    model = build_model("v1", "ForMaskedLM", seed=2, legacy=False)
    folder = root / "ms-v1-mlm"
    folder.mkdir(parents=True)
    state_dict = microsoft_state_dict(model, "bert.")
    torch.save(state_dict, folder / "pytorch.model.bin")
    (folder / "model_config.json").write_text(json.dumps(microsoft_config(model)))
    reference = EmdReference(model, state_dict["bert.embeddings.position_embeddings.weight"])
    cases.append(Case("ms-v1-mlm", folder, reference, "AutoModelForMaskedLM", model.config.vocab_size))

    # v2 encoder without prefix, the config inside the state dict
    model = build_model("v2", "Model", seed=3)
    folder = root / "ms-v2-base"
    folder.mkdir(parents=True)
    state_dict = microsoft_state_dict(model, "")
    state_dict["config"] = microsoft_config(model)
    torch.save(state_dict, folder / "pytorch_model.bin")
    cases.append(Case("ms-v2-base", folder, model, "AutoModel", model.config.vocab_size))

    # v3 MLM with "deberta." prefix, config.json without model_type, spm.model only
    model = build_model("v3", "ForMaskedLM", seed=4, legacy=False)
    folder = root / "ms-v3-mlm"
    folder.mkdir(parents=True)
    state_dict = microsoft_state_dict(model, "deberta.")
    torch.save(state_dict, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(microsoft_config(model)))
    write_deberta_v3_tokenizer_files(folder, spm_model)
    (folder / "tokenizer_config.json").unlink()
    reference = EmdReference(model, state_dict["deberta.embeddings.position_embeddings.weight"])
    cases.append(Case("ms-v3-mlm", folder, reference, "AutoModelForMaskedLM", model.config.vocab_size, tokenizer=True))

    # v3 RTD discriminator as their ReplacedTokenDetectionModel saves it: only `mask_predictions.*` as head weights
    model = build_model("v3", "Model", seed=5)
    folder = root / "ms-v3-rtd"
    folder.mkdir(parents=True)
    head = rtd_head(model.config.hidden_size, seed=5)
    state_dict = microsoft_state_dict(model, "deberta.")
    state_dict.update({"mask_predictions." + k.replace("classifier", "classifer"): v for k, v in head.items()})
    torch.save(state_dict, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(microsoft_config(model)))
    cases.append(
        Case("ms-v3-rtd", folder, RtdReference(model, head), "AutoModelForPreTraining", model.config.vocab_size)
    )
    return cases


def hub_v3_discriminator_cases(root: Path) -> list[Case]:
    """microsoft/deberta-v3-* as on the Hub: config.json (deberta-v2), pytorch_model.bin with both heads, the absolute
    table and the GDES delta, and the generator beside it (pytorch_model.generator.bin, generator_config.json)."""
    model = build_model("v3", "ForMaskedLM", seed=6, legacy=False)
    folder = root / "hub-v3-discriminator"
    folder.mkdir(parents=True)
    hidden = model.config.hidden_size
    head = rtd_head(hidden, seed=6)
    state_dict = dict(model.state_dict())
    table = torch.randn(model.config.max_position_embeddings, hidden, generator=torch.Generator().manual_seed(6))
    state_dict["deberta.embeddings.position_embeddings.weight"] = table
    state_dict["deberta.embeddings.word_embeddings._weight"] = torch.randn_like(  # the GDES delta: not needed
        state_dict["deberta.embeddings.word_embeddings.weight"]
    )
    state_dict.update({"mask_predictions." + k: v for k, v in head.items()})
    torch.save(state_dict, folder / "pytorch_model.bin")
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("architectures", "transformers_version")}
    (folder / "config.json").write_text(json.dumps(config))

    generator = build_model("v3", "ForMaskedLM", seed=7, legacy=False, num_hidden_layers=1)  # H = the embeddings
    generator_state = microsoft_state_dict(generator, "deberta.")
    torch.save(generator_state, folder / "pytorch_model.generator.bin")
    (folder / "generator_config.json").write_text(json.dumps(microsoft_config(generator)))

    vocab = model.config.vocab_size
    return [
        Case(
            "hub-v3-rtd",
            folder,
            RtdReference(model.deberta, head),
            "AutoModelForPreTraining",
            vocab,
            convert_args=("--task", "replaced-token-detection"),
        ),
        Case(
            "hub-v3-emd",
            folder,
            EmdReference(model, table),
            "AutoModelForMaskedLM",
            vocab,
            convert_args=("--enhanced-mask-decoder",),
        ),
        Case(
            "hub-v3-generator",
            folder,
            EmdReference(generator, generator_state["deberta.embeddings.position_embeddings.weight"]),
            "AutoModelForMaskedLM",
            vocab,
            convert_args=("--generator",),
        ),
    ]
