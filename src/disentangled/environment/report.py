"""`disentangled env` (`--json`): the facts `gather.py` gathers, printed as text to paste into a bug report, or
as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from .gather import facts


def render(found: dict) -> str:
    """The report as text, to paste into an issue."""
    lines = ["## Versions"]
    versions_ = found["versions"]
    lines += [f"- {name}: {value}" for name, value in versions_.items() if value is not None]
    cpu_ = found["cpu"]
    lines += [
        "",
        "## Processor",
        f"- {cpu_['name']} ({cpu_['machine']})",
        f"- extensions: {' '.join(cpu_['extensions']) or 'none of those listed'}; AMX: {' '.join(cpu_['amx']) or 'no'}",
        f"- torch's CPU capability: {cpu_['torch_capability']}; {cpu_['cpus']} CPUs, {cpu_['usable_cpus']} usable, "
        f"torch threads {cpu_['torch_threads']}",
    ]
    native_ = found["native"]
    lines += [
        "",
        "## Compiled CPU kernels",
        f"- instruction set: {native_['instruction_set']} ({native_['instruction_set_reason']})",
    ]
    if native_["built"]:
        lines.append(
            f"- built; fused attention in float32: {'yes' if native_['fused_float32'] else 'no'}, in bfloat16: "
            f"{'yes' if native_['fused_bfloat16'] else 'no (needs AMX and AVX512-BF16)'}"
        )
        lines.append(f"- library ({native_['library_from']}): {native_['library']}")
    else:
        lines.append(f"- not built: {native_['why_not']}")
    lines += ["", "## GPUs"]
    if not found["gpus"]:
        lines.append("- none (torch sees no CUDA GPU)")
    for gpu in found["gpus"]:
        lines.append(
            f"- {gpu['index']}: {gpu['name']}, compute capability {gpu['capability'][0]}.{gpu['capability'][1]}, "
            f"{gpu['memory_gib']} GiB"
        )
        for key, entry in gpu["tiles"].items():
            if entry["tiles"] is None:
                lines.append(f"  - {key}: no tiles (sdpa serves these calls)")
            else:
                tiles = ", ".join(f"{kernel} {'x'.join(map(str, tile))}" for kernel, tile in entry["tiles"].items())
                lines.append(f"  - {key}: {tiles} (from the {entry['from']})")
    switches_ = found["switches"]
    lines += ["", "## Switches"]
    lines += [f"- {name}={value}" for name, value in switches_["environment"].items() if value is not None]
    lines.append("- " + ", ".join(f"dispatch.{name} = {value!r}" for name, value in switches_["module"].items()))
    lines.append(f"- debug logger: {switches_['debug_logger']}")
    lines += ["", "## Triton self-check verdicts on this machine"]
    if not found["self_checks"]:
        lines.append("- none")
    for verdict in found["self_checks"]:
        kind = verdict["kind"]
        described = (
            f"{kind['gpu']} {kind['dtype']} head size {kind['head_size']} "
            f"{'training' if kind['training'] else 'forward'}{' dropout' if kind['dropout'] else ''}"
            f"{' mask' if kind['mask'] else ''} {'+'.join(kind['terms'])}"
        )
        state = "passed" if verdict["passed"] else "FAILED"
        stale = "" if verdict["current"] else " (made with other versions: not used here)"
        lines.append(f"- {described}: {state}{stale}")
    lines += ["", "## Attention paths (a DeBERTa-v3-base call: 12 heads of 64, 512 tokens, key mask)", ""]
    lines += ["| device | dtype | mode | path | why |", "|---|---|---|---|---|"]
    for row in found["paths"]:
        why = row["reason"] + "".join(f"; not {entry}" for entry in row["not"])
        lines.append(f"| {row['device']} | {row['dtype']} | {row['mode']} | {row['path']} | {why} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")


def run(args: argparse.Namespace) -> int:
    found = facts()
    print(json.dumps(found, indent=1, default=str) if args.json else render(found))
    return 0


if __name__ == "__main__":  # pragma: no cover - `disentangled env` is the entry point
    parser = argparse.ArgumentParser(prog="disentangled env")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
