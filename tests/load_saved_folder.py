"""Child script (package not importable): load a saved classifier folder as a Hub user would, model and tokenizer.

usage: load_saved_folder.py FOLDER TEXTS.json; prints `REPORT {"transformers", "tokenizer", "ids", "logits"}`.
"""

import json
import sys

import torch
import transformers

folder, texts_file = sys.argv[1:3]
texts = json.load(open(texts_file))
tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
with torch.no_grad():
    logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
report = {
    "transformers": transformers.__version__,
    "tokenizer": type(tokenizer).__name__,
    "ids": [tokenizer(text)["input_ids"] for text in texts],
    "logits": logits.tolist(),
}
print("REPORT " + json.dumps(report))
