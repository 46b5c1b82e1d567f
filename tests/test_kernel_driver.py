"""Every CPU kernel on every instruction set, ARM's without ARM hardware: a C driver (`kernel_driver.c`) runs calls
recorded here, on inputs written here, against expected outputs computed here with PyTorch.

The calls are native.py's own: its wrappers build the argument structs and a `Recording` stands in for the compiled
library, keeping each struct (pointers as places in the tensors' storages) where the library would run it. The
expected outputs are the formulas of tests/test_native.py and tests/test_fused_attention.py: the bias (both terms or
one, float32 and bfloat16, bit for bit: sums in float32, rounded once), CPU training's bias with the keys reversed and
its gradient summed into the tables (float32 within 1e-5; bfloat16 within one rounding), and the fused attention in
float32 (within 1e-5), with and without key masks, ragged tails, tiles beyond the buckets' reach, log buckets and
clipped distances; and dropout's decisions (byte for byte, against the formula in numpy). The driver is cross-compiled for aarch64 (Debian's gcc-aarch64-linux-gnu) and run under
qemu-aarch64 (qemu-user): the NEON build; and built natively for AVX2 (forced) and AVX-512 where the processor has it.
The source also builds warning-free (-Wall -Wextra -Werror) with gcc and clang for every set. A target whose compiler
or emulator is missing is skipped with the reason (.ci/run installs them).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from test_fused_attention import SCALE, formula
from test_fused_attention import inputs as attention_inputs
from test_native import POSITIONS, band_layout, banded, hankel_reference, reference, splitmix64_keep, tables

from disentangled.modeling import native
from disentangled.modeling.disentangled_attention import RelativePositions
from disentangled.modeling.workspace import int32_column
from disentangled.serving import ort_operator

DRIVER = Path(__file__).with_name("kernel_driver.c")
KERNELS = {"position_bias": 0, "hankel_bias": 1, "hankel_bias_backward": 2, "attend": 3, "keep_mask": 4}
AARCH64_SYSROOT = Path("/usr/aarch64-linux-gnu")


class Recording:
    """Stands in for native.py's compiled library: each kernel call's argument struct is kept, not run."""

    def __init__(self):
        self.arrays: list[tuple[int, int, torch.Tensor]] = []  # (address, bytes, a copy of the storage's bytes)
        self.state: list[torch.Tensor] = []  # each array as the calls so far leave it
        self.calls: list[dict] = []
        self.alive: list[torch.UntypedStorage] = []  # so that no later tensor takes a tracked one's address

    def track(self, *tensors: torch.Tensor | None) -> None:
        """The storages the next call reads or writes (a view's whole storage), copied as they are now."""
        for tensor in tensors:
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            if any(address == storage.data_ptr() for address, _, _ in self.arrays):
                continue
            self.alive.append(storage)
            data = torch.empty(0, dtype=torch.uint8).set_(storage).clone()
            self.arrays.append((storage.data_ptr(), storage.nbytes(), data))
            self.state.append(data.clone())

    def _array(self, address: int) -> tuple[int, int]:
        for index, (base, size, _) in enumerate(self.arrays):
            if base <= address < base + size:
                return index, address - base
        raise AssertionError(f"a pointer ({address:#x}) into no tracked tensor: track it before the call")

    def _record(self, kernel: str, args, element_size: int, planes: int, chunks: int, threads: int) -> int:
        arguments = args._obj
        blob = bytearray(ctypes.string_at(ctypes.addressof(arguments), ctypes.sizeof(arguments)))
        pointers = []
        for name, kind in type(arguments)._fields_:
            if kind is not ctypes.c_void_p:
                continue
            offset, address = getattr(type(arguments), name).offset, getattr(arguments, name)
            blob[offset : offset + 8] = bytes(8)
            if name == "workspace":  # the driver's own
                continue
            pointers.append((offset, *self._array(address)) if address else (offset, -1, 0))
        self.calls.append(
            dict(kernel=KERNELS[kernel], sizes=(element_size, planes, chunks, threads), blob=bytes(blob))
            | dict(pointers=pointers, checks=[])
        )
        return 0

    def position_bias(self, args, element_size, planes, threads):
        return self._record("position_bias", args, element_size, planes, 0, threads)

    def hankel_bias(self, args, element_size, planes, threads):
        return self._record("hankel_bias", args, element_size, planes, 0, threads)

    def hankel_bias_backward(self, args, element_size, planes, threads):
        return self._record("hankel_bias_backward", args, element_size, planes, 0, threads)

    def attend(self, args, element_size, planes, chunks, threads):
        return self._record("attend", args, element_size, planes, chunks, threads)

    def keep_mask(self, args, threads):
        return self._record("keep_mask", args, 1, 0, 0, threads)

    def workspace_bytes(self, keys, width):
        return 0  # the driver allocates attend's workspace for its threads

    def expect(self, tensor: torch.Tensor, expected: torch.Tensor, tolerance: float = 0.0) -> None:
        """After the last call, `tensor` (a view into a tracked storage) holds `expected` within `tolerance`; the rest
        of its storage is as before."""
        index, offset = self._array(tensor.data_ptr())
        state = self.state[index]
        size = tensor.element_size()
        view = state.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), offset // size)
        view.copy_(expected.to(tensor.dtype))
        last = offset + size * (1 + sum((extent - 1) * stride for extent, stride in zip(tensor.shape, tensor.stride())))
        span = state[offset:last].numpy().tobytes()  # the bytes from the view's first element to its last
        self.calls[-1]["checks"].append((index, size, tolerance, offset, span))

    def write(self, path: Path) -> None:
        with path.open("wb") as out:
            out.write(b"DKD1" + struct.pack("<q", len(self.arrays)))
            for _, size, data in self.arrays:
                out.write(struct.pack("<q", size) + data.numpy().tobytes())
            out.write(struct.pack("<q", len(self.calls)))
            for call in self.calls:
                out.write(struct.pack("<6q", call["kernel"], *call["sizes"], len(call["blob"])) + call["blob"])
                out.write(struct.pack("<q", len(call["pointers"])))
                for pointer in call["pointers"]:
                    out.write(struct.pack("<3q", *pointer))
                out.write(struct.pack("<q", len(call["checks"])))
                for index, element, tolerance, offset, expected in call["checks"]:
                    out.write(struct.pack("<2qd2q", index, element, tolerance, offset, len(expected)) + expected)


def float32_tolerance(expected: torch.Tensor) -> float:
    return 1e-5 * max(1.0, expected.abs().max().item())


def record_bias_calls(recording: Recording) -> None:
    """`native.position_bias` as cpu_inference calls it (T's columns reversed, in a buffer with 16 spare elements):
    whole tiles and ragged blocks, offsets, key masks, either term alone, beyond the reach (v3 at 600 tokens)."""
    blocks = [(slice(3, 3 + 37), slice(5, 200 - 2)), (slice(100, 200), slice(16, 16 + 64))]
    for setting in POSITIONS:
        for dtype in (torch.float32, torch.bfloat16):
            positions, both_c2p, both_p2c = tables(*POSITIONS[setting], dtype, heads=1)
            for terms in ("both", "c2p", "p2c"):
                c2p = both_c2p if terms in ("both", "c2p") else None
                p2c = both_p2c if terms in ("both", "p2c") else None
                length = positions.length
                far = (slice(length - 64, length), slice(0, 80))  # v3: tiles beyond the reach
                for rows, keys in blocks + [far] * (setting == "v3"):
                    for masked in (False, True):
                        keep = None
                        if masked:
                            keep = torch.ones(2, keys.stop - keys.start, dtype=torch.uint8)
                            keep[1, 2 * keep.shape[1] // 3 :] = 0
                            keep[0, 5:9] = 0
                        reversed_c2p = None
                        if c2p is not None:
                            buffer = torch.empty(c2p[:, :, rows].numel() + 16, dtype=dtype)
                            reversed_c2p = buffer[:-16].view(*c2p.shape[:2], rows.stop - rows.start, c2p.shape[-1])
                            reversed_c2p.copy_(c2p[:, :, rows].flip(-1))
                        shape = (2, 1, rows.stop - rows.start, keys.stop - keys.start)
                        out = torch.full(shape, float("nan"), dtype=dtype)
                        p2c_keys = p2c[:, :, keys] if p2c is not None else None
                        columns = native.kernel_columns(positions)
                        recording.track(out, reversed_c2p, p2c_keys, *columns, keep)
                        native.position_bias(out, reversed_c2p, p2c_keys, *columns, keep, rows.start, keys.start)
                        recording.expect(out, reference(positions, c2p, p2c, keep, rows, keys, dtype))


# (length, span, buckets, max position) of the training kernels' cases: v3's log buckets (16 distances over fewer
# columns beyond 128), small log buckets, clipped distances (their tiles have no shortcut beyond the reach, so no
# longer input is needed; buckets whose columns step by two run element by element, the same code on every set)
TRAINING_POSITIONS = {"v3": (300, 256, 256, 512), "small-buckets": (300, 16, 16, 64), "clipped": (200, 20, -1, 20)}


def record_training_calls(recording: Recording) -> None:
    """`native.hankel_bias` and `hankel_bias_backward` as BlockedAttention calls them: offset blocks with ragged rows,
    dS summed into c2p's gradient (written) and p2c's (written, then added to), in whole tiles and at their edges;
    with whole tables and banded ones."""
    for length, span, buckets, max_position in TRAINING_POSITIONS.values():
        positions = RelativePositions.build(length, span if buckets <= 0 else buckets, buckets, max_position, "cpu")
        generator = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16):
            p2c = torch.randn(2, 1, length, positions.width, generator=generator).to(dtype)  # the reversed keys' U
            for first, rows in [(0, 48), (length - 37, 37)]:
                c2p = torch.randn(2, 1, rows, positions.width, generator=generator).to(dtype)  # the block's T
                column = int32_column(positions)[first:]
                grad = torch.randn(2, 1, rows, length, generator=generator).to(dtype)
                out = torch.full((2, 1, rows, length), float("nan"), dtype=dtype)
                recording.track(out, c2p, p2c, column)
                native.hankel_bias(out, c2p, p2c, column, True)
                recording.expect(out, hankel_reference(positions, c2p, p2c, first, rows))
                want_c2p, want_p2c = hankel_reference(positions, c2p, p2c, first, rows, grad)
                got_c2p, got_p2c = c2p.clone().fill_(float("nan")), p2c.clone().fill_(float("nan"))
                recording.track(grad, got_c2p, got_p2c)
                native.hankel_bias_backward(grad, got_c2p, got_p2c, column, True, add_p2c=False)
                for got, want in ((got_c2p, want_c2p), (got_p2c, want_p2c)):
                    recording.expect(got, want, gradient_tolerance(want, dtype))
                native.hankel_bias_backward(grad, None, got_p2c, column, True, add_p2c=True)
                recording.expect(got_p2c, 2 * want_p2c, gradient_tolerance(2 * want_p2c, dtype))
                record_banded_calls(recording, positions, c2p, p2c, first, rows, grad, (want_c2p, want_p2c))


def record_banded_calls(recording: Recording, positions, c2p, p2c, first, rows, grad, wants) -> None:
    """The same call with banded tables (`native.Band`, 32 lines to a tile): the same bias, and the gradients
    banded."""
    length, lines = positions.length, 32
    band, firsts, spec = band_layout(positions, first, rows, lines)
    tables = [banded(table, f, lines, band) for table, f in zip((c2p, p2c), firsts)]
    column = int32_column(positions)[first:]
    out = torch.full((2, 1, rows, length), float("nan"), dtype=c2p.dtype)
    recording.track(out, *tables, column, spec.c2p_first, spec.p2c_first)
    native.hankel_bias(out, *tables, column, True, spec)
    recording.expect(out, hankel_reference(positions, c2p, p2c, first, rows))
    grads = [table.clone().fill_(float("nan")) for table in tables]
    recording.track(grad, *grads)
    native.hankel_bias_backward(grad, *grads, column, True, False, spec)
    for got, want, f in zip(grads, wants, firsts):
        recording.expect(got, banded(want, f, lines, band), gradient_tolerance(want, c2p.dtype))


def gradient_tolerance(want: torch.Tensor, dtype: torch.dtype) -> float:
    """float32: 1e-5 of the largest (the sums' order differs from scatter_add's); bfloat16: one rounding of the
    largest (each sum is taken in float32 and rounded once, so a sum near a rounding boundary may round the other
    way)."""
    largest = want.abs().max().item()
    return 1e-5 * max(1.0, largest) if dtype == torch.float32 else 2.0**-7 * largest


def record_attention_calls(recording: Recording) -> None:
    """`native.attend` in float32 as cpu_inference._attend_fused calls it: both terms or one, a key mask over a span
    of the keys, more threads than planes (a plane's rows in parts)."""
    for setting in POSITIONS:
        for masked in (False, True):
            positions, query, key, value, both_pos_key, both_pos_query = attention_inputs(
                *POSITIONS[setting], dtype=torch.float32, batch=2 if masked else 1, heads=2 if masked else 1
            )
            for terms in ("both", "c2p", "p2c"):
                pos_key = both_pos_key if terms in ("both", "c2p") else None
                pos_query = both_pos_query if terms in ("both", "p2c") else None
                length, width = query.shape[2], -(-positions.width // 16) * 16
                keys, keep = slice(0, length), None
                if masked:  # the span of the kept keys, the second sequence's last third left out
                    keys = slice(3, length - 5)
                    keep = torch.ones(2, keys.stop - keys.start, dtype=torch.uint8)
                    keep[1, 2 * keep.shape[1] // 3 :] = 0
                    keep[0, 7:20] = 0
                tiles = [
                    native.as_key_tiles(torch.nn.functional.pad(rows.flip(1) if rows is pos_key else rows,
                                                                (0, 0, 0, width - rows.shape[1])))
                    if rows is not None else None
                    for rows in (pos_key, pos_query)
                ]  # fmt: skip
                out = torch.full((query.shape[0], length, query.shape[1], 64), float("nan"))
                workspace = torch.empty(0, dtype=torch.uint8)
                column, c2p_column = native.kernel_columns(positions)
                recording.track(out, query, key, value, *tiles, column, c2p_column, keep)
                native.attend(out, query, key, value, *tiles, column, c2p_column, keep, keys, SCALE, workspace)
                expected = formula(positions, query, key, value, pos_key, pos_query, keep, keys)
                recording.expect(out, expected, float32_tolerance(expected))


def record_dropout_calls(recording: Recording) -> None:
    """`native.keep_mask` as dropout_keep_mask calls it: whole draws and a last one used in part, a seed above 2^63,
    keep probabilities 0, 0.9 and 1; the expected bytes from the formula (`splitmix64_keep`, test_native.py)."""
    for count, seed, threshold in [(4 * 997, 12345, 29491), (1003, 2**64 - 5, 29491), (64, 7, 0), (65, 8, 1 << 15)]:
        out = torch.full((count,), 7, dtype=torch.uint8)
        recording.track(out)
        native.keep_mask(out, seed, threshold)
        recording.expect(out, splitmix64_keep(count, seed, threshold))


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> Path:
    """The recorded calls, their inputs and expected outputs, in one case file (a few tens of MiB)."""
    path = tmp_path_factory.mktemp("kernel-driver") / "cases.bin"
    recording = Recording()
    saved = dict(native._state)
    native._state.clear()
    native._state["library"] = recording
    try:
        torch.set_num_threads(max(2, torch.get_num_threads()))  # the driver runs the recorded thread counts
        record_bias_calls(recording)
        record_training_calls(recording)
        record_attention_calls(recording)
        record_dropout_calls(recording)
    finally:
        native._state.clear()
        native._state.update(saved)
    recording.write(path)
    return path


def driver_flags(name: str) -> list[str]:
    """The kernel's own flags for a set (native.flags_for), built as an executable rather than a library."""
    return [flag for flag in native.flags_for(name) if flag not in ("-shared", "-fPIC")] + ["-Wall", "-Werror"]


def build_driver(name: str, folder: Path) -> list[str]:
    """The command that runs the driver built for `name` ("neon" under qemu-aarch64), or a skip with the reason."""
    executable = folder / f"kernel_driver-{name}"
    if name == "neon":
        compiler, emulator = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
        if compiler is None or emulator is None:
            pytest.skip("no aarch64-linux-gnu-gcc or qemu-aarch64 here (Debian: gcc-aarch64-linux-gnu, qemu-user)")
        command = [compiler, *driver_flags("neon"), str(DRIVER), "-o", str(executable), "-lm"]
        run = [emulator, "-L", str(AARCH64_SYSROOT), str(executable)]
    else:
        if name not in native._processor_sets()[0]:
            pytest.skip(f"this processor does not run {name}: {native._processor_sets()[1]}")
        compiler = native._compiler()
        if compiler is None:
            pytest.skip("no C compiler here")
        command = [compiler, *driver_flags(name), str(DRIVER), "-o", str(executable), "-lm"]
        run = [str(executable)]
    built = subprocess.run(command, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return run


@pytest.mark.parametrize("name", ["neon", "avx2", "avx512"])
def test_every_kernel_matches_pytorch_on_each_instruction_set(cases, tmp_path, name):
    """The driver runs every recorded call on the set's build and compares each output with PyTorch's: NEON under
    qemu-aarch64, AVX2 forced on any x86-64 processor with it, AVX-512 where the processor has it."""
    run = build_driver(name, tmp_path)
    done = subprocess.run([*run, str(cases)], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"OMP_NUM_THREADS": "2"})  # fmt: skip
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert report.startswith(f"instruction set {name},"), report
    lines = [line for line in report.splitlines() if line.startswith("call ")]
    assert lines and all(line.endswith(": ok") for line in lines), report
    for kernel in KERNELS:  # every kernel ran
        assert any(f" {kernel} (" in line for line in lines), kernel


# (compiler, target flags): each vector set as the kernel builds it; AVX-512 with AMX and without (Skylake-SP to
# Cascade Lake, Zen 4), and a baseline x86-64 build that has no set ("none")
TARGETS = {
    "avx512-amx": ["-march=sapphirerapids"],
    "avx512": ["-march=skylake-avx512"],
    "avx2": list(native.SET_FLAGS["avx2"]),
    "neon": [],
    "none": ["-march=x86-64"],
}


SOURCES = {"kernels": native.SOURCE, "onnx-runtime-operator": ort_operator.SOURCE}


@pytest.mark.parametrize("compiler", ["gcc", "clang"])
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("source", list(SOURCES))
def test_the_source_builds_warning_free(tmp_path, compiler, target, source):
    """-Wall -Wextra -Werror, with gcc and with clang, for every set (aarch64: Debian's cross gcc, clang's own
    --target): the kernels, and ONNX Runtime's operator around them (serving/ort_attention.c)."""
    if target == "neon":
        command = ["aarch64-linux-gnu-gcc"] if compiler == "gcc" else ["clang", "--target=aarch64-linux-gnu"]
        if compiler == "clang" and not (AARCH64_SYSROOT / "include" / "stdint.h").is_file():
            pytest.skip("no aarch64 C library headers here (Debian: libc6-dev-arm64-cross)")
    else:
        command = [compiler]
    if shutil.which(command[0]) is None:
        pytest.skip(f"no {command[0]} here")
    flags = [flag for flag in native.BASE_FLAGS if flag not in ("-shared", "-fPIC")]
    built = subprocess.run(
        [*command, *flags, *TARGETS[target], "-Wall", "-Wextra", "-Werror", f"-I{native.SOURCE.parent}", "-c",
         str(SOURCES[source]), "-o", str(tmp_path / "kernel.o")],
        capture_output=True, text=True,
    )  # fmt: skip
    if built.returncode and "omp.h" in built.stderr:
        pytest.skip(f"{command[0]} has no OpenMP header here (Debian: libomp-dev for clang)")
    assert built.returncode == 0, built.stderr


@pytest.mark.parametrize("compiler", ["gcc", "clang"])
@pytest.mark.parametrize("machine", list(ort_operator.UNITS))
def test_the_operator_library_builds_warning_free(tmp_path, compiler, machine):
    """The operator library for every processor of a machine kind, built by the product's own commands
    (`ort_operator.build_commands`: each set's unit of ort_attention.c without OpenMP, the dispatcher, the link) with
    -Wall -Wextra -Werror, with gcc and with clang (aarch64: Debian's cross gcc, clang's own --target)."""
    if machine == ort_operator.machine_kind():
        command = compiler
    elif compiler == "gcc":
        command = ort_operator.CROSS_COMPILERS.get(machine, "")
    else:
        command = f"clang --target={machine}-linux-gnu"
        if machine != "aarch64" or not (AARCH64_SYSROOT / "include" / "stdint.h").is_file():
            pytest.skip(f"no {machine} C library headers here (Debian: libc6-dev-arm64-cross)")
    if not command or shutil.which(command.split()[0]) is None:
        pytest.skip(f"no {command or 'compiler'} for {machine} here")
    commands = ort_operator.build_commands(
        "COMPILER", machine, tmp_path / "library.so", ("-Wall", "-Wextra", "-Werror")
    )
    for step in commands[:-1]:  # the compiles; linking another machine's objects needs its C library
        built = subprocess.run([*command.split(), *step[1:]], capture_output=True, text=True)
        assert built.returncode == 0, built.stderr
