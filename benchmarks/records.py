"""Benchmark records: every run of a benchmark (and of a study, `studies/`) appends one JSON line to
`benchmarks/records/<benchmark>.jsonl`.

A record says what ran where: the benchmark's name, the UTC time, the processor and its vector extensions (AMX
included), the instruction set our CPU kernels used and why (the processor's best, or forced by
DISENTANGLED_CPU_ISA; `native.instruction_set`) and whether they built, torch's CPU capability and threads, the torch
and transformers versions, the commit (with `+dirty` when the tree had changes), everything else `disentangled env`
reports (under "environment": versions, the compiled kernels, GPUs and tiles, switches, self-check verdicts, the path
of each kind of call), the command line, and the benchmark's own figures (any JSON value). The manual's tables and
figures are generated from these records (`python -m benchmarks.report`), never typed by hand.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from disentangled import environment

RECORDS = Path(__file__).resolve().parent / "records"


CHECKOUT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's commit, `+dirty` when tracked files other than the records differ from it (a run appends to
    the records, which says nothing of the code measured); "unknown" outside a git checkout."""
    return environment.commit(CHECKOUT)


def machine_fields() -> dict:
    """Where a record was measured: `disentangled env`'s facts (`environment.record_fields`): processor, extensions,
    CPU capability, threads, library versions and commit at the top level, and everything else (the compiled kernel,
    the GPUs and their tiles, the switches, the self-check's verdicts, the path of each kind of call) under
    "environment"."""
    return environment.record_fields(CHECKOUT)


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
