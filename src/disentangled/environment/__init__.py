"""`disentangled env`: what a bug report needs to say about the machine, and what every benchmark record says.

    disentangled env            # or: python -m disentangled env
    disentangled env --json

`gather.py` gathers the facts (versions, processor, the CPU kernels' library and where it comes from, GPUs and the
Triton tiles, switches, the self-check's verdicts, the attention path of each kind of call with its reason);
`report.py` prints them. `benchmarks/records.py` writes `record_fields()` into every record.
"""

from .gather import (
    EXTENSIONS,
    REPORTED_CALL,
    commit,
    cpu,
    describe,
    devices,
    facts,
    gpus,
    native,
    paths,
    processor,
    record_fields,
    self_checks,
    switches,
    versions,
)
from .report import add_arguments, render, run

__all__ = [
    "EXTENSIONS",
    "REPORTED_CALL",
    "add_arguments",
    "commit",
    "cpu",
    "describe",
    "devices",
    "facts",
    "gpus",
    "native",
    "paths",
    "processor",
    "record_fields",
    "render",
    "run",
    "self_checks",
    "switches",
    "versions",
]
