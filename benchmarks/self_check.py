"""The Triton kernel's self-check on first use (`modeling/kernel_check.py`) for each kind of call a DeBERTa-v3 model
makes on this GPU: the verdicts, their figures, and what the check costs.

    python -m benchmarks.self_check --device cuda --out-dir $OUT
    TRITON_INTERPRET=1 python -m benchmarks.self_check --device cpu --interpret

Kinds: head size 64, c2p + p2c, a key mask; each dtype this GPU has tiles for; forward (no dropout) and training
(dropout 0.1); a length that is a multiple of 16 and one that is not. Each check runs from an empty verdict cache (a
temporary DISENTANGLED_CACHE), so what is timed is the check itself: its seconds (the compiles of the kernels for the
check's input included), beside the seconds of one attention call of the same kind at the model's shape (12 heads,
8 x 512 tokens, or 8 x 509; with --interpret 2 heads, 2 x 48 or 2 x 37, the size of the check's own input), timed
after it, warm. The check is paid once per kind
and GPU: a later process reads the verdict.

--interpret runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported), as the
tests do: the dispatcher is told the device is a CUDA GPU named "interpreter" of compute capability 9.0, with 16 x 16
tiles. The interpreter runs every program of a kernel in Python, so its seconds say how much work the check does
beside one call, not what either costs on a GPU.

Prints one row per kind; appends a record to benchmarks/records/self_check.jsonl (with --out-dir, to
OUT/records/self_check.jsonl, and the verdicts to OUT/self_checks.json). `device_check` runs it as its last stage.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.records import RECORDS, append_record
from disentangled.modeling import dispatch, kernel_check, sdpa_attention, triton_attention
from disentangled.modeling.disentangled_attention import PositionScores, RelativePositions, head_scaling

INTERPRETER_GPU = ("interpreter", (9, 0))
INTERPRETER_TILES = {"forward": (16, 16, 1, 1), "keys": (16, 16, 1, 1), "queries": (16, 16, 1, 1)}


@contextlib.contextmanager
def interpreted():
    """The dispatcher told that CPU tensors are on a CUDA GPU ("interpreter", 9.0) whose tiles are 16 x 16, as the
    tests run the kernel through Triton's interpreter."""
    facts, tiles = sdpa_attention.call_facts, dispatch.tiles_for
    gpu, capability = INTERPRETER_GPU

    def on_gpu(*args, **kwargs):
        return dataclasses.replace(facts(*args, **kwargs), device="cuda", gpu=gpu, capability=capability)

    sdpa_attention.call_facts, dispatch.tiles_for = on_gpu, lambda *args: dict(INTERPRETER_TILES)
    try:
        yield
    finally:
        sdpa_attention.call_facts, dispatch.tiles_for = facts, tiles


def gpu_facts(device: torch.device, interpret: bool) -> tuple[str, tuple[int, int]]:
    return INTERPRETER_GPU if interpret else triton_attention._device_facts(device)


def kinds(gpu: str, capability: tuple[int, int], lengths: tuple[int, int]) -> list[tuple[dispatch.Call, str | None]]:
    """(the call's facts, why the kernel does not take it or None) of each kind checked."""
    rows = []
    dtypes = (torch.float16, torch.float32) if capability < (8, 0) else (torch.bfloat16, torch.float16, torch.float32)
    for dtype in dtypes:
        for training in (False, True):
            for length in lengths:
                call = dispatch.Call(
                    device="cuda", dtype=dtype, head_size=64, length=length, gradients=training,
                    dropout=0.1 if training else 0.0, gpu=gpu, capability=capability,
                )  # fmt: skip
                with dispatch.switched(TRITON="1"):
                    decision = dispatch.decide(call)
                rows.append((call, None if decision.path == "triton" else decision.describe()))
    return rows


def attention_call(call: dispatch.Call, batch: int, heads: int, device: torch.device):
    """One call of sdpa_disentangled of this kind at [batch, heads, length, 64], v3's buckets; returns a function
    that runs it (forward, and backward for training)."""
    generator = torch.Generator().manual_seed(0)
    length, dim = call.length, call.head_size
    positions = RelativePositions.build(length, 256, 256, 512, device)

    def leaf(*shape, scale=1.0):
        tensor = (torch.randn(*shape, generator=generator) * scale).to(device, call.dtype)
        return tensor.requires_grad_(call.gradients)

    scaling = head_scaling(dim, 3)
    q, k, v = (leaf(batch, length, heads, dim) for _ in range(3))
    pos_key, pos_query = (leaf(heads, positions.width, dim, scale=scaling) for _ in range(2))
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=device)
    mask[-1, ..., length * 3 // 4 :] = False
    grad = torch.randn(batch, length, heads, dim, generator=generator).to(device, call.dtype)

    def run():
        with torch.set_grad_enabled(call.gradients):
            query, key, value = (t.transpose(1, 2) for t in (q, k, v))
            scores = PositionScores(query, key, pos_key, pos_query, None, positions)
            context, _ = sdpa_attention.sdpa_disentangled(None, query, key, value, mask, scaling, call.dropout, scores)
            if call.gradients:
                context.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def measure(device: torch.device, interpret: bool) -> list[dict]:
    gpu, capability = gpu_facts(device, interpret)
    lengths, batch, heads = ((48, 37), 2, 2) if interpret else ((512, 509), 8, 12)
    results = []
    with tempfile.TemporaryDirectory() as cache, interpreted() if interpret else contextlib.nullcontext():
        saved_cache = os.environ.get("DISENTANGLED_CACHE")
        os.environ["DISENTANGLED_CACHE"] = cache
        try:
            for call, refused in kinds(gpu, capability, lengths):
                row = {
                    "dtype": str(call.dtype).removeprefix("torch."),
                    "mode": "training" if call.gradients else "forward",
                    "length": call.length,
                }
                if refused:
                    results.append({**row, "verdict": "not the kernel's", "why": refused})
                    print(f"{row}: {refused}", flush=True)
                    continue
                tiles = dispatch.decide(dataclasses.replace(call, implementation="sdpa")).tiles
                tiles = INTERPRETER_TILES if interpret else tiles
                kind = dispatch.kind_of(call, tiles)
                kernel_check.forget()
                found = kernel_check.check(
                    kind, device, sdpa_attention.triton_disentangled, sdpa_attention.blocked_attention
                )
                run = attention_call(call, batch, heads, device)
                run()  # warm: compiled, and the verdict read
                start = time.perf_counter()
                run()
                call_seconds = time.perf_counter() - start
                worst = max(
                    (entry["error"] / entry["bound"] for _, entry in kernel_check._flat(found["figures"])),
                    default=float("nan"),
                )
                row.update(
                    verdict="passed" if found["passed"] else "FAILED",
                    check_seconds=found["seconds"],
                    call_seconds=round(call_seconds, 4),
                    worst_error_over_bound=round(worst, 4),
                    figures=found["figures"],
                    kind=found["kind"],
                )
                results.append(row)
                print(
                    f"{kind.describe()}: {row['verdict']} (worst error / bound {worst:.3f}); check "
                    f"{found['seconds']:.2f} s, a warm call at {batch}x{call.length}x{heads} heads {call_seconds:.3f} s",
                    flush=True,
                )
        finally:
            if saved_cache is None:
                os.environ.pop("DISENTANGLED_CACHE", None)
            else:
                os.environ["DISENTANGLED_CACHE"] = saved_cache
            kernel_check.forget()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--interpret", action="store_true", help="on the CPU through Triton's interpreter")
    parser.add_argument("--out-dir", type=Path, default=None, help="the verdicts and the record go here (a $OUT)")
    parser.add_argument("--commit", default=None, help="the commit measured, where the tree is not a git checkout")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.interpret and not triton_attention.INTERPRETED:
        raise ValueError("--interpret needs TRITON_INTERPRET=1 in the environment (set before triton is imported)")
    if not args.interpret and (device.type != "cuda" or not torch.cuda.is_available()):
        raise ValueError(f"self_check runs the Triton kernel on a CUDA GPU; --device {args.device} has none here")
    if not triton_attention.TRITON_AVAILABLE:
        raise ValueError("self_check needs triton: pip install triton")
    results = measure(device, args.interpret)
    gpu, capability = gpu_facts(device, args.interpret)
    figures = {"gpu": gpu, "capability": list(capability), "interpreted": args.interpret, "kinds": results}
    records = RECORDS
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "self_checks.json").write_text(json.dumps(figures, indent=1))
        records = args.out_dir / "records"
    append_record("self_check", figures, folder=records, commit=args.commit)
    failed = [row for row in results if row["verdict"] == "FAILED"]
    print(f"self-check: {len(results) - len(failed)} of {len(results)} kinds passed or not the kernel's")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
