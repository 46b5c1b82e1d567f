"""Reading a DeBERTa checkpoint: a local folder or a Hub repo, its config and its weights, without running its code.

Two families of layout are read:
- transformers' own (`config.json` with model_type `deberta` or `deberta-v2`; `model.safetensors` or
  `pytorch_model.bin`, either one sharded with an index);
- Microsoft's `DeBERTa` package (`pytorch.model.bin` or `pytorch_model.bin`; the config in `model_config.json`,
  in a `config.json` without model_type, or inside the state dict as `config`);
- Microsoft's DeBERTa-v3 generators, released beside the discriminator: `pytorch_model.generator.bin` with
  `generator_config.json`, read when asked for (`generator=True`) or when they are the folder's only weights.

Pickled files are read with `torch.load(weights_only=True)` only. Python files in a source are never downloaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

SUPPORTED_MODEL_TYPES = {"deberta": "DeBERTa v1", "deberta-v2": "DeBERTa v2, v3 and mDeBERTa"}
# Weight files, in order of preference: (index file or None, single file).
WEIGHT_FILES = [
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    (None, "pytorch.model.bin"),
]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "spm.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
CONFIG_FILES = ("config.json", "model_config.json")
GENERATOR_WEIGHTS, GENERATOR_CONFIG = "pytorch_model.generator.bin", "generator_config.json"
CARD_FILE = "README.md"  # read for its license only
# A Hub repo id: "name" or "owner/name", letters, digits, "-", "_", "." (no "--" or ".." and no leading/trailing "-.").
REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


@dataclass
class Source:
    """A checkpoint as read: where it is, its config dict, its tensors and what kind of layout it has."""

    name: str  # as the user gave it: a path or a repo id
    folder: Path
    config: dict
    state_dict: dict[str, Tensor]
    layout: str  # "transformers" or "microsoft"
    repo_id: str | None = None  # set when fetched from the Hub
    revision: str | None = None
    weight_files: list[str] = field(default_factory=list)
    generator: bool = False  # Microsoft's generator (a masked-LM model trained with the Enhanced Mask Decoder)

    @property
    def license(self) -> str | None:
        """The license in the source's model card metadata, or its config, when it names one."""
        card = self.folder / CARD_FILE
        if card.is_file():
            from huggingface_hub import ModelCard

            try:
                license_name = ModelCard.load(card).data.license
            except Exception:  # a malformed card only costs the license line
                license_name = None
            if isinstance(license_name, str):
                return license_name
        license_name = self.config.get("license")
        return license_name if isinstance(license_name, str) else None

    @property
    def tokenizer_files(self) -> list[str]:
        return [name for name in TOKENIZER_FILES if (self.folder / name).is_file()]


def is_repo_id(text: str) -> bool:
    return bool(REPO_ID.match(text)) and "--" not in text and ".." not in text and not text.endswith((".", "-"))


def resolve_folder(
    source: str, revision: str | None = None, token: str | None = None, generator: bool = False
) -> tuple[Path, str | None]:
    """A local folder for `source`, downloading the config, weight and tokenizer files when it is a Hub repo id.

    Returns (folder, repo_id or None). The Hub is reached through huggingface_hub, which honours `HF_TOKEN`,
    the stored login and offline mode (`HF_HUB_OFFLINE=1`: the local cache only).
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return path, None
    if path.exists():
        raise ValueError(f"source {source!r} is a file; give the folder that holds the checkpoint")
    if not is_repo_id(source):
        raise FileNotFoundError(f"source {source!r} is neither a folder nor a valid Hub repo id")
    return _download(source, revision, token, generator), source


def _download(repo_id: str, revision: str | None, token: str | None, generator: bool = False) -> Path:
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import HfHubHTTPError

    try:
        configs = (*CONFIG_FILES, GENERATOR_CONFIG)
        if constants.HF_HUB_OFFLINE:
            wanted = [*configs, *TOKENIZER_FILES, CARD_FILE, "*.safetensors", "*.bin", "*.index.json"]
        else:
            available = set(HfApi().list_repo_files(repo_id, revision=revision, token=token))
            wanted = [name for name in (*configs, *TOKENIZER_FILES, CARD_FILE) if name in available]
            if generator:
                if GENERATOR_WEIGHTS not in available:
                    raise FileNotFoundError(f"Hub repo {repo_id!r} has no generator ({GENERATOR_WEIGHTS})")
                wanted.append(GENERATOR_WEIGHTS)
            else:
                wanted += _weight_files_of(available, repo_id)
        # allow_patterns never names a .py file: a source's code is not even downloaded.
        return Path(snapshot_download(repo_id, revision=revision, token=token, allow_patterns=wanted))
    except (RepositoryNotFoundError, GatedRepoError) as error:
        raise FileNotFoundError(f"Hub repo {repo_id!r} not found or not accessible ({type(error).__name__})") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"revision {revision!r} not found in Hub repo {repo_id!r}") from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"Hub repo {repo_id!r} is not in the local cache and the Hub is offline") from None
    except HfHubHTTPError as error:
        raise ValueError(f"could not fetch {repo_id!r} from the Hub: {str(error).splitlines()[0]}") from None
    except (FileNotFoundError, ValueError):
        raise
    except Exception as error:  # connection errors: one line, never a traceback
        raise ValueError(f"could not fetch {repo_id!r} from the Hub: {type(error).__name__}: {error}") from None


def _weight_files_of(available: set[str], repo_id: str) -> list[str]:
    for index, single in WEIGHT_FILES:
        if index is not None and index in available:
            stem = single.rsplit(".", 1)[0]
            return [index] + sorted(name for name in available if name.startswith(stem + "-") and "/" not in name)
        if single in available:
            return [single]
    if GENERATOR_WEIGHTS in available:  # a repo that holds only a generator
        return [GENERATOR_WEIGHTS]
    raise FileNotFoundError(f"Hub repo {repo_id!r} has no weight file (looked for {_weight_names()})")


def _weight_names() -> str:
    return ", ".join(name for pair in WEIGHT_FILES for name in pair if name)


def load_tensors(path: Path) -> dict:
    """One weight file: safetensors, or a pickle read with weights_only=True (tensors and plain data only)."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(f"corrupt weight file {path.name}: {error}") from None
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip and unpickler errors all mean the same thing here
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"cannot read weight file {path.name} safely (weights_only=True): {message}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"weight file {path.name} holds a {type(loaded).__name__}, not a state dict")
    return loaded


def load_weights(folder: Path) -> tuple[dict, list[str]]:
    """All tensors of the checkpoint in `folder` (merging shards), and the files read."""
    for index, single in WEIGHT_FILES:
        if index is not None and (folder / index).is_file():
            try:
                weight_map = json.loads((folder / index).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"corrupt shard index {index}: {error}") from None
            shards = sorted(set(weight_map.values()))
            tensors: dict = {}
            for shard in shards:
                if not isinstance(shard, str) or shard in ("", ".", "..") or Path(shard).name != shard:
                    raise ValueError(f"{index} names shard {shard!r}: shards must be plain file names in the folder")
                if not (folder / shard).is_file():
                    raise FileNotFoundError(f"shard {shard} named in {index} is missing from {folder}")
                tensors.update(load_tensors(folder / shard))
            if missing := sorted(set(weight_map) - set(tensors)):
                raise ValueError(f"{index} names tensors no shard holds: {missing[:5]}")
            return tensors, [index, *shards]
        if (folder / single).is_file():
            return load_tensors(folder / single), [single]
    raise FileNotFoundError(f"no weight file in {folder} (looked for {_weight_names()})")


def read_config(folder: Path, state_dict: dict) -> tuple[dict, str]:
    """The checkpoint's config dict and its layout: "transformers" when config.json names a model_type."""
    for name in CONFIG_FILES:
        if (folder / name).is_file():
            try:
                config = json.loads((folder / name).read_text())
            except ValueError as error:
                raise ValueError(f"{name} is not valid JSON: {error}") from None
            if not isinstance(config, dict):
                raise ValueError(f"{name} does not hold a JSON object")
            break
    else:
        embedded = state_dict.get("config")
        if isinstance(embedded, str):
            embedded = json.loads(embedded)
        if not isinstance(embedded, dict):
            raise FileNotFoundError(f"no config.json or model_config.json in {folder}, and none inside the state dict")
        config = embedded
    model_type = config.get("model_type")
    if model_type is None:
        return config, "microsoft"
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(f"{name} ({what})" for name, what in SUPPORTED_MODEL_TYPES.items())
        raise ValueError(f"model_type {model_type!r} is not a DeBERTa; supported: {supported}")
    return config, "transformers"


def is_generator_only(folder: Path) -> bool:
    """The folder's only weights are a generator's."""
    has_other = any((folder / name).is_file() for pair in WEIGHT_FILES for name in pair if name)
    return (folder / GENERATOR_WEIGHTS).is_file() and not has_other


def read_generator(folder: Path) -> tuple[dict, str, dict, list[str]]:
    """Microsoft's generator: its config (generator_config.json) and layout, its tensors and the files read."""
    for name in (GENERATOR_WEIGHTS, GENERATOR_CONFIG):
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"no {name} in {folder}: a generator is read from {GENERATOR_WEIGHTS} with {GENERATOR_CONFIG}"
            )
    try:
        config = json.loads((folder / GENERATOR_CONFIG).read_text())
    except ValueError as error:
        raise ValueError(f"{GENERATOR_CONFIG} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{GENERATOR_CONFIG} does not hold a JSON object")
    model_type = config.get("model_type")
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{GENERATOR_CONFIG}: model_type {model_type!r} is not a DeBERTa")
    state_dict = load_tensors(folder / GENERATOR_WEIGHTS)
    return config, "microsoft" if model_type is None else "transformers", state_dict, [GENERATOR_WEIGHTS]


def read_source(source: str, revision: str | None = None, token: str | None = None, generator: bool = False) -> Source:
    folder, repo_id = resolve_folder(source, revision, token, generator)
    generator = generator or is_generator_only(folder)
    if generator:
        config, layout, state_dict, files = read_generator(folder)
    else:
        config_present = any((folder / name).is_file() for name in CONFIG_FILES)
        if config_present:  # fail on a foreign model_type before reading gigabytes of weights
            read_config(folder, {})
        state_dict, files = load_weights(folder)
        config, layout = read_config(folder, state_dict)
    tensors = {key: value for key, value in state_dict.items() if isinstance(value, Tensor)}
    if not tensors:
        raise ValueError(f"the weight files of {source!r} hold no tensors")
    return Source(
        name=source,
        folder=folder,
        config=config,
        state_dict=tensors,
        layout=layout,
        repo_id=repo_id,
        revision=revision,
        weight_files=files,
        generator=generator,
    )
