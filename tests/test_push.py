"""`push` and `convert --push-to` through the real huggingface_hub client, against a Hub stand-in on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conversion_sources import build_model
from hub_standin import HubStandIn

TOKEN = "hf_standinSecretToken0123456789"


def run_cli(*argv, endpoint: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_ENDPOINT": endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "disentangled.cli", *map(str, argv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("push-source") / "tiny-v3"
    build_model("v3", "ForSequenceClassification").save_pretrained(folder)
    return folder


def test_convert_push_to_creates_the_repo_and_uploads_every_file_in_one_commit(tmp_path, source):
    out = tmp_path / "tiny-v3-disentangled"
    with HubStandIn() as hub:
        result = run_cli(
            "convert", source, out, "--push-to", "me/tiny-v3-disentangled", "--private",
            "--commit-message", "First upload", endpoint=hub.endpoint,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert hub.repos["me/tiny-v3-disentangled"]["private"] is True
        assert len(hub.commits) == 1 and hub.commits[0]["summary"] == "First upload"
        uploaded = hub.commits[0]["files"]
        local = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
        assert uploaded == local  # every file, byte for byte
        assert hub.repos["me/tiny-v3-disentangled"]["branches"]["main"] == local
        assert (
            "me/tiny-v3-disentangled" in hub.validated_yaml[0] or "library_name: transformers" in hub.validated_yaml[0]
        )
        assert all(header == f"Bearer {TOKEN}" for header in hub.authorization)
        assert TOKEN not in result.stdout + result.stderr
        assert "parity" in result.stdout and "pushed" in result.stdout

        # again, to an existing repo and a branch: the repo is reused, one more commit
        again = run_cli("push", out, "me/tiny-v3-disentangled", "--revision", "dev", endpoint=hub.endpoint)
        assert again.returncode == 0, again.stderr
        assert len(hub.commits) == 2 and hub.commits[1]["revision"] == "dev"
        assert hub.repos["me/tiny-v3-disentangled"]["branches"]["dev"] == local


def test_dry_run_touches_no_network(tmp_path, source):
    out = tmp_path / "out"
    with HubStandIn() as hub:
        result = run_cli("convert", source, out, "--push-to", "me/x", "--dry-run", endpoint=hub.endpoint)
        assert result.returncode == 0, result.stderr
        assert hub.requests == []
    assert "dry run: would upload" in result.stdout and "model.safetensors" in result.stdout
    size = (out / "model.safetensors").stat().st_size
    assert f"{size:,d} bytes" in result.stdout and "commit message" in result.stdout
