"""Child script (transformers 4.57, package not importable): the `question-answering` pipeline's answers.

usage: qa_pipeline_457.py FOLDER CASES.json; prints `REPORT {"transformers": ..., "answers": [...]}`.
Each case is {"question", "context", "kwargs"}; answers are always lists (top_k=1 included).
"""

import json
import sys

import transformers

folder, cases_file = sys.argv[1:3]
qa = transformers.pipeline("question-answering", model=folder, trust_remote_code=True)
assert type(qa.model).__module__.startswith("transformers_modules"), type(qa.model).__module__
answers = []
for case in json.load(open(cases_file)):
    result = qa(question=case["question"], context=case["context"], **case["kwargs"])
    answers.append(result if isinstance(result, list) else [result])
print("REPORT " + json.dumps({"transformers": transformers.__version__, "answers": answers}))
