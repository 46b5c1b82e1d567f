"""Where the time goes: `torch.profiler` operator table for one model and case, as quoted in README's profiles.

    python -m benchmarks.profile --model ours-sdpa --batch 4 --length 512               # inference
    python -m benchmarks.profile --model transformers-deberta --batch 2 --length 512 --train --threads 2
    python -m benchmarks.profile --model ours-sdpa --batch 1 --length 2048 --layers 2 --threads 2 --shapes
    python -m benchmarks.profile --model ours-sdpa --batch 4 --length 512 --layers 2 --threads 2 --dtype bfloat16

Same models and inputs as `benchmarks.run` (v3-base shape, random weights, the last row padded to 3/4); one
warm-up call, then one profiled call (`--dtype bfloat16`: inference on the model cast to bfloat16, a training step
under CPU autocast, as `benchmarks.run` times them); prints the operators sorted by their own CPU time (with `--shapes`, one row per
operator and input shapes, which tells a block's SDPA call from a far part's).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.run import build_models, inputs_for, time_once

MODELS = ["ours-eager", "ours-sdpa", "ours-flex_attention", "transformers-deberta", "bert-sdpa"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="ours-sdpa")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train", action="store_true", help="a training step (forward + backward, dropout on)")
    parser.add_argument("--rows", type=int, default=20, help="operators to print")
    parser.add_argument("--shapes", action="store_true", help="one row per operator and input shapes")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    backend = args.model.removeprefix("ours-")
    with tempfile.TemporaryDirectory() as folder:
        backends = [backend] if args.model.startswith("ours-") else []
        dtype = getattr(torch, args.dtype)
        model = build_models(args.layers, Path(folder), backends, args.train, dtype=dtype)[args.model]
    inputs = inputs_for(args.batch, args.length, padded=True)
    time_once(model, inputs, args.train, dtype)  # warm-up (and compilation, for flex)
    with torch.profiler.profile(record_shapes=args.shapes) as profile:
        seconds = time_once(model, inputs, args.train, dtype)
    case = f"{'train' if args.train else 'infer'} {args.batch}x{args.length}"
    print(
        f"{args.model}, {case}, {args.layers} layer(s), {args.threads} thread(s), {args.dtype}: {seconds:.3f} s profiled"
    )
    averages = profile.key_averages(group_by_input_shape=args.shapes)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_shapes_column_width=70))


if __name__ == "__main__":
    main()
