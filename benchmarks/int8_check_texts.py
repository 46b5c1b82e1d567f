"""`export-onnx --quantize int8` checked on real text against the same check on generated token ids.

    python -m benchmarks.int8_check_texts            # a topic classifier, 300 steps; about 10 minutes on 2 cores

Real text that ships with Python: the docstrings of the standard library (`disentangled.demo.data`), labelled by
package (asyncio, email, tkinter, xml; chance 0.25), split by source file so that held-out texts come from files
never trained on. A classifier (DeBERTa-v3 layout, hidden 256, 4 heads, `--layers` layers, a SentencePiece
vocabulary trained on the training texts) is fine-tuned here; then `disentangled export-onnx --quantize int8` runs
twice on its folder: with `--check-texts` (the held-out texts, one a line) and without (random token ids). Prints
both checks' output and the held-out accuracy of float32 PyTorch and of the int8 graph; appends a record to
benchmarks/records/int8_check_texts.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

import torch

import disentangled
from benchmarks import machine, records
from disentangled import cli
from disentangled.demo.data import python_docs_split, python_docs_topics, train_sentencepiece
from disentangled.integrations.tokenization import tokenizer_from_spm
from disentangled.serving import onnx_export


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help="a smoke run: print, record nothing")
    args = parser.parse_args(argv)
    print(machine.describe(), flush=True)
    training, held_out = python_docs_split()
    train_rows = python_docs_topics(training, seed=args.seed)
    test_rows = python_docs_topics(held_out, seed=args.seed)
    labels = sorted({row["label"] for row in train_rows})
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        tokenizer = tokenizer_from_spm(
            train_sentencepiece(folder / "spm", [row["text"] for row in train_rows], vocab_size=2000),
            check_text="Return a new event loop.",
        )
        torch.manual_seed(args.seed)
        config = disentangled.DisentangledConfig(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            hidden_size=256,
            num_attention_heads=4,
            intermediate_size=1024,
            num_hidden_layers=args.layers,
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={label: i for i, label in enumerate(labels)},
        )
        model = disentangled.DisentangledForSequenceClassification(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
        generator = torch.Generator().manual_seed(args.seed)
        model.train()
        for _ in range(args.steps):
            rows = [train_rows[i] for i in torch.randint(len(train_rows), (16,), generator=generator).tolist()]
            encoded = tokenizer(
                [r["text"] for r in rows], padding=True, truncation=True, max_length=128, return_tensors="pt"
            )
            target = torch.tensor([labels.index(r["label"]) for r in rows])
            loss = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], labels=target).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        model.save_pretrained(folder / "classifier")
        tokenizer.save_pretrained(folder / "classifier")
        texts = folder / "held-out.txt"
        texts.write_text("\n".join(row["text"] for row in test_rows) + "\n")
        outputs = {}
        for name, extra in (("check-texts", ["--check-texts", str(texts)]), ("generated", [])):
            captured = io.StringIO()
            command = ["export-onnx", str(folder / "classifier"), str(folder / f"{name}.onnx"), "--quantize", "int8"]
            with contextlib.redirect_stdout(captured):
                status = cli.main([*command, *extra])
            outputs[name] = {"status": status, "output": captured.getvalue()}
            print(f"$ disentangled {' '.join(command[:1] + ['CLASSIFIER', f'{name}.onnx'] + command[3:] + extra[:1])}")
            print(captured.getvalue(), flush=True)
        truth = torch.tensor([labels.index(row["label"]) for row in test_rows])
        batches = onnx_export.text_batches(folder / "classifier", config, [row["text"] for row in test_rows], 10**6)
        (inputs,) = batches  # one batch, sorted by length: the order of `text_batches`
        order = sorted(range(len(test_rows)), key=lambda i: len(test_rows[i]["text"]), reverse=True)
        with torch.no_grad():
            reference = model(**inputs).logits.argmax(-1)
        accuracy = {"float32": (reference == truth[order]).float().mean().item()}
        if outputs["check-texts"]["status"] == 0:
            session = onnx_export.session(folder / "check-texts.onnx")
            (logits,) = session.run(["logits"], {k: v.numpy() for k, v in inputs.items()})
            accuracy["int8"] = (torch.from_numpy(logits).argmax(-1) == truth[order]).float().mean().item()
    print(f"held-out accuracy ({len(test_rows)} texts, 4 topics): {accuracy}")
    figures = {"layers": args.layers, "steps": args.steps, "held_out_texts": len(test_rows), "accuracy": accuracy}
    figures["checks"] = outputs
    command = ["python", "-m", "benchmarks.int8_check_texts", *(argv if argv is not None else sys.argv[1:])]
    if args.no_record:
        return figures
    record = records.append_record("int8_check_texts", figures, command=command)
    print(f"appended a record (commit {record['commit']})")
    return figures


if __name__ == "__main__":
    main()
