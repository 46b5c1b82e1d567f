"""Run a training script under `accelerate launch --config_file examples/accelerate/{fsdp2,zero3}.yaml` on CPU processes.

accelerate takes FSDP and DeepSpeed only on GPUs: on CPU processes (gloo) its `AcceleratorState` keeps
`DistributedType.MULTI_CPU` and plain DDP, whatever the config says. This shim, the only thing the tests add to what a
user runs, lets the state take the engine the config names; Trainer, accelerate's FSDP2 preparation (`fully_shard`),
DeepSpeed's ZeRO-3 engine and their checkpointing then run as on GPUs (less DeepSpeed's shared-memory kernel for
inference on CPUs, which it would compile: `skip_the_shared_memory_kernel`).

    python -m accelerate.commands.launch --config_file examples/accelerate/fsdp2.yaml tests/cpu_sharding.py \\
        examples/finetune.py ARGS...          # or: tests/cpu_sharding.py -m disentangled.cli pretrain ARGS...

Without a launcher it runs one plain process; `--one-after-another JOBS.json` runs several one-process runs in it.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path


def allow_sharding_on_cpu() -> None:
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    os.environ["ACCELERATE_USE_CPU"] = "true"  # TrainingArguments: gloo processes (MULTI_CPU), not one lone process
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        skip_the_shared_memory_kernel()
    original = AcceleratorState.__init__

    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        if self.distributed_type != DistributedType.MULTI_CPU:
            return
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, kwargs["fsdp_plugin"]
            if self._mixed_precision != "no":  # what the GPU branch does: bf16 parameters in forward and backward
                self.fsdp_plugin.set_mixed_precision(self._mixed_precision)
        elif os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            plugin = kwargs["deepspeed_plugin"]
            plugin.set_mixed_precision(self._mixed_precision)
            plugin.select(_from_accelerator_state=True)
            self.distributed_type, self.deepspeed_plugins = DistributedType.DEEPSPEED, plugin
            self._mixed_precision = "no"  # DeepSpeed takes the precision from its own config
        PartialState._shared_state["distributed_type"] = self.distributed_type

    AcceleratorState.__init__ = __init__


def skip_the_shared_memory_kernel() -> None:
    """DeepSpeed's CPU accelerator compiles its shared-memory all-reduce kernel (deepspeed_shm_comm: two C++ files,
    about 2 minutes of compiler time on a machine without a torch_extensions cache) when it sets up communication,
    after probing every op's compiler requirements. Only `inference_all_reduce` uses it, training never does, and on
    GPUs there is no such kernel. Marked not compatible, it is neither probed nor built; the collectives go to gloo."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__ = {ShareMemCommBuilder.NAME: False}


def local_count(parameter) -> int:
    """The elements of `parameter` this process holds: its ZeRO-3 partition, its FSDP2 shard, or all of it."""
    if hasattr(parameter, "ds_tensor"):
        return parameter.ds_tensor.numel()
    if hasattr(parameter, "to_local"):
        return parameter.to_local().numel()
    return parameter.numel()


def record_to(path: str):
    """Each process writes `path`.RANK.json at the end of training: the engine, the elements of the parameters it
    holds and their full count, and the loss of each of its batches at full precision. Returns what undoes it."""
    import json

    import transformers

    losses: list[float] = []
    facts: dict = {}

    class Record(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if not facts:  # the model is wrapped and sharded by now
                parameters = list(model.parameters())
                facts["local"] = sum(local_count(p) for p in parameters)
                facts["total"] = sum(getattr(p, "ds_numel", p.numel()) for p in parameters)
                facts["dtensor"] = sum(hasattr(p, "to_local") for p in parameters)
                facts["zero3"] = sum(hasattr(p, "ds_tensor") for p in parameters)

        def on_train_end(self, args, state, control, **kwargs):
            rank = int(os.environ.get("RANK", 0))
            with open(f"{path}.{rank}.json", "w") as file:
                json.dump({**facts, "losses": losses, "step": state.global_step}, file)

    original_init, original_loss = transformers.Trainer.__init__, transformers.Trainer.compute_loss

    def __init__(self, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        self.add_callback(Record())

    def compute_loss(self, *args, **kwargs):
        loss = original_loss(self, *args, **kwargs)
        if self.model.training:
            losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
        return loss

    def undo() -> None:
        transformers.Trainer.__init__, transformers.Trainer.compute_loss = original_init, original_loss

    transformers.Trainer.__init__, transformers.Trainer.compute_loss = __init__, compute_loss
    return undo


def run(target: list[str]) -> None:
    """`target` as `python ...` runs it: a script and its arguments, or `-m module ...`."""
    if target[0] == "-m":
        sys.argv = target[1:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        runpy.run_path(sys.argv[0], run_name="__main__")


def one_after_another(jobs: str) -> None:
    """One-process runs in this process, one after another (their imports made once): `jobs` is a JSON file's path,
    the file a list of {"cwd", "record", "target"}. Each run seeds itself as in a process of its own."""
    import json

    for job in json.loads(Path(jobs).read_text()):
        os.chdir(job["cwd"])
        undo = record_to(job["record"])
        try:
            run(job["target"])
        except SystemExit as exit:  # `python -m disentangled.cli` ends with sys.exit(main())
            if exit.code not in (None, 0):
                raise
        finally:
            undo()


if __name__ == "__main__":
    if sys.argv[1] == "--one-after-another":
        one_after_another(sys.argv[2])
        sys.exit()
    if "SHARDED_RECORD" in os.environ:
        record_to(os.environ["SHARDED_RECORD"])
    if "LOCAL_RANK" in os.environ:
        allow_sharding_on_cpu()
    run(sys.argv[1:])
