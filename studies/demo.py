"""The demo's figures over seeds, as a record: what `disentangled demo --seed S` prints, seed by seed.

    python -m studies.demo                    # seeds 0, 1, 2
    python -m studies.demo --seeds 0 1 2 3 4

Each seed runs the command as a user does (a fresh process, the default budget) and keeps: the accuracy on masked
tokens the pretraining reached, the fill-mask answer to "paris is the capital of [MASK]." and its probability,
the accuracy after fine-tuning from the stand-in and after the same fine-tuning from random weights, the wall time
and the CPU time. Appends a record to benchmarks/records/demo.jsonl; `python -m benchmarks.report` writes the table
of docs/pretraining.md from it.
"""

from __future__ import annotations

import argparse
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

PATTERNS = {
    "masked_accuracy": r"accuracy on masked tokens \d\.\d+ -> (\d\.\d+)",
    "paris": r"fill-mask  'paris is the capital of \[MASK\]\.': '(\w+)' (\d\.\d+)",
    "fine_tuned": r"accuracy after fine-tuning: +(\d\.\d+)",
    "from_random": r"the same fine-tuning from random weights: (\d\.\d+)",
}


def run_seed(seed: int) -> dict:
    """One `disentangled demo --seed SEED` in a fresh process: its figures, wall time and CPU time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "disentangled.cli", "demo", "--seed", str(seed)], capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"disentangled demo --seed {seed} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return {
        "seed": seed,
        **parse(done.stdout),
        "wall_s": wall,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
    }


def parse(output: str) -> dict:
    """The figures of one demo run from what it printed."""
    found = {name: re.search(pattern, output) for name, pattern in PATTERNS.items()}
    missing = [name for name, match in found.items() if match is None]
    if missing:
        raise RuntimeError(f"no {', '.join(missing)} in the demo's output")
    return {
        "masked_accuracy": float(found["masked_accuracy"][1]),
        "paris_answer": found["paris"][1],
        "paris_probability": float(found["paris"][2]),
        "fine_tuned": float(found["fine_tuned"][1]),
        "from_random": float(found["from_random"][1]),
    }


def markdown(figures: dict) -> str:
    lines = [
        "| seed | accuracy on masked tokens | 'paris is the capital of [MASK].' | fine-tuned from the stand-in "
        "| from random weights | wall time | CPU time |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in figures["seeds"]:
        lines.append(
            f"| {row['seed']} | {row['masked_accuracy']:.3f} | {row['paris_answer']} {row['paris_probability']:.3f} "
            f"| {row['fine_tuned']:.3f} | {row['from_random']:.3f} | {row['wall_s']:.0f} s | {row['cpu_s']:.0f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--records", help="the records folder (default benchmarks/records)")
    args = parser.parse_args(argv)
    figures = {"seeds": []}
    for seed in args.seeds:
        figures["seeds"].append(run_seed(seed))
        print(figures["seeds"][-1], flush=True)
    print(markdown(figures))
    from benchmarks.records import RECORDS, append_record

    command = ["python", "-m", "studies.demo", *(argv if argv is not None else sys.argv[1:])]
    append_record("demo", figures, command=command, folder=Path(args.records) if args.records else RECORDS)
    return figures


if __name__ == "__main__":
    main()
