"""One training step (forward + backward) of our eager and sdpa backends against transformers' DeBERTa-v2.

    python -m benchmarks.train_step [--batch 2 --length 512 --layers 2 --threads 1 --repeats 4]

Same DeBERTa-v3-base-shaped weights in all three, dropout as in training, runs interleaved; prints median
seconds per step (the first repeat is a warm-up) and each one's speed-up over transformers.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers

import disentangled
from benchmarks.run import V3_BASE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(**V3_BASE, num_hidden_layers=args.layers)
    models = {"transformers-deberta": transformers.DebertaV2Model(config).train()}
    with tempfile.TemporaryDirectory() as folder:
        models["transformers-deberta"].save_pretrained(folder)
        for implementation in ("eager", "sdpa"):
            model = disentangled.DisentangledModel.from_pretrained(folder, attn_implementation=implementation)
            models[f"ours-{implementation}"] = model.train()
    input_ids = torch.randint(1, config.vocab_size, (args.batch, args.length))
    attention_mask = torch.ones_like(input_ids)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            start = time.perf_counter()
            model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.pow(2).mean().backward()
            model.zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - start)
    reference = statistics.median(times["transformers-deberta"][1:])
    print(f"training step {args.batch}x{args.length}, {args.layers} layers, {args.threads} thread(s)")
    for name, values in times.items():
        median = statistics.median(values[1:])
        print(f"  {name:<22} {median:.3f} s   {reference / median:.2f}x transformers")


if __name__ == "__main__":
    main()
