"""Fetch transformers' common model tests for the installed transformers: `python -m tests.common_suite_fetch`.

`tests/test_common_suite.py` runs transformers' own `ModelTesterMixin` and `ConfigTester` on our heads. Those live in
transformers' repository under tests/, not in the wheel; the source distribution on the package index ships the
top-level common files (tests/test_modeling_common.py, tests/test_configuration_common.py, ...). This command
downloads the source distribution of the *installed* version with pip, and unpacks those files as the package
`transformers_common_tests` under `.transformers-tests/<version>/` (git-ignored, reused when present).

Three modules that test_modeling_common.py and test_configuration_common.py import are not in the source
distribution; the command writes stand-ins for them, marked as such:
- `exporters/test_export.py`: `ExportTesterMixin`, the torch.export tests, a base class of `ModelTesterMixin`. The
  stand-in is empty, so those tests are not run here (tests/test_compile.py and tests/test_onnx_export.py cover
  export).
- `generation/test_utils.py`: `GenerationTesterMixin`, for models that generate; encoders do not.
- `utils/test_configuration_utils.py`: `config_common_kwargs`, the non-default values of `PretrainedConfig`'s common
  arguments that `ConfigTester.check_config_arguments_init` passes to a config and reads back.

Usage: `python -m tests.common_suite_fetch [--version X.Y.Z] [--cache DIR]`; prints the folder to put on sys.path.
`DISENTANGLED_TRANSFORMERS_TESTS` overrides the cache root for the test module too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "transformers_common_tests"
ROOT = Path(__file__).resolve().parent.parent
# The files the suite needs; the rest of tests/*.py comes along (small), but these must be there.
REQUIRED = ("test_modeling_common.py", "test_configuration_common.py")

STAND_INS = {
    "exporters/test_export.py": '''\
"""Stand-in written by disentangled's tests/common_suite_fetch.py: tests/exporters/ is not in transformers'
source distribution, so the torch.export tests of ModelTesterMixin are not run."""


class ExportTesterMixin:
    pass
''',
    "generation/test_utils.py": '''\
"""Stand-in written by disentangled's tests/common_suite_fetch.py: tests/generation/ is not in transformers'
source distribution; encoders do not generate, and their testers do not inherit this mixin."""


class GenerationTesterMixin:
    pass
''',
    "utils/test_configuration_utils.py": '''\
"""Stand-in written by disentangled's tests/common_suite_fetch.py: tests/utils/ is not in transformers' source
distribution. Non-default values of PretrainedConfig's common arguments, which ConfigTester passes to a config and
reads back."""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",  # ConfigTester reads it back as torch.float16 (`dtype` since transformers 4.56)
    "tie_word_embeddings": False,
    "chunk_size_feed_forward": 5,
    "architectures": ["DisentangledModel"],
    "finetuning_task": "classification",
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
    "pad_token_id": 3,
}
''',
}


def installed_version() -> str:
    import transformers

    return transformers.__version__


def cache_root() -> Path:
    return Path(os.environ.get("DISENTANGLED_TRANSFORMERS_TESTS", ROOT / ".transformers-tests"))


def suite_path(version: str | None = None, root: Path | None = None) -> Path:
    """The folder that holds the package `transformers_common_tests` for `version` (installed by default)."""
    return (root or cache_root()) / (version or installed_version())


def is_fetched(version: str | None = None, root: Path | None = None) -> bool:
    package = suite_path(version, root) / PACKAGE
    return all((package / name).is_file() for name in REQUIRED)


def download_sdist(version: str, into: Path) -> Path:
    """pip's own download of the source distribution transformers==version (no wheel, no dependencies)."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
    command += ["--dest", str(into), f"transformers=={version}"]
    subprocess.run(command, check=True)
    found = sorted(into.glob("transformers-*.tar.gz"))
    if not found:
        raise FileNotFoundError(f"pip downloaded no transformers-{version}.tar.gz into {into}")
    return found[0]


def unpack_common_tests(sdist: Path, package: Path) -> list[str]:
    """Write the sdist's top-level tests/*.py into `package`, plus the stand-ins; returns the names unpacked."""
    names = []
    package.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts  # transformers-X.Y.Z/tests/name.py
            if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") and member.isfile():
                (package / parts[2]).write_bytes(archive.extractfile(member).read())
                names.append(parts[2])
    if missing := [name for name in REQUIRED if name not in names]:
        raise FileNotFoundError(f"{sdist.name} has no tests/{', tests/'.join(missing)}")
    (package / "__init__.py").write_text("")
    for relative, text in STAND_INS.items():
        target = package / relative
        if target.exists():  # a later sdist that ships it: keep the real one
            continue
        target.parent.mkdir(exist_ok=True)
        (target.parent / "__init__.py").touch()
        target.write_text(text)
    return sorted(names)


def fetch(version: str | None = None, root: Path | None = None) -> Path:
    """Download and unpack once; the folder appears complete or not at all."""
    version = version or installed_version()
    destination = suite_path(version, root)
    if is_fetched(version, root):
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=destination.parent) as scratch:
        scratch = Path(scratch)
        sdist = download_sdist(version, scratch / "download")
        staging = scratch / "staging"
        unpack_common_tests(sdist, staging / PACKAGE)
        if destination.exists():  # an incomplete earlier attempt
            shutil.rmtree(destination)
        staging.rename(destination)
    return destination


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", help="transformers version (default: the installed one)")
    parser.add_argument("--cache", type=Path, help="cache root (default: .transformers-tests in the repository)")
    args = parser.parse_args(argv)
    print(fetch(args.version, args.cache))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
