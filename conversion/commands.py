"""The `convert`, `push` and `export-transformers` commands of the `disentangled` console script."""

from __future__ import annotations

import argparse

from .convert import DTYPES, TASKS


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a local folder or a Hub repo id of a DeBERTa checkpoint (v1, v2, v3, mDeBERTa)")
    parser.add_argument("output_dir", help="folder to write (must be empty or absent unless --force)")
    parser.add_argument("--task", choices=list(TASKS), help="head to convert (default: the source's architectures)")
    parser.add_argument(
        "--enhanced-mask-decoder",
        action="store_true",
        help="masked-lm with DeBERTa's Enhanced Mask Decoder (needs the absolute position table; Microsoft's own "
        "MLM checkpoints and generators use it by default)",
    )
    parser.add_argument(
        "--generator",
        action="store_true",
        help="convert Microsoft's generator (pytorch_model.generator.bin + generator_config.json) beside the weights",
    )
    parser.add_argument("--revision", help="Hub revision (branch, tag or commit) of the source")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the written weights")
    parser.add_argument("--max-shard-size", default="5GB", help="shard the weights above this size (e.g. 2GB)")
    parser.add_argument("--no-verify", action="store_true", help="skip the parity check against transformers")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    parser.add_argument("--push-to", metavar="REPO_ID", help="after a successful conversion, upload to this Hub repo")
    _add_push_options(parser)


def run_convert(args: argparse.Namespace) -> int:
    from .convert import convert
    from .hub import check_repo_id

    if args.push_to:
        check_repo_id(args.push_to)
    convert(
        args.source,
        args.output_dir,
        task=args.task,
        enhanced_mask_decoder=args.enhanced_mask_decoder,
        generator=args.generator,
        revision=args.revision,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        verify=not args.no_verify,
        force=args.force,
        repo_id=args.push_to,
    )
    if args.push_to:
        _push(args, args.push_to)
    return 0


def _push(args: argparse.Namespace, repo_id: str) -> None:
    """Upload args.output_dir with the push options both `convert --push-to` and `push` take."""
    from .hub import push_folder

    push_folder(
        args.output_dir,
        repo_id,
        private=args.private,
        revision=args.push_revision,
        create_pr=args.create_pr,
        commit_message=args.commit_message,
        dry_run=args.dry_run,
    )


def _add_push_options(parser: argparse.ArgumentParser, revision_flag: str = "--push-revision") -> None:
    parser.add_argument("--private", action="store_true", help="create the Hub repo as private")
    parser.add_argument(revision_flag, dest="push_revision", help="branch of the Hub repo to commit to")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.add_argument("--commit-message", help="message of the upload commit")
    parser.add_argument("--dry-run", action="store_true", help="print what would be uploaded; no network")


def add_push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", help="a folder written by `disentangled convert`")
    parser.add_argument("repo_id", help="Hub repo id, e.g. you/deberta-v3-base-disentangled")
    _add_push_options(parser, revision_flag="--revision")


def run_push(args: argparse.Namespace) -> int:
    _push(args, args.repo_id)
    return 0


def add_export_transformers_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", help="a folder written by `disentangled convert` (or a Hub repo id of one)")
    parser.add_argument("hf_dir", help="folder to write in transformers' DeBERTa-v2 format")
    parser.add_argument("--revision", help="Hub revision when output_dir is a repo id")
    parser.add_argument(
        "--task",
        choices=["base"],
        help="export the encoder alone (for heads transformers cannot represent: the Enhanced Mask Decoder, RTD)",
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the parity check")
    parser.add_argument("--force", action="store_true", help="replace a non-empty hf_dir")


def run_export_transformers(args: argparse.Namespace) -> int:
    from .export import export_transformers

    export_transformers(
        args.output_dir,
        args.hf_dir,
        revision=args.revision,
        task=args.task,
        verify=not args.no_verify,
        force=args.force,
    )
    return 0
