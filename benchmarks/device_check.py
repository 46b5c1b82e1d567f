"""Our backends on a GPU in one prepared run: parity first, then the GPU benchmark, in under 6 minutes.

    python -m benchmarks.device_check --device cuda --out-dir $OUT   # parity, then benchmarks.run's GPU cases
    python -m benchmarks.device_check --device cpu --no-benchmark    # the parity stages on the CPU

Stages, each printed with the seconds it took:

1. float32 parity: a 2-layer DeBERTa-v3-shaped model (small hidden size, head size 32, 16 log buckets so a 300-token
   batch reaches them) with spread-out weights, on a padded batch; sdpa and flex_attention against eager on the same
   device: outputs within 1e-5 and every gradient within 1e-4 of its scale (flex gradients where PyTorch has a flex
   backward, i.e. not on the CPU). sdpa runs twice: with the Triton kernel on (`dispatch.TRITON` "check", the default:
   its self-check on first use runs as a user's would), where on CUDA the kernel must serve the calls (a silent
   fallback fails), and off ("0"). Fails on a mismatch.
2. bfloat16 parity: ours in bfloat16 (sdpa, Triton on and off) against transformers' DeBERTa in float32 on the same
   weights; our error within 2x transformers' own bfloat16 error + 1e-3. Fails on a mismatch.
   Then transformers' own DebertaV2Model, `disentangled.accelerate`d in place, against itself unaccelerated in
   float32 (outputs 1e-5, gradients 1e-4; on CUDA the Triton kernel must serve it): what GLiNER, sentence-transformers
   and pipelines run. Fails on a mismatch.
3. The anchors (benchmarks/gpu_anchors.py): FlashDeBERTa and disentangled-flash against transformers' DeBERTa in
   float32 on the padded batch. Printed, never failed: they are not ours.
4. On CUDA, the Triton kernel's self-check (`benchmarks.self_check`) for every kind of call a DeBERTa-v3 model makes
   on this GPU, from an empty verdict cache: each verdict with its figures and its cost. A failed verdict fails this
   check. (--no-self-check leaves it out.)
5. `benchmarks.run --device cuda --dtype bfloat16 --no-eager --no-memory`: the GPU cases with the anchors; no case
   starts after --budget-s seconds from the start of this check (default 270: parity and the cases that started fit
   in 6 minutes on an H200). It runs even after a parity failure (the record says which), and this check then exits 1.

With --out-dir the benchmark's results go to OUT/results, its record and the self-check's to OUT/records/run.jsonl and
OUT/records/self_check.jsonl (append those lines to benchmarks/records/, then `python -m benchmarks.report`), the
self-check's verdicts to OUT/self_checks.json, and this check's own lines (with the verdicts the parity stages' calls
made) to OUT/device_check.json. --commit names the commit measured where the tree is not a git checkout.

A device machine reaches no package registry, and its image has torch, Triton and transformers but not the anchors
nor all of our own dependencies, so their wheels are downloaded here and carried (`.device-wheels/` is git-ignored,
so the device tool's `carry` names it):

    python -m benchmarks.device_check --prepare-wheels .device-wheels   # here, with a registry: 15 MiB, 23 wheels

then, on the device machine (`install_command()`; REV: the commit the tree is at):

    python -m pip install --no-index --find-links .device-wheels --no-deps flashdeberta==0.0.8 \\
        disentangled-flash==1.1.1 einops 'sentencepiece>=0.2' protobuf 'jinja2>=3.0' markupsafe 'setuptools>=77' \\
      && python -m pip install --no-index --no-deps --no-build-isolation -e . \\
      && python -m benchmarks.device_check --device cuda --out-dir $OUT --commit REV

`--find-links` lets pip pick, of the binary wheels downloaded for Python 3.10 to 3.13 on x86-64 and aarch64, the one
the machine takes; names already installed in the image are left as they are.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

import disentangled
from benchmarks import gpu_anchors
from disentangled.modeling import dispatch, kernel_check

CONFIG = dict(
    vocab_size=1000,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=256,
    position_buckets=16,
    max_relative_positions=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
LENGTHS = [300, 171]  # the padded batch: the second row is padding from 171 on
# The wheels a device machine lacks: (requirement, binary): the anchors, einops (FlashDeBERTa's), what our package
# needs beyond torch and transformers' own dependencies, and setuptools to install it editable without an index.
# A binary one is downloaded for each of PYTHONS on each of PLATFORMS.
WHEELS = [
    ("flashdeberta==0.0.8", False),
    ("disentangled-flash==1.1.1", False),
    ("einops", False),
    ("sentencepiece>=0.2", True),
    ("protobuf", True),
    ("jinja2>=3.0", False),
    ("markupsafe", True),
    ("setuptools>=77", False),  # pyproject's license string (PEP 639)
]
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
PLATFORMS = {
    "x86_64": ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"],
    "aarch64": ["manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64"],
}
CARRY_LIMIT_MIB = 64  # what the device tool carries beside the working tree


def spread_weights(model: torch.nn.Module) -> None:
    """N(0, 1/fan_in) matrices, N(0, 1) embeddings, LayerNorm weights near 1 and small biases: attention far
    from uniform, so that a wrong term shows."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() < 2:
                param.copy_((1.0 if name.endswith("LayerNorm.weight") else 0.0) + 0.1 * noise)
            else:
                param.copy_(noise if "embeddings" in name else noise / param.shape[1] ** 0.5)


def padded_batch(device: torch.device) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, CONFIG["vocab_size"], (len(LENGTHS), max(LENGTHS)), generator=generator)
    attention_mask = (torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]).long()
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def run_backend(model, batch, backward: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        output = model(**batch).last_hidden_state
    if backward:
        weights = torch.linspace(-1, 1, output.numel(), device=output.device).view_as(output)
        (output * weights * batch["attention_mask"][..., None]).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.detach(), grads


class KernelCalls:
    """Within `with`, the Triton kernel switched on (`dispatch.TRITON` "check", the default: on after its self-check
    of each kind of call) or off ("0") where `on` is not None, and the calls the sdpa backend makes to the kernel
    counted (sdpa_attention.triton_disentangled wrapped; the self-check's runs of the kernel are among them)."""

    def __init__(self, on: bool | None):
        self.on, self.count = on, 0
        self.sdpa = importlib.import_module("disentangled.modeling.sdpa_attention")
        self.switch = contextlib.nullcontext() if on is None else dispatch.switched(TRITON="check" if on else "0")

    def __enter__(self) -> KernelCalls:
        self.switch.__enter__()
        self.kernel = self.sdpa.triton_disentangled

        def counted(*args, **kwargs):
            self.count += 1
            return self.kernel(*args, **kwargs)

        self.sdpa.triton_disentangled = counted
        return self

    def __exit__(self, *exc) -> None:
        self.sdpa.triton_disentangled = self.kernel
        self.switch.__exit__(*exc)


def sdpa_variants() -> list[tuple[str, str, bool | None]]:
    """(label, backend, Triton switch) for the parity stages: sdpa with the kernel on and off."""
    return [("sdpa, Triton kernel on", "sdpa", True), ("sdpa, Triton kernel off", "sdpa", False)]


def kernel_verdict(calls: KernelCalls, device: torch.device) -> tuple[bool, str]:
    """Whether the kernel ran where it should have: on CUDA with the switch on, in some call; never with it off."""
    if calls.on is None:
        return True, ""
    if calls.on and device.type == "cuda":
        return calls.count > 0, f"; Triton kernel in {calls.count} calls" + ("" if calls.count else " (fell back)")
    return calls.count == 0, f"; Triton kernel in {calls.count} calls"


def reference_model(device: torch.device) -> disentangled.DisentangledModel:
    torch.manual_seed(0)
    reference = disentangled.DisentangledModel(disentangled.DisentangledConfig(**CONFIG))
    spread_weights(reference)
    return reference.to(device)


def parity(device: torch.device, lines: list[str] | None = None) -> bool:
    """Stage 1: float32, sdpa (Triton on and off) and flex against eager, outputs and gradients."""
    lines = [] if lines is None else lines
    reference = reference_model(device)
    reference.set_attn_implementation("eager")
    batch = padded_batch(device)
    expected, expected_grads = run_backend(reference, batch, backward=True)
    real = batch["attention_mask"].bool()
    scale = max(1.0, expected[real].abs().max().item())
    ok = True
    for label, backend, switch in [*sdpa_variants(), ("flex_attention", "flex_attention", None)]:
        model = copy.deepcopy(reference)
        model.set_attn_implementation(backend)
        backward = not (backend == "flex_attention" and device.type == "cpu")  # no CPU flex backward
        with KernelCalls(switch) as calls:
            actual, grads = run_backend(model, batch, backward)
        kernel_ok, kernel_note = kernel_verdict(calls, device)
        output_error = (actual - expected)[real].abs().max().item() / scale
        grad_error = float("nan")
        if backward:
            grad_error = max(
                ((grads[name] - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
                for name, want in expected_grads.items()
            )
        passed = output_error <= 1e-5 and (not backward or grad_error <= 1e-4) and kernel_ok
        ok &= passed
        lines.append(
            f"{device} {label}: outputs {output_error:.1e} (bound 1e-5), gradients {grad_error:.1e} "
            f"(bound 1e-4){'' if backward else ' not checked: no CPU flex backward'}{kernel_note}: "
            f"{'ok' if passed else 'FAIL'}"
        )
        print(lines[-1], flush=True)
    return ok


def transformers_twin(ours: disentangled.DisentangledModel) -> transformers.DebertaV2Model:
    """transformers' DebertaV2Model with our config and weights (our parameter names are DeBERTa-v2's)."""
    from disentangled.conversion.heads import deberta_v2_config

    twin = transformers.DebertaV2Model(deberta_v2_config(ours.config.to_dict()))
    twin.load_state_dict(ours.state_dict(), strict=True)
    return twin.to(ours.device).eval()


def bfloat16_parity(device: torch.device, lines: list[str] | None = None) -> bool:
    """Stage 2: ours in bfloat16 against transformers' DeBERTa in float32, within 2x transformers' bfloat16 error."""
    lines = [] if lines is None else lines
    ours = reference_model(device).eval()
    reference = transformers_twin(ours)
    batch = padded_batch(device)
    real = batch["attention_mask"].bool()
    with torch.inference_mode():
        exact = reference(**batch).last_hidden_state
        theirs = copy.deepcopy(reference).to(torch.bfloat16)(**batch).last_hidden_state.float()
    their_error = (theirs - exact)[real].abs().max().item()
    ours.to(torch.bfloat16)
    ok = True
    for label, backend, switch in sdpa_variants():
        ours.set_attn_implementation(backend)
        with KernelCalls(switch) as calls, torch.inference_mode():
            output = ours(**batch).last_hidden_state.float()
        kernel_ok, kernel_note = kernel_verdict(calls, device)
        our_error = (output - exact)[real].abs().max().item()
        passed = our_error <= 2 * their_error + 1e-3 and kernel_ok
        ok &= passed
        lines.append(
            f"{device} {label}, bfloat16: error {our_error:.2e} against float32, transformers' bfloat16 "
            f"{their_error:.2e} (bound 2x + 1e-3){kernel_note}: {'ok' if passed else 'FAIL'}"
        )
        print(lines[-1], flush=True)
    return ok


def accelerate_parity(device: torch.device, lines: list[str] | None = None) -> bool:
    """Stage 2b: transformers' own DebertaV2Model, `disentangled.accelerate`d in place (as GLiNER, sentence-transformers
    and pipelines get it), against itself unaccelerated in float32: outputs 1e-5, every gradient 1e-4, and on CUDA
    the Triton kernel must have served the calls."""
    lines = [] if lines is None else lines
    reference = transformers_twin(reference_model(device))
    batch = padded_batch(device)
    real = batch["attention_mask"].bool()
    expected, expected_grads = run_backend(reference, batch, backward=True)
    accelerated = disentangled.accelerate(copy.deepcopy(reference))
    with KernelCalls(True) as calls:
        actual, grads = run_backend(accelerated, batch, backward=True)
    kernel_ok, kernel_note = kernel_verdict(calls, device)
    scale = max(1.0, expected[real].abs().max().item())
    output_error = (actual - expected)[real].abs().max().item() / scale
    grad_error = max(
        ((grads[name] - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
        for name, want in expected_grads.items()
    )
    passed = output_error <= 1e-5 and grad_error <= 1e-4 and kernel_ok
    lines.append(
        f"{device} accelerate(transformers' DebertaV2Model): outputs {output_error:.1e} (bound 1e-5), gradients "
        f"{grad_error:.1e} (bound 1e-4){kernel_note}: {'ok' if passed else 'FAIL'}"
    )
    print(lines[-1], flush=True)
    return passed


def anchor_parity(device: torch.device, lines: list[str] | None = None) -> None:
    """Stage 3: each anchor against transformers' DeBERTa in float32; printed, never failed."""
    lines = [] if lines is None else lines
    reference = transformers_twin(reference_model(device).eval())
    batch = padded_batch(device)
    real = batch["attention_mask"].bool()
    with torch.inference_mode():
        exact = reference(**batch).last_hidden_state
    scale = max(1.0, exact[real].abs().max().item())
    for name in gpu_anchors.ANCHORS:
        model, why = gpu_anchors.build_anchor(name, reference, training=False, length=max(LENGTHS))
        if model is None:
            lines.append(f"{device} {name}: not checked: {why}")
        else:
            try:
                with torch.inference_mode():
                    output = model(**batch).last_hidden_state
                error = (output - exact)[real].abs().max().item()
                lines.append(
                    f"{device} {name} {gpu_anchors.version(name)}, float32: max abs diff {error:.2e} from "
                    f"transformers' DeBERTa ({error / scale:.1e} of the output's scale)"
                )
            except Exception as error:  # not ours: reported, not fatal
                lines.append(f"{device} {name}: failed on the padded batch: {type(error).__name__}: {error}")
        print(lines[-1], flush=True)


def self_check_stage(device: torch.device, lines: list[str], out_dir: Path | None, commit: str | None) -> bool:
    """Stage 4: `benchmarks.self_check` on this GPU; its record and verdicts under `out_dir` where given."""
    from benchmarks import self_check

    arguments = ["--device", str(device)] + (["--out-dir", str(out_dir)] if out_dir else [])
    passed = self_check.main(arguments + (["--commit", commit] if commit else [])) == 0
    lines.append(f"{device} Triton self-check of each kind of call: {'ok' if passed else 'FAIL'}")
    print(lines[-1], flush=True)
    return passed


def install_command(folder: str = ".device-wheels") -> str:
    """What installs the carried wheels, then our package, on a machine without a registry."""
    requirements = " ".join(shlex.quote(requirement) for requirement, _ in WHEELS)
    return (
        f"python -m pip install --no-index --find-links {folder} --no-deps {requirements} && "
        "python -m pip install --no-index --no-deps --no-build-isolation -e ."
    )


def prepare_wheels(folder: Path) -> list[tuple[str, int]]:
    """Download `WHEELS` into `folder` (pure ones once, binary ones per Python and platform); (file, bytes) of each
    wheel there. Exits when the folder would not fit what the device tool carries."""
    folder.mkdir(parents=True, exist_ok=True)
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder)]
    subprocess.run([*download, *(name for name, binary in WHEELS if not binary)], check=True)
    binary = [name for name, is_binary in WHEELS if is_binary]
    for python in PYTHONS:
        for tags in PLATFORMS.values():
            platforms = [part for tag in tags for part in ("--platform", tag)]
            subprocess.run([*download, "--python-version", python, *platforms, *binary], check=True)
    sizes = sorted((path.name, path.stat().st_size) for path in folder.glob("*.whl"))
    total = sum(size for _, size in sizes) / 2**20
    for name, size in sizes:
        print(f"{size / 2**20:7.2f} MiB  {name}")
    print(f"{total:7.2f} MiB in {len(sizes)} wheels in {folder}")
    if total > CARRY_LIMIT_MIB:
        raise SystemExit(f"{total:.1f} MiB: more than the {CARRY_LIMIT_MIB} MiB a device run carries")
    print(f"On the device machine: {install_command(str(folder))}")
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-benchmark", action="store_true")
    parser.add_argument("--no-self-check", action="store_true", help="leave out the self-check stage (CUDA only)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="start no benchmark case after this (seconds)")
    parser.add_argument("--out-dir", type=Path, default=None, help="results, record and this check's lines (a $OUT)")
    parser.add_argument("--commit", default=None, help="the commit measured, where the tree is not a git checkout")
    parser.add_argument("--prepare-wheels", type=Path, metavar="FOLDER", help="download the wheels to carry, and stop")
    parser.add_argument("--benchmark-args", nargs=argparse.REMAINDER, default=[], help="passed to benchmarks.run")
    args = parser.parse_args(argv)
    if args.prepare_wheels:
        prepare_wheels(args.prepare_wheels)
        return
    started = time.monotonic()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device_check --device {args.device}: torch sees no CUDA GPU here (--device cpu checks parity)"
        )
    lines, stages = [], {}

    def stage(name: str, check) -> bool:
        begin = time.monotonic()
        result = check(device, lines)
        stages[name] = round(time.monotonic() - begin, 1)
        print(f"[{name}: {stages[name]:.1f} s, {time.monotonic() - started:.0f} s since the start]", flush=True)
        return result is not False

    ok = stage("float32 parity", parity)
    ok &= stage("bfloat16 parity", bfloat16_parity)
    ok &= stage("accelerate parity", accelerate_parity)
    stage("anchors", anchor_parity)
    made = [  # the verdicts of the self-checks the parity stages' calls ran, as a user's first calls run them
        {"kind": verdict["kind"], "passed": verdict["passed"], "seconds": verdict["seconds"]}
        for verdict in kernel_check._verdicts.values()
    ]
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda" and not args.no_self_check:
        ok &= stage("self-check", lambda device, lines: self_check_stage(device, lines, args.out_dir, args.commit))
    if not args.no_benchmark:
        from benchmarks import run

        benchmark = ["--device", args.device, "--dtype", "bfloat16", "--no-eager", "--no-memory"]
        benchmark += ["--budget-s", f"{max(0.0, args.budget_s - (time.monotonic() - started)):.0f}"]
        benchmark += ["--parity", "passed" if ok else "FAILED: " + "; ".join(line for line in lines if "FAIL" in line)]
        if args.out_dir:
            benchmark += ["--out", str(args.out_dir / "results"), "--records", str(args.out_dir / "records")]
        if args.commit:
            benchmark += ["--commit", args.commit]
        begin = time.monotonic()
        run.main([*benchmark, *args.benchmark_args])
        stages["benchmark"] = round(time.monotonic() - begin, 1)
        print(f"[benchmark: {stages['benchmark']:.1f} s, {time.monotonic() - started:.0f} s since the start]")
    if args.out_dir:
        summary = {"ok": ok, "device": str(device), "lines": lines, "seconds": stages, "self_checks": made}
        (args.out_dir / "device_check.json").write_text(json.dumps(summary, indent=2))
    print(f"device check {'passed' if ok else 'FAILED'} in {time.monotonic() - started:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
