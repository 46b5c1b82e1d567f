"""Child script (transformers 4.57 with this package and gliner, the environment .ci/run makes): GLiNER's entities,
plain and accelerated.

usage: gliner_accelerate_457.py BACKBONE WORKDIR; prints `REPORT {...}`. A GLiNER span model is built on the DeBERTa-v3
backbone folder (seeded heads, inflated so that the scores spread), saved to WORKDIR/gliner, then loaded from there
four ways: plain, the same model after `disentangled.accelerate`, built under `disentangled.enable()`, and built after
`disable()`. Each reports whether it is accelerated and its entities for one text and for a padded batch; the test
compares them.
"""

import json
import sys
from pathlib import Path

import torch
import transformers
from gliner import GLiNER, GLiNERConfig
from parity import inflate_weights  # beside this script

import disentangled
from disentangled.integrations.acceleration import is_accelerated

TEXT = "the quick brown fox ran under the tree in berlin and paris is the capital of france"
BATCH = [TEXT, "the dog sat on the mat", "where is the capital of italy? rome is the capital of italy"]
LABELS = ["city", "animal", "country"]

backbone, workdir = sys.argv[1:3]
folder = Path(workdir) / "gliner"
torch.manual_seed(0)
config = GLiNERConfig(model_name=backbone, max_width=4, hidden_size=32, max_len=64)
built = GLiNER.from_config(config, backbone_from_pretrained=True, local_files_only=True)
encoder = built.model.token_rep_layer.bert_layer.model
assert type(encoder) is transformers.DebertaV2Model, type(encoder)
backbone_names = {"token_rep_layer.bert_layer.model." + name for name, _ in encoder.named_parameters()}
heads = torch.nn.Module()  # GLiNER's own layers, inflated; the backbone keeps its checkpoint weights
for name, param in built.model.named_parameters():
    if name not in backbone_names:
        heads.register_parameter(name.replace(".", "__"), param)
inflate_weights(heads, seed=1)
built.save_pretrained(folder)


def predict(model) -> dict:
    return {
        "accelerated": is_accelerated(model),
        "text": model.predict_entities(TEXT, LABELS, threshold=0.0),
        "batch": model.inference(BATCH, LABELS, threshold=0.0, batch_size=len(BATCH)),
    }


def load():
    return GLiNER.from_pretrained(str(folder), local_files_only=True)


results = {}
model = load()
results["plain"] = predict(model)
results["accelerate"] = predict(disentangled.accelerate(model))
disentangled.enable()
results["enabled"] = predict(load())
disentangled.disable()
results["disabled"] = predict(load())
report = {"transformers": transformers.__version__, "results": results}
report["gliner"] = __import__("importlib.metadata").metadata.version("gliner")
print("REPORT " + json.dumps(report))
