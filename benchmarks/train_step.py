"""One training step (forward + backward) of ours against transformers' DeBERTa-v2 and a same-size BERT.

    python -m benchmarks.train_step                                   # 2x512, 2 layers: eager, sdpa, transformers
    python -m benchmarks.train_step --cases 4x128 2x512 --threads 2 --no-eager --baseline c965533
    python -m benchmarks.train_step --cases 2x512 --threads 2 --no-eager --baseline c965533 --processes 5
    python -m benchmarks.train_step --cases 2x512 --threads 2 --no-eager --baseline c965533 --back-to-back
    python -m benchmarks.train_step --cases 2x512 --threads 2 --no-eager --baseline c965533 --dtype bfloat16
    python -m benchmarks.train_step --cases 4x128 2x512 --threads 2 --no-eager --pytorch-dropout --processes 3

The models, weights and inputs of `benchmarks.run` (v3-base shape, dropout as in training, the last row padded to
3/4), run interleaved (or, with `--back-to-back`, each model's steps one after another, as when one model trains
alone in a process); prints median seconds per step, each one's ratio to BERT-sdpa, and the median minor page
faults per step (first touches of freshly mapped memory, which glibc returns to the system and maps again between
steps). With `--baseline REV`, the same sdpa model also runs with `sdpa_disentangled` as it was at git revision
REV (that commit's `modeling/sdpa_attention.py`, loaded beside this one), so that a change to the training
path is timed against what it replaced in the same process; its gradients are checked against the model's to 1e-4
first (2e-2 in bfloat16). `--dtype bfloat16` runs each step under CPU autocast, as `benchmarks.run` does.
`--processes N` runs the comparison in N fresh processes and prints each ratio's median over them with its range.
`--pytorch-dropout` also times the sdpa model with dropout's decisions drawn by PyTorch's generator
(`dispatch.DROPOUT_KERNEL = False`), not by the compiled kernel.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import machine
from benchmarks.cpu_inference import baseline_backends, held_mib
from benchmarks.run import build_models, in_fresh_processes, inputs_for, print_ratio_medians, time_once
from disentangled.modeling import dispatch, modeling_disentangled, sdpa_attention

PYTORCH_DROPOUT = "ours-sdpa, PyTorch's dropout draws"


def gradients(model, inputs, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = model(**inputs).last_hidden_state.float().square().mean()
    loss.backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}


def timings(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """{case: {model: median seconds per step}}, printed as a table per case."""
    with tempfile.TemporaryDirectory() as folder:
        models = build_models(args.layers, Path(folder), ["sdpa"] if args.no_eager else ["eager", "sdpa"], True)
        baseline = (
            baseline_backends(args.baseline, Path(folder), "sdpa_attention.py").sdpa_disentangled
            if args.baseline
            else None
        )
    ours = models["ours-sdpa"]
    steps = dict(models)
    if args.pytorch_dropout:
        steps[PYTORCH_DROPOUT] = ours
    if baseline is not None:
        steps[f"ours-sdpa at {args.baseline}"] = ours
    functions = modeling_disentangled.DISENTANGLED_ATTENTION_FUNCTIONS

    dtype = getattr(torch, args.dtype)

    def step(name: str, inputs) -> tuple[float, int]:
        """Seconds of one step of `name`, and the minor page faults it took (first touches of fresh memory)."""
        functions["sdpa"] = baseline if name.startswith("ours-sdpa at") else sdpa_attention.sdpa_disentangled
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with dispatch.switched(DROPOUT_KERNEL=name != PYTORCH_DROPOUT):
            seconds = time_once(steps[name], inputs, True, dtype)
        return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    medians = {}
    try:
        for case in args.cases:
            batch, length = (int(part) for part in case.split("x"))
            inputs = inputs_for(batch, length, padded=True)
            if baseline is not None:  # the same gradients (dropout off: its draws differ from one path to the other)
                ours.eval()
                expected = gradients(ours, inputs, dtype)
                functions["sdpa"] = baseline
                actual = gradients(ours, inputs, dtype)
                functions["sdpa"] = sdpa_attention.sdpa_disentangled
                ours.train()
                tolerance = 1e-4 if dtype == torch.float32 else 2e-2
                for name, grad in expected.items():
                    scale = grad.abs().max().item()
                    if not torch.allclose(actual[name], grad, rtol=tolerance, atol=tolerance * scale):
                        raise SystemExit(f"at {args.baseline}, the gradient of {name} differs at {case}")
            ours.release_workspace()  # what this case's steps keep, below
            runs = {name: [] for name in steps}  # (seconds, page faults) of each step
            if args.back_to_back:  # each model's steps one after another, as when one model trains alone
                for name in steps:
                    step(name, inputs)  # warm-up
                    runs[name] = [step(name, inputs) for _ in range(args.repeats)]
            else:
                for name in steps:  # warm-up
                    step(name, inputs)
                for _ in range(args.repeats):
                    for name in steps:
                        runs[name].append(step(name, inputs))
            medians[case] = {name: statistics.median(seconds for seconds, _ in values) for name, values in runs.items()}
            bert = medians[case]["bert-sdpa"]
            print(f"\n| train {case} | median | / bert-sdpa | page faults per step |\n|---|---|---|---|")
            for name, median in medians[case].items():
                faults = statistics.median(faults for _, faults in runs[name])
                print(f"| {name} | {median * 1e3:.0f} ms | {median / bert:.2f} | {faults:.0f} |")
            print(f"\nBuffers ours-sdpa keeps between steps at {case}: {held_mib(ours):.0f} MiB")
    finally:
        functions["sdpa"] = sdpa_attention.sdpa_disentangled
    return medians


def in_processes(args: argparse.Namespace, argv: list[str]) -> None:
    """The timings in `args.processes` fresh processes; per case, the median over them of each model's ratio to
    BERT-sdpa and to ours-sdpa (measured in the same process), with the range."""
    child = [*argv, "--processes", "1", "--child-results"]
    runs = in_fresh_processes("benchmarks.train_step", child, args.processes, lambda path: json.loads(path.read_text()))
    print(f"\n{args.processes} processes: medians over the processes (lowest-highest) of each ratio")
    print_ratio_medians(runs, ("bert-sdpa", "ours-sdpa"), case_label="train ")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["2x512"], help="BATCHxLENGTH")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-eager", action="store_true", help="leave out our eager backend")
    parser.add_argument("--baseline", metavar="REV", help="also time sdpa_disentangled as at this git revision")
    parser.add_argument("--processes", type=int, default=1, help="run the timings in N fresh processes")
    parser.add_argument(
        "--back-to-back", action="store_true", help="each model's steps one after another, not interleaved"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16: CPU autocast")
    parser.add_argument(
        "--pytorch-dropout",
        action="store_true",
        help="also time ours-sdpa with dropout's decisions by PyTorch's generator",
    )
    parser.add_argument("--child-results", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes < 1:
        raise SystemExit(f"--processes {args.processes}: give 1 or more")
    for case in args.cases:
        if len(case.split("x")) != 2 or not all(part.isdigit() for part in case.split("x")):
            raise SystemExit(f"--cases {case}: give BATCHxLENGTH, as 2x512")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.processes > 1:
        in_processes(args, argv if argv is not None else sys.argv[1:])
        return
    order = "back to back" if args.back_to_back else "interleaved"
    print(f"{machine.describe()}; {args.layers} layers; {args.dtype}; median of {args.repeats} steps, {order}")
    medians = timings(args)
    if args.child_results:
        args.child_results.write_text(json.dumps(medians))


if __name__ == "__main__":
    main()
