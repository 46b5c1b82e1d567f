"""Child script (package not importable, see isolated.py): folders saved from accelerated models, loaded by plain
transformers as any user would.

usage: accelerated_folder_child.py CASES.json; each case holds a folder, input_ids and attention_mask. Prints
`REPORT {"transformers", "outputs": [{"class", "module", "logits", "last_hidden_state"}, ...]}`.
"""

import json
import sys

import torch
import transformers

outputs = []
for case in json.load(open(sys.argv[1])):
    model = transformers.AutoModelForSequenceClassification.from_pretrained(case["folder"]).eval()
    batch = {name: torch.tensor(case[name]) for name in ("input_ids", "attention_mask")}
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    outputs.append(
        {
            "class": type(model).__name__,
            "module": type(model).__module__,
            "logits": out.logits.tolist(),
            "last_hidden_state": out.hidden_states[-1].tolist(),
        }
    )
print("REPORT " + json.dumps({"transformers": transformers.__version__, "outputs": outputs}))
