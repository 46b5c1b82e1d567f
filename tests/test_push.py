"""The Hub through the real huggingface_hub client, against a stand-in on 127.0.0.1: `push`, `convert --push-to`,
and `convert` of a repo id (token, revision, offline cache)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conversion_sources import build_model
from hub_standin import HubStandIn

TOKEN = "hf_standinSecretToken0123456789"


def run_cli(*argv, endpoint: str, env: dict | None = None, token: str = TOKEN, timeout: int = 300):
    env = {
        **os.environ,
        "HF_ENDPOINT": endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": token,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
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

        # and as a pull request
        pr = run_cli("push", out, "me/tiny-v3-disentangled", "--create-pr", endpoint=hub.endpoint)
        assert pr.returncode == 0, pr.stderr
        assert len(hub.pull_requests) == 1 and hub.commits[2]["revision"] == "refs/pr/1"
        assert "/discussions/1" in pr.stdout


def test_dry_run_touches_no_network(tmp_path, source):
    out = tmp_path / "out"
    with HubStandIn() as hub:
        result = run_cli("convert", source, out, "--push-to", "me/x", "--dry-run", endpoint=hub.endpoint)
        assert result.returncode == 0, result.stderr
        assert hub.requests == []
    assert "dry run: would upload" in result.stdout and "model.safetensors" in result.stdout
    size = (out / "model.safetensors").stat().st_size
    assert f"{size:,d} bytes" in result.stdout and "commit message" in result.stdout


def test_convert_from_a_private_hub_repo_at_a_revision_then_offline(tmp_path):
    """Source by repo id: the token opens the private repo, --revision picks the branch, the cache serves offline."""
    from safetensors.torch import load_file

    folders = {}
    for branch, seed in (("main", 0), ("other", 1)):
        folders[branch] = tmp_path / f"source-{branch}"
        build_model("v3", "ForTokenClassification", seed=seed).save_pretrained(folders[branch])
    cache = tmp_path / "hub-cache"
    with HubStandIn() as hub:
        for branch, folder in folders.items():
            files = {p.name: p.read_bytes() for p in folder.iterdir()}
            files["modeling_evil.py"] = b"raise SystemExit('source code was run')\n"  # never downloaded nor run
            files["README.md"] = b"---\nlicense: mit\n---\n# tiny\n"
            hub.add_repo("acme/tiny-deberta", files, branch=branch, private=True, token=TOKEN)
        env = {"HF_HUB_CACHE": str(cache)}

        no_login = {**env, "HF_TOKEN_PATH": str(tmp_path / "no-token")}
        denied = run_cli(
            "convert", "acme/tiny-deberta", tmp_path / "denied", endpoint=hub.endpoint, env=no_login, token=""
        )
        assert denied.returncode != 0, denied.stdout
        assert denied.stderr.splitlines()[-1].startswith("disentangled convert: error: Hub repo 'acme/tiny-deberta'")
        assert not (tmp_path / "denied").exists()

        out = tmp_path / "out"
        result = run_cli("convert", "acme/tiny-deberta", out, "--revision", "other", endpoint=hub.endpoint, env=env)
        assert result.returncode == 0, result.stderr
        assert TOKEN not in result.stdout + result.stderr
        assert not any("modeling_evil" in path for _, path in hub.requests)
    expected = load_file(folders["other"] / "model.safetensors")
    converted = load_file(out / "model.safetensors")
    key = "deberta.embeddings.word_embeddings.weight"
    assert torch.equal(converted[key], expected[key])
    card = (out / "README.md").read_text()
    assert "base_model: acme/tiny-deberta" in card and "revision `other`" in card and "license: mit" in card

    # The stand-in is gone: offline mode converts from the local cache.
    offline = run_cli(
        "convert", "acme/tiny-deberta", tmp_path / "offline", "--revision", "other",
        endpoint="http://127.0.0.1:9", env={**env, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert offline.returncode == 0, offline.stderr


def test_push_uploads_only_what_a_conversion_writes(tmp_path, source):
    out = tmp_path / "out"
    with HubStandIn() as hub:
        assert run_cli("convert", source, out, endpoint=hub.endpoint).returncode == 0
        written = sorted(p.name for p in out.iterdir())
        (out / ".env").write_text(f"HF_TOKEN={TOKEN}\n")
        (out / "notes.txt").write_text("private")
        result = run_cli("push", out, "me/only-converted", endpoint=hub.endpoint)
        assert result.returncode == 0, result.stderr
        assert sorted(hub.commits[0]["files"]) == written
        assert "not uploaded (not written by a conversion): .env, notes.txt" in result.stdout
        assert TOKEN not in result.stdout + result.stderr

        (out / "spm.model").unlink(missing_ok=True)
        (out / "spm.model").symlink_to(tmp_path / "elsewhere")
        refused = run_cli("push", out, "me/only-converted", "--dry-run", endpoint=hub.endpoint)
        assert refused.returncode != 0 and "symbolic link" in refused.stderr
        assert len(hub.commits) == 1
