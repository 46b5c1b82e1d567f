"""`disentangled build-kernels DIR`: the kernels' libraries for machines without a C compiler.

    disentangled build-kernels kernels/        # then, on the serving machine: DISENTANGLED_KERNELS=kernels/

Writes into DIR, for this machine kind and for aarch64 where the cross compiler (aarch64-linux-gnu-gcc) is on PATH:

- PyTorch's CPU kernels (`modeling/native.py`), one library per vector set of the machine kind (x86-64: AVX-512 and
  AVX2; aarch64: NEON), each built with its set's portable flags (`native.build_prebuilt`), named after the machine
  kind, the set and the kernels' version; native.py loads the one the processor's flags choose, from the folder
  DISENTANGLED_KERNELS names, or from the package's `prebuilt/` folder where no compiler is found (a wheel carries
  that folder: the manual's Getting started says how it is made);
- ONNX Runtime's operator library, as `export-onnx --kernel` writes it beside a graph (`ort_operator.write_library`:
  one file per machine kind, choosing its unit when ONNX Runtime loads it).

Each kind of library has its sidecar: `disentangled_kernels.json` (SIDECAR) says the kernels' version, each library's
machine kind, instruction set and flags and what it needs; `disentangled_attention.json` is the operator's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from ..modeling import native
from . import ort_operator

SIDECAR = "disentangled_kernels.json"
NEEDS = "the C library and libgomp.so.1 (OpenMP: the one torch ships where it ships it by that name, else the system's)"


def buildable() -> list[str]:
    """The machine kinds whose libraries this machine builds: its own, and each other kind whose cross compiler is
    on PATH."""
    return [kind for kind in native.MACHINE_SETS if kind == native.machine_kind() or ort_operator.compiler_for(kind)]


def write(
    folder: str | Path, machines: list[str] | None = None, sets: list[str] | None = None, onnxruntime: bool = True
) -> list[Path]:
    """The libraries for each of `machines` (default: `buildable()`) written into `folder` with the sidecar: PyTorch's
    kernels for each of the kind's vector sets (or those of `sets`) and, with `onnxruntime`, the operator library. Libraries of other versions of the kernels for the same
    machine and set are removed. A ValueError says why where this machine's kind cannot be built."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    machines = buildable() if machines is None else machines
    sidecar = folder / SIDECAR
    described = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
    version = native.kernels_version()
    libraries = described.get("libraries", {}) if described.get("version") == version else {}
    written = []
    for machine in machines:
        if machine not in native.MACHINE_SETS:
            raise ValueError(f"the kernels are built for {' and '.join(native.MACHINE_SETS)}, not {machine}")
        compiler = ort_operator.compiler_for(machine)
        if compiler is None:
            wanted = "cc, gcc or clang" if machine == native.machine_kind() else ort_operator.CROSS_COMPILERS[machine]
            raise ValueError(
                f"no C compiler for {machine} ({wanted}) on PATH: install one, or build on a machine with it"
            )
        for name in [name for name in native.MACHINE_SETS[machine] if sets is None or name in sets]:
            try:
                library = native.build_prebuilt(folder, machine, name, compiler)
            except subprocess.CalledProcessError as error:
                detail = error.stderr.decode(errors="replace")[-300:]
                raise ValueError(f"compiling the {machine} {name} kernels failed: {detail}") from error
            for stale in folder.glob(native.prebuilt_name(machine, name, "*")):
                if stale != library:
                    stale.unlink()
            libraries[library.name] = {
                "machine": machine,
                "instruction_set": name,
                "flags": " ".join(native.PORTABLE_FLAGS[name]) or "none beyond the machine's own",
                "needs": NEEDS,
            }
            written.append(library)
        if onnxruntime:
            written.append(ort_operator.write_library(folder, machine))
    described = {
        "kernels": f"{native.SOURCE.name}: PyTorch's CPU kernels (modeling/native.py)",
        "version": version,
        "libraries": libraries,
        "chosen": "when the first model runs, the best set the processor runs (DISENTANGLED_CPU_ISA names another)",
        "use": f"{native.KERNELS}={folder.resolve()}",
    }
    sidecar.write_text(json.dumps(described, indent=2) + "\n")
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="where to write the libraries and their sidecars (made if absent)")


def run(args: argparse.Namespace) -> int:
    machines = buildable()
    for path in write(args.folder, machines):
        print(f"wrote {path}")
    for kind in native.MACHINE_SETS:
        if kind not in machines:
            print(
                f"no {kind} libraries: its cross compiler ({ort_operator.CROSS_COMPILERS.get(kind, 'a cross compiler')}) is not on PATH"
            )
    print(f"kernels version {native.kernels_version()}; where no compiler is: {native.KERNELS}={args.folder}")
    return 0
