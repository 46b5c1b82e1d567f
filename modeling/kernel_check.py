"""The Triton kernel's self-check on first use: before the kernel serves a kind of call on a GPU for the first time,
it computes a small seeded call of that kind, and serves the kind only if its numbers are as close to the formula as
sdpa's own path's are.

Why: the interpreter tests check the kernel's algorithm and the ahead-of-time compiles check its registers and shared
memory, but neither checks what this GPU's compiler and hardware compute (a miscompile, a wrong mask or dropout at
some tile, a rounding mode). `KernelLaunchError` catches launches that fail, not wrong numbers.

A kind of call (`Kind`): the GPU (name, compute capability), dtype, head size, forward or training, key mask or none,
dropout or none, the position terms (c2p, p2c, p2p), whether the length is a multiple of 16 (Triton compiles another
kernel then), and the tiles.

The check, on the GPU, on inputs of the kind drawn from a generator of its own (the caller's random streams are not
touched): 2 sequences (the second padded from half its length where the kind has a mask), 2 heads, log buckets that
put the backward's tiles in all three ways of adding into the tables' gradients, and two of the largest tile plus 16
(or 9: ragged) tokens. Four results, each the context and, for training, the gradients of q, k, v, Kr and Qr:

    R  the formula in float64, dense (the input is small): the reference;
    K  the kernel, in the call's dtype, at the call's tiles;
    S  sdpa's blocked path in the call's dtype: the path that serves the kind if the kernel does not;
    E  the eager reference in the call's dtype.

Passed when every |K - R| is within max(bound, 2 max(|S - R|, |E - R|) + ulp), the bound that of
tests/test_triton_attention.py (1e-5 of the context's scale, 1e-4 of each gradient's), ulp one unit in the last place
of the call's dtype at that scale: in float32 the tests' bound, in float16 and bfloat16 twice the error of torch's own
paths in that dtype (the tests' rule for low precision, which they measure against eager) and the one rounding that
storing a result in that dtype may add. Through the interpreter, whose products are a tensor core's, the largest
error came to 0.86 of its bound (bfloat16 training, dq) before the ulp was added; a miscompiled tile, a wrong term,
mask or dropout decision is off by far more than either.

Dropout makes the outputs random, so K is not compared with S there. The kernel decides dropout by Philox, keyed by a
seed the check chooses; R applies the same decisions (`triton_attention.dropout_keep_mask` writes them densely with
the kernels' own `_kept`), and the kept fraction must be 1 - p within four standard deviations. So a kernel that drops
other entries than its seed's, scales them wrongly, or decides differently in the backward fails; S and E, without
dropout, give the dtype's error scale (times 1 / (1 - p), the scale of the kept entries). Two seeds, one of them a multiple of 16: Triton compiles another kernel for an integer
argument divisible by 16, and one training call in 16 draws such a seed.

Verdicts are kept in memory and on disk, one JSON file per kind in `triton-checks/` under DISENTANGLED_CACHE (else
~/.cache/disentangled), named by a hash of the kind and of what could change the answer: the GPU's driver, torch,
Triton and the source of `triton_attention.py` and this file; written under a temporary name and renamed, so a later
process reads the verdict and runs no check. A failed check warns once with its figures, and sdpa's path serves that
kind from then on (`dispatch.decide` reads the verdict); a check that raises is a failure for this process only.

In `modeling/`'s layering (`__init__.py`): layer 4, beside the GPU kernel it checks.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from .disentangled_attention import PositionScores, RelativePositions, eager_disentangled, head_scaling
from .triton_attention import KernelLaunchError, dropout_keep_mask

OUTPUT_BOUND = 1e-5  # of the context's scale: tests/test_triton_attention.py's float32 bound
GRADIENT_BOUND = 1e-4  # of each gradient's scale
DROPOUT = 0.1
SEEDS = (1_234_567, 16 * 77_777)  # not 1, and one a multiple of 16: the two compiled variants a training call meets
GRADIENTS = ("q", "k", "v", "Kr", "Qr")


@dataclass(frozen=True)
class Kind:
    """What makes two calls the same to the compiled kernel and its tiles."""

    gpu: str
    capability: tuple[int, int]
    dtype: str  # "bfloat16", ...
    head_size: int
    training: bool
    mask: bool
    dropout: bool
    terms: tuple[str, ...]  # of "c2p", "p2c", "p2p"
    aligned: bool  # the length is a multiple of 16
    tiles: tuple[tuple[str, tuple[int, int, int, int]], ...]  # sorted (kernel, (BLOCK_M, BLOCK_N, warps, stages))

    @classmethod
    def from_saved(cls, saved: dict) -> Kind:
        """The kind of a verdict read back from JSON (lists where the kind holds tuples)."""
        return cls(
            **{
                **saved,
                "capability": tuple(saved["capability"]),
                "terms": tuple(saved["terms"]),
                "tiles": tuple((name, tuple(tile)) for name, tile in saved["tiles"]),
            }
        )

    def describe(self) -> str:
        parts = [
            self.dtype,
            f"head size {self.head_size}",
            "training" if self.training else "forward",
            "key mask" if self.mask else "no mask",
            "dropout" if self.dropout else "no dropout",
            "+".join(self.terms),
            "length a multiple of 16" if self.aligned else "length not a multiple of 16",
        ]
        return f"{self.gpu} (compute capability {self.capability[0]}.{self.capability[1]}): {', '.join(parts)}"


def cache_folder() -> Path:
    """Where verdicts are kept: DISENTANGLED_CACHE, else ~/.cache/disentangled (as for the CPU kernel's build)."""
    return Path(os.environ.get("DISENTANGLED_CACHE", Path.home() / ".cache" / "disentangled")) / "triton-checks"


def _driver_version() -> str:
    """The NVIDIA driver's version (Linux: /proc/driver/nvidia/version), else CUDA's driver API version."""
    try:
        for word in Path("/proc/driver/nvidia/version").read_text().split():
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return word
    except OSError:
        pass
    try:
        import ctypes

        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"CUDA driver API {version.value}"
    except (OSError, AttributeError):
        pass
    return "unknown"


_ENVIRONMENT: dict | None = None


def environment() -> dict:
    """What could change a verdict beside the kind: the driver, torch, Triton and the kernel's source."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        here = Path(__file__)
        source = hashlib.sha256()
        for name in ("triton_attention.py", here.name):
            path = here.with_name(name)
            source.update(path.read_bytes() if path.is_file() else name.encode())
        _ENVIRONMENT = {
            "driver": _driver_version(),
            "torch": torch.__version__,
            "triton": triton_version,
            "source": source.hexdigest()[:16],
        }
    return _ENVIRONMENT


def _file_of(kind: Kind) -> Path:
    text = json.dumps({"kind": asdict(kind), "environment": environment()}, sort_keys=True)
    return cache_folder() / f"{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"


_verdicts: dict[Kind, dict] = {}
_lock = threading.Lock()


def verdict(kind: Kind) -> dict | None:
    """This kind's verdict ({"passed", "figures", ...}): from memory, else from disk; None where it was never checked
    here (on this driver, torch, Triton and kernel source)."""
    found = _verdicts.get(kind)
    if found is None:
        try:
            found = json.loads(_file_of(kind).read_text())
        except (OSError, ValueError):
            return None
        _verdicts[kind] = found
    return found


def forget() -> None:
    """Forget the verdicts held in memory (as a new process would; the files stay)."""
    _verdicts.clear()


def saved_verdicts() -> list[dict]:
    """Every verdict on disk, each with "current": whether it was made on this driver, torch, Triton and source."""
    found = []
    for path in sorted(cache_folder().glob("*.json")) if cache_folder().is_dir() else []:
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found.append({**saved, "current": saved.get("environment") == environment(), "file": str(path)})
    return found


def check(kind: Kind, device: torch.device, kernel: Callable, baseline: Callable) -> dict:
    """Run the self-check of `kind` on `device` (once per kind: another thread's verdict is reused), keep and save the
    verdict, warn if it failed. `kernel` is `triton_attention.triton_disentangled`'s signature; `baseline` the
    blocked path's: (module, q, k, v, mask, scaling, dropout, position_scores) -> (context, None).
    `triton_attention.KernelLaunchError` passes through (the caller's fallback for a kernel that cannot launch)."""
    with _lock:
        known = verdict(kind)
        if known is not None:
            return known
        started = time.perf_counter()
        save = True
        try:
            figures, passed = _compare(kind, device, kernel, baseline)
        except KernelLaunchError:
            raise
        except Exception as error:  # a check that cannot run: no kernel for this kind in this process, nothing saved
            figures, passed, save = {"error": f"{type(error).__name__}: {error}"}, False, False
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        found = {
            "passed": passed,
            "kind": asdict(kind),
            "environment": environment(),
            "figures": figures,
            "seconds": round(time.perf_counter() - started, 3),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        _verdicts[kind] = found
        if save:
            _save(kind, found)
        if not passed:
            warnings.warn(
                f"The Triton disentangled-attention kernel failed its self-check on {kind.describe()}: "
                f"{_summary(figures)}. sdpa's own path serves these calls instead (slower on long inputs, same "
                "results). Please report it with the output of `disentangled env` (the manual's 'Reporting a "
                "problem' page); DISENTANGLED_TRITON=1 skips the check, DISENTANGLED_TRITON=0 turns the kernel off.",
                RuntimeWarning,
                stacklevel=4,
            )
        return found


def _summary(figures: dict) -> str:
    if "error" in figures:
        return f"the check raised {figures['error']}"
    failed = [
        f"{name} error {entry['error']:.3g} (bound {entry['bound']:.3g})"
        for name, entry in _flat(figures)
        if entry["error"] > entry["bound"] or not math.isfinite(entry["error"])
    ]
    return "; ".join(failed) or "figures within bounds"


def _flat(figures: dict):
    for name, entry in figures.items():
        if isinstance(entry, dict) and "error" in entry:
            yield name, entry
        elif isinstance(entry, dict):
            yield from ((f"{name} {inner}", value) for inner, value in _flat(entry))


def _save(kind: Kind, found: dict) -> None:
    """Written whole under a temporary name and renamed; a cache that cannot be written keeps the verdict in memory."""
    path = _file_of(kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
            json.dump(found, out, indent=1)
        os.replace(out.name, path)
    except OSError:
        pass


def tiles_of(kind: Kind) -> dict[str, tuple[int, int, int, int]]:
    return {name: tuple(tile) for name, tile in kind.tiles}


class _Case:
    """The check's inputs for a kind, leaves of their own in any dtype (`leaves`)."""

    def __init__(self, kind: Kind, device: torch.device):
        block = max(max(tile[0], tile[1]) for tile in tiles_of(kind).values())
        self.length = length = 2 * block + (16 if kind.aligned else 9)
        bucket = max(4, block // 2)  # exact below bucket / 2 tokens, log buckets to `block`, clipped beyond
        self.positions = RelativePositions.build(length, bucket, bucket, block, device)
        self.kind, self.device = kind, device
        self.scaling = head_scaling(kind.head_size, 1 + len(kind.terms))
        generator = torch.Generator().manual_seed(0)
        batch, heads, dim, width = 2, 2, kind.head_size, self.positions.width
        self.values = {
            "q": torch.randn(batch, length, heads, dim, generator=generator),  # [B, L, H, D], as the model's heads
            "k": torch.randn(batch, length, heads, dim, generator=generator),
            "v": torch.randn(batch, length, heads, dim, generator=generator),
            "Kr": torch.randn(heads, width, dim, generator=generator) * self.scaling,
            "Qr": torch.randn(heads, width, dim, generator=generator) * self.scaling,
        }
        self.grad_output = torch.randn(batch, length, heads, dim, generator=generator)
        self.mask = None
        if kind.mask:
            self.mask = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=device)
            self.mask[-1, ..., length // 2 :] = False

    def run(self, attend: Callable, dtype: torch.dtype) -> tuple[Tensor, list[Tensor | None]]:
        """The context [B, L, H, D] and, for training, the gradients of <context, grad_output> for each leaf."""
        training = self.kind.training
        leaves = {name: value.to(self.device, dtype).requires_grad_(training) for name, value in self.values.items()}
        query, key, value = (leaves[name].transpose(1, 2) for name in ("q", "k", "v"))
        pos_key, pos_query = leaves["Kr"], leaves["Qr"]
        p2p = None
        if "p2p" in self.kind.terms:  # as the model makes it: [H, 2L - 1] by distance, from both tables
            column = self.positions.column
            p2p = (pos_query[:, column] * pos_key[:, column.flip(0)]).sum(-1) / self.scaling
        scores = PositionScores(
            query,
            key,
            pos_key if "c2p" in self.kind.terms else None,
            pos_query if "p2c" in self.kind.terms else None,
            p2p,
            self.positions,
        )
        context, _ = attend(None, query, key, value, self.mask, self.scaling, scores)
        if not training:
            return context.detach(), []
        grads = torch.autograd.grad(
            context, list(leaves.values()), self.grad_output.to(self.device, dtype), allow_unused=True
        )
        return context.detach(), [grad.detach() if grad is not None else None for grad in grads]


def _formula(keep: Tensor | None = None, dropout: float = 0.0) -> Callable:
    """The reference: softmax(scaled q kᵀ + position terms, masked) @ v, densely, with the given dropout decisions."""

    def attend(module, query, key, value, mask, scaling, position_scores):
        scores = (query * scaling) @ key.mT + position_scores.bias()
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        if keep is not None:
            probs = probs * keep / (1 - dropout)
        return (probs @ value).transpose(1, 2), None

    return attend


NAMES = ("context", *(f"d{name}" for name in GRADIENTS))


def _differences(result, reference) -> dict[str, float]:
    """max |result - reference| of the context and of each gradient there is ({name: error}); inf where one has a
    gradient the other lacks, or is not finite."""
    errors = {}
    for name, mine, want in zip(NAMES, [result[0], *result[1]], [reference[0], *reference[1]]):
        if mine is None and want is None:
            continue
        error = (mine.double() - want).abs().max().item() if mine is not None and want is not None else math.inf
        errors[name] = error if math.isfinite(error) else math.inf
    return errors


def _figures(result, reference, baseline: dict[str, float], dtype: torch.dtype, factor: float = 1.0) -> dict:
    """{name: {"error", "bound"}}: the bound is max(the tests' bound, twice the baseline's error x `factor` + one unit
    in the last place of `dtype` at the reference's scale)."""
    figures = {}
    for name, error in _differences(result, reference).items():
        want = reference[0] if name == "context" else reference[1][NAMES.index(name) - 1]
        scale = max(want.abs().max().item(), 1e-6) if want is not None else 0.0
        bound = (OUTPUT_BOUND if name == "context" else GRADIENT_BOUND) * scale
        rounding = 2 * baseline.get(name, 0.0) * factor + torch.finfo(dtype).eps * scale
        figures[name] = {"error": error, "bound": max(bound, rounding)}
    return figures


def _compare(kind: Kind, device: torch.device, kernel: Callable, baseline: Callable) -> tuple[dict, bool]:
    dtype = getattr(torch, kind.dtype)
    case = _Case(kind, device)
    tiles = tiles_of(kind)
    grad_mode = torch.enable_grad() if kind.training else torch.no_grad()
    with torch.inference_mode(False), grad_mode, torch.autocast(device.type, enabled=False):
        exact = case.run(_formula(), torch.float64)
        # torch's own error in this dtype, the larger of sdpa's blocked path's and eager's (the tests' baseline)
        theirs = _differences(case.run(lambda *args: baseline(*args[:6], 0.0, args[6]), dtype), exact)
        eager = _differences(case.run(lambda *args: eager_disentangled(*args[:6], 0.0, args[6]), dtype), exact)
        theirs = {name: max(error, eager.get(name, 0.0)) for name, error in theirs.items()}
        if not kind.dropout:
            ours = case.run(lambda *args: kernel(*args[:6], 0.0, args[6], blocks=tiles), dtype)
            figures = _figures(ours, exact, theirs, dtype)
            return figures, all(entry["error"] <= entry["bound"] for entry in figures.values())
        figures = {}
        for seed in SEEDS:
            keep = dropout_keep_mask((2, 2, case.length, case.length), DROPOUT, seed, device)
            fraction, spread = keep.float().mean().item(), (DROPOUT * (1 - DROPOUT) / keep.numel()) ** 0.5
            reference = case.run(_formula(keep.double(), DROPOUT), torch.float64)
            ours = case.run(
                lambda *args, seed=seed: kernel(*args[:6], DROPOUT, args[6], seed=seed, blocks=tiles), dtype
            )
            # sdpa's error without dropout gives the dtype's scale; the kept entries are scaled by 1 / (1 - p)
            figures[f"seed {seed}"] = {
                "kept fraction": {"error": abs(fraction - (1 - DROPOUT)), "bound": 4 * spread},
                **_figures(ours, reference, theirs, dtype, 1 / (1 - DROPOUT)),
            }
        return figures, all(entry["error"] <= entry["bound"] for _, entry in _flat(figures))
