"""Peak memory of one replaced-token-detection step at DeBERTa-v3's vocabulary: ours against transformers' ELECTRA.

    python -m benchmarks.pretrain_memory                       # 8 x 512, vocabulary 128,100: ours and ELECTRA
    python -m benchmarks.pretrain_memory --baseline 2aca68d    # and ours as at that commit ("before"), its sampler
    python -m benchmarks.pretrain_memory --batch 2 --length 64 --vocab-size 1000 --no-record   # a quick look

Each loop runs in a fresh process, one after another: the models built (v3-xsmall's width: hidden 384, 6 heads,
intermediate 1536, DeBERTa-v3's relative positions; `--layers` discriminator and `--generator-layers` generator
layers), the fused AdamW `Trainer` uses, one batch of full-length sequences of random ordinary pieces; then one step
as `disentangled pretrain` runs it: the objective's forward (masking 15% inside it, per-sequence draws), backward,
gradient clipping to norm 1, the optimizer's step, gradients set to None. Then `--steps` more steps, timed.

- `ours`: `ReplacedTokenDetectionPretraining` (GDES, RTD weight 10, the generator with the Enhanced Mask Decoder).
- `ours at REV` (`--baseline REV`): the same code from REV's tree (`git archive`), first on the child's `sys.path`.
- `electra`: transformers' `ElectraForMaskedLM` generator and `ElectraForPreTraining` discriminator of the same sizes,
  word embeddings shared (ELECTRA's tied embeddings), in the usual loop: the generator's logits and MLM loss at every
  token, softmax at the masked positions, `torch.multinomial`, discriminator loss weight 50.

Peak, on the CPU: the process's resident high-water mark (VmHWM in /proc/self/status) during the step, less its
resident memory just before it; the mark is reset right before the step (writing 5 to /proc/self/clear_refs, Linux
4.0 and later) and freed heap memory handed back (malloc_trim), so building the models does not count and the step
cannot hide in memory the build left free. tracemalloc does not see torch's allocations. The peak includes what
the first step creates and keeps (Adam's moments: `optimizer_state_gib`, the rest is the step's transient memory).
On CUDA (`--device cuda`): torch.cuda.max_memory_allocated during the step less memory_allocated before it (not run
here: no GPU so far).

With `--baseline`, also times the replaced-token sampler alone at this shape in one process, interleaved: REV's
`sequence_draws.sample` (softmax of the [M, V] logits, its float64 copy and sums) against today's (the logits, a chunk
of rows at a time), on the same logits and draws, and checks that they draw the same tokens.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import inspect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.records import RECORDS, append_record

ROOT = Path(__file__).resolve().parent.parent
XSMALL = dict(hidden_size=384, num_attention_heads=6, intermediate_size=1536)  # DeBERTa-v3-xsmall's width
V3_SPECIAL = {"pad": 0, "cls": 1, "sep": 2, "unk": 3, "mask": 128000}  # DeBERTa-v3's ids ([MASK] at 128,000)
SAMPLER_REPEATS = 5


# ----------------------------------------------------------------------------------------------------------------------
# What every loop shares


class Vocabulary:
    """The facts of a tokenizer that the masking reads, for `size` pieces with DeBERTa-v3's special ids (the [MASK]
    id is the last piece when `size` is at most 128,000); every other piece starts a word."""

    def __init__(self, size: int):
        self.size = size
        self.pad_token_id, self.cls_token_id, self.sep_token_id, self.unk_token_id = 0, 1, 2, 3
        self.mask_token_id = V3_SPECIAL["mask"] if size > V3_SPECIAL["mask"] else size - 1
        self.mask_token = "[MASK]"
        self.all_special_ids = [0, 1, 2, 3, self.mask_token_id]

    def __len__(self) -> int:
        return self.size

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"▁piece{i}" for i in ids]


def batch_of(vocabulary: Vocabulary, batch: int, length: int, device: torch.device) -> dict[str, torch.Tensor]:
    """[CLS] + random ordinary pieces + [SEP], full length, seeded: what `disentangled pretrain` groups text into."""
    ordinary = torch.tensor([i for i in range(4, vocabulary.size) if i != vocabulary.mask_token_id])
    pieces = ordinary[torch.randint(len(ordinary), (batch, length - 2), generator=torch.Generator().manual_seed(0))]
    input_ids = torch.cat(
        [torch.full((batch, 1), vocabulary.cls_token_id), pieces, torch.full((batch, 1), vocabulary.sep_token_id)], 1
    )
    return {"input_ids": input_ids.to(device), "attention_mask": torch.ones_like(input_ids).to(device)}


def resident_gib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def high_water_gib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 2**20


def start_measuring(device: torch.device) -> float:
    """Forget the high-water mark; the memory in use now (GiB), from which the step's peak is counted."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**30
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages back to the system: the step must map its own
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the resident memory now
    except OSError as error:
        raise SystemExit(f"cannot reset the resident high-water mark ({error}): Linux 4.0 or later is needed") from None
    return resident_gib()


def peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**30
    return high_water_gib()


def optimizer_state_gib(optimizer: torch.optim.Optimizer) -> float:
    tensors = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors) / 2**30


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------------------
# The loops (each in its own process)


def build_ours(args: argparse.Namespace, vocabulary: Vocabulary):
    """Our objective as `disentangled pretrain --config xsmall` builds it, fewer layers; `disentangled` is today's
    package or, for `ours at REV`, REV's tree (first on sys.path)."""
    from disentangled import DisentangledConfig, DisentangledForMaskedLM
    from disentangled.modeling import DisentangledForReplacedTokenDetection
    from disentangled.pretraining import MaskingCollator, ReplacedTokenDetectionPretraining, generator_config
    from disentangled.pretraining.command import V3

    torch.manual_seed(0)
    config = DisentangledConfig(
        **V3, **XSMALL, num_hidden_layers=args.layers, vocab_size=vocabulary.size, pad_token_id=0
    )
    generator = DisentangledForMaskedLM(generator_config(config, args.generator_layers))
    discriminator = DisentangledForReplacedTokenDetection(config)
    masking = MaskingCollator(vocabulary, objective="rtd", seed=0)
    module = ReplacedTokenDetectionPretraining(
        generator, discriminator, "gdes", 10.0, masking=masking, global_token_mean=True
    )

    def step(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return module(**inputs).loss  # masks inside, as the command does

    return module, step


def build_electra(args: argparse.Namespace, vocabulary: Vocabulary):
    """transformers' ELECTRA pair of the same sizes, in the usual loop."""
    from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

    from disentangled.pretraining import MaskingCollator

    def config(layers: int) -> ElectraConfig:
        return ElectraConfig(
            vocab_size=vocabulary.size, embedding_size=XSMALL["hidden_size"], num_hidden_layers=layers,
            max_position_embeddings=512, pad_token_id=0, **XSMALL,
        )  # fmt: skip

    torch.manual_seed(0)
    generator = ElectraForMaskedLM(config(args.generator_layers))
    discriminator = ElectraForPreTraining(config(args.layers))
    discriminator.electra.embeddings.word_embeddings = generator.electra.embeddings.word_embeddings  # tied
    module = torch.nn.ModuleDict({"generator": generator, "discriminator": discriminator})
    masking = MaskingCollator(vocabulary, objective="rtd")

    def step(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        input_ids, labels = masking.mask(inputs["input_ids"], inputs["attention_mask"])
        generated = generator(input_ids=input_ids, attention_mask=inputs["attention_mask"], labels=labels)
        masked = labels != -100
        with torch.no_grad():
            probabilities = torch.softmax(generated.logits[masked], dim=-1)
            original = torch.where(masked, labels, input_ids)
            corrupted = original.clone()
            corrupted[masked] = torch.multinomial(probabilities, 1).squeeze(-1)
            replaced = (corrupted != original).long()
        detected = discriminator(input_ids=corrupted, attention_mask=inputs["attention_mask"], labels=replaced)
        return generated.loss + 50.0 * detected.loss

    return module, step


def child(args: argparse.Namespace, loop: str, out: Path) -> None:
    """One loop: build, one measured step, `--steps` timed steps; JSON to `out`."""
    device = torch.device(args.device)
    vocabulary = Vocabulary(args.vocab_size)
    module, step = (build_electra if loop == "electra" else build_ours)(args, vocabulary)
    module.to(device).train()
    # Trainer's default optimizer (adamw_torch_fused); weight decay 0 by default, so one group
    optimizer = torch.optim.AdamW(module.parameters(), lr=5e-4, fused=True)
    inputs = batch_of(vocabulary, args.batch, args.length, device)
    parameters_gib = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30
    times = []
    for number in range(1 + args.steps):
        if number == 0:
            before = start_measuring(device)
        start = time.perf_counter()
        loss = step(inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
        if number == 0:
            peak = peak_gib(device)
            first_loss = loss.item()
        del loss
    out.write_text(
        json.dumps(
            {
                "peak_gib": peak - before,
                "before_gib": before,
                "parameters_gib": parameters_gib,
                "optimizer_state_gib": optimizer_state_gib(optimizer),
                "first_step_seconds": times[0],
                "step_seconds": statistics.median(times[1:]) if args.steps else None,
                "loss": first_loss,
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


# ----------------------------------------------------------------------------------------------------------------------
# The parent: fresh processes, the old tree, the sampler's timing


def tree_at(revision: str, folder: Path) -> Path:
    """REV's package as an importable folder (`folder/path/disentangled`, with its modeling/, configuration/ and
    conversion/ where the package maps them); returns the folder to put first on sys.path."""
    tree = folder / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--baseline {revision}: git archive failed ({archive.stderr.decode().strip()})")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    package = folder / "path" / "disentangled"
    shutil.copytree(tree / "src" / "disentangled", package)
    for part in ("modeling", "configuration", "conversion"):
        shutil.copytree(tree / part, package / part)
    return folder / "path"


def run_child(args: argparse.Namespace, loop: str, folder: Path, python_path: Path | None = None) -> dict:
    out = folder / f"{loop.replace(' ', '-')}.json"
    command = [sys.executable, "-m", "benchmarks.pretrain_memory", "--child", loop, str(out)]
    command += ["--batch", str(args.batch), "--length", str(args.length), "--vocab-size", str(args.vocab_size)]
    command += ["--layers", str(args.layers), "--generator-layers", str(args.generator_layers)]
    command += ["--steps", str(args.steps), "--device", args.device]
    env = dict(os.environ)
    if python_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(python_path), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(command, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the {loop} loop failed (exit {done.returncode})")
    return json.loads(out.read_text())


def sampler_at(revision: str, folder: Path):
    """REV's `sequence_draws.sample` (a standalone file: hashlib and torch), loaded under its own name, as a
    function of (logits, draws): before it took the logits, it took their softmax [M, V], which the caller made."""
    shown = subprocess.run(
        ["git", "show", f"{revision}:src/disentangled/pretraining/sequence_draws.py"], cwd=ROOT, capture_output=True
    )
    if shown.returncode != 0:
        raise SystemExit(f"--baseline {revision}: no sequence_draws.py there ({shown.stderr.decode().strip()})")
    path = folder / "baseline_sequence_draws.py"
    path.write_bytes(shown.stdout)
    spec = importlib.util.spec_from_file_location("baseline_sequence_draws", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if next(iter(inspect.signature(module.sample).parameters)) == "probabilities":  # before it took the logits
        return lambda logits, draws: module.sample(torch.softmax(logits.float(), dim=-1), draws)
    return module.sample


def sampler_timings(args: argparse.Namespace, revision: str, folder: Path, masked: int) -> dict:
    """Median milliseconds of REV's sampler (softmax, then the whole [M, V] float64 sums) and today's (the logits,
    in chunks) on the same [M, V] logits and draws, interleaved; and whether they drew the same tokens."""
    from disentangled.pretraining.sequence_draws import sample

    before_sample = sampler_at(revision, folder)
    device = torch.device(args.device)
    logits = torch.randn(masked, args.vocab_size, generator=torch.Generator().manual_seed(0)).mul_(3).to(device)
    draws = torch.rand(masked, generator=torch.Generator().manual_seed(1)).to(device)

    def before():
        return before_sample(logits, draws)

    def after():
        return sample(logits, draws)

    times = {"before": [], "after": []}
    drawn = {}
    for _ in range(SAMPLER_REPEATS):
        for name, function in (("before", before), ("after", after)):
            synchronize(device)
            start = time.perf_counter()
            drawn[name] = function()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
    return {
        "masked": masked,
        "before_ms": medians["before"],
        "after_ms": medians["after"],
        "after_over_before": medians["after"] / medians["before"],
        "same_draws": bool(torch.equal(drawn["before"], drawn["after"])),
        "repeats": SAMPLER_REPEATS,
    }


def masked_count(args: argparse.Namespace) -> int:
    """How many tokens our masking picks in the benchmark's batch (seed 0, step 0): M."""
    from disentangled.pretraining import MaskingCollator

    vocabulary = Vocabulary(args.vocab_size)
    inputs = batch_of(vocabulary, args.batch, args.length, torch.device("cpu"))
    _, labels = MaskingCollator(vocabulary, objective="rtd", seed=0).mask(inputs["input_ids"], inputs["attention_mask"])
    return int((labels != -100).sum())


LOOP_LABELS = {"ours": "ours (disentangled RTD + GDES)", "electra": "transformers' ELECTRA (generator + discriminator)"}


def loop_label(name: str) -> str:
    """A loop's name as the page shows it: 'ours at 2aca68d' reads 'ours before, at commit 2aca68d'."""
    return LOOP_LABELS.get(name, name.replace("ours at ", "ours before, at commit "))


def markdown(record: dict) -> str:
    """The pretraining page's table for one record: each loop's peak above the built models, against ELECTRA's."""
    figures = record["figures"]
    loops = figures["loops"]
    electra = loops["electra"]["peak_gib"]
    device = figures["device"]
    lines = [
        f"One RTD step (forward, backward, clipping, fused AdamW), {figures['batch']} x {figures['length']} tokens, "
        f"vocabulary {figures['vocab_size']:,}, v3-xsmall width (hidden {figures['hidden_size']}), "
        f"{figures['layers']} discriminator and {figures['generator_layers']} generator layers, {figures['masked']} "
        f"masked tokens; each loop in a fresh process on {'the CPU' if device == 'cpu' else device}. Peak memory "
        f"above the built models ({'resident high-water mark' if device == 'cpu' else 'allocated'}); it includes "
        "Adam's moments, which the first step creates; seconds per step, the median of the steps after it:",
        "",
        "| loop | peak above the models | / ELECTRA's | of which Adam's moments | seconds per step |",
        "|---|---|---|---|---|",
    ]
    for name, loop in loops.items():
        name = loop_label(name)
        seconds = f"{loop['step_seconds']:.2f}" if loop.get("step_seconds") else f"{loop['first_step_seconds']:.2f}"
        lines.append(
            f"| {name} | {loop['peak_gib']:.2f} GiB | {loop['peak_gib'] / electra:.2f}x "
            f"| {loop['optimizer_state_gib']:.2f} GiB | {seconds} |"
        )
    sampler = figures.get("sampler")
    if sampler:
        lines += [
            "",
            f"The sampler alone ({sampler['masked']} x {figures['vocab_size']:,} logits, median of {sampler['repeats']} "
            f"interleaved calls): {sampler['before_ms']:.0f} ms before, {sampler['after_ms']:.0f} ms now "
            f"({sampler['after_over_before']:.2f}x), "
            + ("the same tokens drawn." if sampler["same_draws"] else "**different tokens drawn**."),
        ]
    return "\n".join(lines)


def section(records: list[dict]) -> str:
    """docs/pretraining.md's generated section: the newest full-size record per device, with where it ran."""
    newest = {}
    for record in records:
        if record["figures"]["vocab_size"] >= 128000:
            newest[record["figures"]["device"]] = record
    if not newest:
        return "No record yet: `python -m benchmarks.pretrain_memory --baseline REV` writes one."
    parts = []
    for record in newest.values():
        parts.append(
            f"{record['processor']}, {record['threads']} threads, torch {record['torch']}, transformers "
            f"{record['transformers']}, commit {record['commit']}, {record['time'][:10]}. Command: "
            f"`{record['command']}`\n\n{markdown(record)}"
        )
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=128100, help="DeBERTa-v3's 128,100 by default")
    parser.add_argument("--layers", type=int, default=2, help="discriminator layers (v3-xsmall has 12)")
    parser.add_argument("--generator-layers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the measured one")
    parser.add_argument("--baseline", metavar="REV", help="also ours as at this commit, and its sampler's timing")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda where a GPU is available")
    parser.add_argument("--no-record", action="store_true", help="append no record to benchmarks/records/")
    parser.add_argument("--records", type=Path, default=RECORDS, help=argparse.SUPPRESS)  # the tests' own folder
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # loop, output JSON
    args = parser.parse_args(argv)
    if args.child:
        child(args, args.child[0], Path(args.child[1]))
        return
    if args.length > 512:
        raise SystemExit("--length is at most 512: the generator's decoder reads a 512-row position table")
    masked = masked_count(args)
    loops = {}
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        if args.baseline:
            loops[f"ours at {args.baseline}"] = run_child(args, "ours", folder, tree_at(args.baseline, folder))
        loops["ours"] = run_child(args, "ours", folder)
        loops["electra"] = run_child(args, "electra", folder)
        sampler = sampler_timings(args, args.baseline, folder, masked) if args.baseline else None
    figures = {
        "device": args.device,
        "batch": args.batch,
        "length": args.length,
        "vocab_size": args.vocab_size,
        "hidden_size": XSMALL["hidden_size"],
        "layers": args.layers,
        "generator_layers": args.generator_layers,
        "timed_steps": args.steps,
        "masked": masked,
        "baseline": args.baseline,
        "loops": loops,
        "sampler": sampler,
    }
    record = {"figures": figures}
    if not args.no_record:
        record = append_record("pretrain_memory", figures, folder=args.records)
    print(json.dumps(loops, indent=1))
    print(markdown(record))


if __name__ == "__main__":
    main()
