"""Upload a converted folder to the Hub: create the repo if needed, then one `upload_folder` commit.

Authentication is huggingface_hub's own (`HF_TOKEN` or the stored login); the token is never printed.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from .bundle import bundle_sources
from .sources import TOKENIZER_FILES


def check_repo_id(repo_id: str) -> str:
    """Raise ValueError unless `repo_id` is a valid Hub model repo id ("name" or "owner/name")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"invalid Hub repo id {repo_id!r}: {str(error).splitlines()[0]}") from None
    return repo_id


# What `disentangled convert` writes, and so all that `push` uploads: a stray `.env`, a key or a notebook
# left in the folder stays local.
UPLOADED_PATTERNS = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "README.md",
    *TOKENIZER_FILES,
)


def folder_files(folder: Path, log=None) -> list[Path]:
    """The top-level files of `folder` that a conversion writes; refuses symbolic links among them."""
    patterns = (*UPLOADED_PATTERNS, *bundle_sources())  # the remote-code files, by name
    chosen, skipped = [], []
    for path in sorted(folder.iterdir()):
        if any(fnmatch.fnmatchcase(path.name, pattern) for pattern in patterns):
            if path.is_symlink():
                raise ValueError(f"{path.name} in {folder} is a symbolic link; push uploads regular files only")
            if path.is_file():
                chosen.append(path)
                continue
        skipped.append(path.name)
    if skipped and log is not None:
        log(f"not uploaded (not written by a conversion): {', '.join(skipped)}")
    return chosen


def check_converted_folder(folder: Path) -> None:
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"folder {folder} does not exist")
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a folder written by `disentangled convert`")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "disentangled" or "auto_map" not in config:
        raise ValueError(f"{folder} is not a folder written by `disentangled convert` (model_type, auto_map)")


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    dry_run: bool = False,
    log=print,
):
    """Create `repo_id` (exist_ok) and upload `folder` in one commit; `dry_run` lists what would go, offline."""
    folder = Path(folder).expanduser()
    check_repo_id(repo_id)
    check_converted_folder(folder)
    if create_pr and revision:
        raise ValueError(
            "--create-pr opens a pull request against the default branch; do not combine it with a revision"
        )
    files = folder_files(folder, log)
    message = commit_message or f"Upload {folder.name}, converted with `disentangled convert`"
    target = f"{repo_id}" + (f"@{revision}" if revision else "") + (" (pull request)" if create_pr else "")
    if dry_run:
        log(f"dry run: would upload {len(files)} files to {target}{' (private)' if private else ''}")
        for path in files:
            log(f"  {path.relative_to(folder).as_posix():<40} {path.stat().st_size:>14,d} bytes")
        log(f"  total {sum(p.stat().st_size for p in files):,d} bytes; commit message: {message!r}")
        return None

    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError

    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private or None, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(url.repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=url.repo_id,
            folder_path=folder,
            allow_patterns=[path.name for path in files],
            commit_message=message,
            revision=revision,
            create_pr=create_pr,
        )
    except HfHubHTTPError as error:
        raise ValueError(f"upload to {repo_id!r} failed: {str(error).splitlines()[0]}") from None
    except ValueError:
        raise
    except Exception as error:  # connection and disk errors: one line, never a traceback (the token is not in it)
        raise ValueError(f"upload to {repo_id!r} failed: {type(error).__name__}: {error}") from None
    log(f"pushed {len(files)} files to {target}: {info.pr_url or info.commit_url}")
    return info
