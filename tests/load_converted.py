"""Child process: load converted folders the way a Hub user does and write their outputs.

usage: load_converted.py MANIFEST.json OUTPUT.safetensors
The manifest lists {"name", "folder", "auto_class", "inputs"}; inputs are a safetensors file of the batch.
Also loads each folder's tokenizer with plain AutoTokenizer when it has one: with trust_remote_code=False (between
printed markers, so the parent can check that no prompt appeared) and without the argument.
"""

import json
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

manifest_path, output_path = sys.argv[1:3]
manifest = json.load(open(manifest_path))
results, report = {}, {"transformers": transformers.__version__, "cases": {}}
for case in manifest:
    auto_class = getattr(transformers, case["auto_class"])
    model = auto_class.from_pretrained(case["folder"], trust_remote_code=True).eval()
    module = type(model).__module__
    assert module.startswith("transformers_modules."), module
    inputs = load_file(case["inputs"])
    with torch.no_grad():
        output = model(**inputs)
    for name in ("last_hidden_state", "logits", "start_logits", "end_logits"):
        value = getattr(output, name, None)
        if value is not None:
            results[f"{case['name']}/{name}"] = value.float().contiguous()
    info = {"module": module, "class": type(model).__name__}
    if case.get("text"):
        print(f"TOKENIZER {case['name']} BEGIN", flush=True)  # nothing may be printed in between: no prompt
        declined = transformers.AutoTokenizer.from_pretrained(case["folder"], trust_remote_code=False)
        print(f"TOKENIZER {case['name']} END", flush=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(case["folder"])
        info["tokenizer"] = type(tokenizer).__name__
        info["ids"] = tokenizer(case["text"])["input_ids"]
        info["ids_declined"] = declined(case["text"])["input_ids"]
    report["cases"][case["name"]] = info
save_file(results, output_path)
print("REPORT " + json.dumps(report))
