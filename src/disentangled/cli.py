"""The `disentangled` command. Each subcommand lives in its own module, imported only when it runs.

A command module exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "demo": (
        "disentangled.demo.command",
        "pretrain a small DeBERTa-v3-style model on built-in text, convert it and run it end to end",
    ),
    "convert": (
        "disentangled.conversion.commands",
        "convert a DeBERTa checkpoint (folder or Hub id) to this architecture",
    ),
    "push": ("disentangled.conversion.commands", "upload a converted folder to the Hub"),
    "export-transformers": (
        "disentangled.conversion.commands",
        "export a converted folder back to transformers' DeBERTa-v2",
    ),
    "export-onnx": ("disentangled.serving.onnx_export", "export a model folder to ONNX"),
    "pretrain": (
        "disentangled.pretraining.command",
        "pretrain or continue pretraining a DeBERTa model (RTD with GDES, or MLM)",
    ),
    "explain": (
        "disentangled.explain.explanation",
        "show each attention term (c2c, c2p, p2c, p2p) of a model on a text or averaged over a file of texts",
    ),
    "build-kernels": (
        "disentangled.serving.prebuilt",
        "write the CPU kernels' libraries (PyTorch's and ONNX Runtime's) into a folder, for machines without a compiler",
    ),
    "env": (
        "disentangled.environment.report",
        "print the versions, processor, GPUs and attention paths of this machine (paste it into a bug report)",
    ),
}


def _command_function(module, kind: str, command: str):
    """`add_<command>_arguments` / `run_<command>` when a module serves several commands, else `add_arguments` / `run`."""
    name = command.replace("-", "_")
    specific = f"add_{name}_arguments" if kind == "add_arguments" else f"run_{name}"
    return getattr(module, specific, None) or getattr(module, kind)


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The parser; only the chosen command's module is imported (for its arguments)."""
    parser = argparse.ArgumentParser(prog="disentangled", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == command:
            _command_function(importlib.import_module(module_name), "add_arguments", name)(subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    run = _command_function(importlib.import_module(COMMANDS[args.command][0]), "run", args.command)
    try:
        status = int(run(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError, PermissionError) as error:
        print(f"disentangled {args.command}: error: {error}", file=sys.stderr)
        return 2
    destroy_process_group()
    return status


def destroy_process_group() -> None:
    """Tears down the process group a launcher's run set up (`Trainer` under torchrun or accelerate), once the
    command has finished. Left to interpreter exit, Gloo's worker threads can abort a finished process ("terminate
    called without an active exception", pytorch/pytorch#190489). Not after an error: the other processes may still
    be inside a collective, and tearing down there can hang."""
    distributed = sys.modules.get("torch.distributed")  # never imports torch for a command that did not
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
