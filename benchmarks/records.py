"""Benchmark records: every run of a benchmark (and of a study, `studies/`) appends one JSON line to
`benchmarks/records/<benchmark>.jsonl`.

A record says what ran where: the benchmark's name, the UTC time, the processor and its vector extensions (AMX
included), the instruction set our CPU kernels used and why (the processor's best, or forced by
DISENTANGLED_CPU_ISA; `native.instruction_set`) and whether they built, torch's CPU capability and threads, the torch
and transformers versions, the commit (with `+dirty` when the tree had changes), the command line, and the
benchmark's own figures (any JSON value). The manual's tables and
figures are generated from these records (`python -m benchmarks.report`), never typed by hand.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from .machine import processor

RECORDS = Path(__file__).resolve().parent / "records"


def commit() -> str:
    """The checkout's commit, `+dirty` when tracked files other than the records differ from it (a run appends to
    the records, which says nothing of the code measured); "unknown" outside a git checkout."""
    top = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=top, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/records"],
            cwd=top,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def instruction_set_fields() -> dict:
    """Our CPU kernels in this process (`native.instruction_set`): the vector set, why it was chosen, whether
    DISENTANGLED_CPU_ISA forced it, and whether the kernels built (else the pure-PyTorch path ran, and why)."""
    from disentangled.modeling import native

    name, reason = native.instruction_set()
    built = native.available()
    fields = {"name": name, "reason": reason, "forced": "DISENTANGLED_CPU_ISA" in reason, "built": built}
    return fields | ({} if built else {"why_not": native.why_unavailable()})


def machine_fields() -> dict:
    """Where a record was measured: processor, extensions, the CPU kernels' instruction set, CPU capability, threads
    and library versions."""
    name, extensions = processor()
    return {
        "processor": name,
        "extensions": extensions,
        "instruction_set": instruction_set_fields(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit(),
    }


def append_record(
    benchmark: str,
    figures: dict,
    *,
    command: list[str] | None = None,
    folder: Path = RECORDS,
    commit: str | None = None,
) -> dict:
    """Append one record for `benchmark` (a file name stem such as "run" or "pretrain") and return it. `commit`
    names the commit measured where the tree is not a git checkout (a copy on a device machine)."""
    if not benchmark.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"benchmark name {benchmark!r} must be letters, digits, '-' or '_' (it names a file)")
    record = {
        "benchmark": benchmark,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **machine_fields(),
        **({"commit": commit} if commit else {}),
        "command": " ".join(
            command if command is not None else ["python", "-m", f"benchmarks.{benchmark}"] + sys.argv[1:]
        ),
        "figures": figures,
    }
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{benchmark}.jsonl").open("a", encoding="utf-8") as out:
        out.write(json.dumps(record, sort_keys=False) + "\n")
    return record


def read_records(benchmark: str, folder: Path = RECORDS) -> list[dict]:
    """Every record of `benchmark`, oldest first (an empty list when it has none)."""
    path = folder / f"{benchmark}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def latest_per_processor(records: list[dict]) -> dict[str, dict]:
    """processor name -> its newest record (records are appended in time order)."""
    latest = {}
    for record in records:
        latest[record["processor"]] = record
    return latest
