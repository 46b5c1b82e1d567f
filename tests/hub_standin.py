"""A stand-in for the Hub's HTTP endpoints on 127.0.0.1 only: what `create_repo`/`upload_folder` and
`snapshot_download` use.

Uploads: it answers "regular" (plain git blob, base64 in the commit) for every file at preupload, so no LFS or Xet
transfer is involved, and records every request, every repo and every commit it receives.
Downloads: repo info by revision, the recursive tree, and `resolve/` (HEAD and GET) of plain files; a private
repo answers 401 without the right bearer token.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

MAX_BODY = 64 * 1024 * 1024


class HubStandIn:
    def __init__(self):
        self.requests: list[tuple[str, str]] = []
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "branches": {name: {path: bytes}}}
        self.commits: list[dict] = []
        self.authorization: list[str | None] = []
        self.validated_yaml: list[str] = []
        self.pull_requests: list[dict] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add_repo(self, repo_id: str, files: dict[str, bytes], branch: str = "main", private: bool = False, token=None):
        repo = self.repos.setdefault(repo_id, {"private": private, "branches": {}, "token": token})
        repo["branches"][branch] = dict(files)

    @staticmethod
    def commit_of(files: dict[str, bytes]) -> str:
        digest = hashlib.sha1()
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha1(files[path]).digest())
        return digest.hexdigest()

    def resolve(self, repo_id: str, revision: str) -> dict[str, bytes] | None:
        branches = self.repos[repo_id]["branches"]
        if revision in branches:
            return branches[revision]
        return next((files for files in branches.values() if self.commit_of(files) == revision), None)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> bytes:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    raise ValueError("body too large")
                return self.rfile.read(length)

            def do_HEAD(self):
                self._download(head=True)

            def do_GET(self):
                self._download(head=False)

            def _error(self, status: int, code: str, head: bool) -> None:
                body = json.dumps({"error": code}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(0 if head else len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _download(self, head: bool) -> None:
                path = urlparse(self.path).path
                hub.requests.append(("HEAD" if head else "GET", path))
                hub.authorization.append(self.headers.get("Authorization"))
                parts = [unquote(part) for part in path.strip("/").split("/")]
                api = parts[:2] == ["api", "models"]
                if api:
                    parts = parts[2:]
                if len(parts) < 4:
                    return self._error(404, "EntryNotFound", head)
                repo_id, action, revision, rest = f"{parts[0]}/{parts[1]}", parts[2], parts[3], "/".join(parts[4:])
                repo = hub.repos.get(repo_id)
                if repo is None or (repo["private"] and self.headers.get("Authorization") != f"Bearer {repo['token']}"):
                    return self._error(401 if repo is not None else 404, "RepoNotFound", head)
                if api and action == "discussions":
                    pull_request = hub.pull_requests[int(revision) - 1]
                    return self._reply(
                        200,
                        {
                            "num": int(revision),
                            "title": pull_request["title"],
                            "author": {"name": "user"},
                            "createdAt": "2026-01-01T00:00:00.000Z",
                            "status": "open",
                            "repo": {"name": repo_id, "type": "model"},
                            "isPullRequest": True,
                            "events": [],
                            "changes": {"base": "refs/heads/main"},
                            "filesWithConflicts": [],
                        },
                    )
                files = hub.resolve(repo_id, revision)
                if files is None:
                    return self._error(404, "RevisionNotFound", head)
                commit = hub.commit_of(files)
                if api and action == "revision":
                    siblings = [{"rfilename": name} for name in sorted(files)]
                    return self._reply(
                        200, {"id": repo_id, "sha": commit, "siblings": siblings, "private": repo["private"]}
                    )
                if api and action == "tree":
                    entries = [
                        {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                        for name, data in sorted(files.items())
                    ]
                    return self._reply(200, entries)
                if not api and action == "resolve" and rest in files:
                    data = files[rest]
                    self.send_response(200)
                    self.send_header("X-Repo-Commit", commit)
                    self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("Content-Type", "application/octet-stream")
                    self.end_headers()
                    if not head:
                        self.wfile.write(data)
                    return None
                return self._error(404, "EntryNotFound", head)

            def do_POST(self):
                path = urlparse(self.path).path
                hub.requests.append(("POST", path))
                hub.authorization.append(self.headers.get("Authorization"))
                body = self._body()
                parts = [unquote(part) for part in path.strip("/").split("/")]
                if parts[:3] == ["api", "repos", "create"]:
                    return self._create(json.loads(body))
                if parts[:2] == ["api", "validate-yaml"]:  # the README's metadata, checked before the upload
                    hub.validated_yaml.append(json.loads(body)["content"])
                    return self._reply(200, {"errors": [], "warnings": []})
                if len(parts) >= 5 and parts[:2] == ["api", "models"]:
                    repo_id, action, revision = f"{parts[2]}/{parts[3]}", parts[4], "/".join(parts[5:])
                    if repo_id not in hub.repos:
                        return self._reply(404, {"error": "Repository not found"})
                    if action == "preupload":
                        files = json.loads(body)["files"]
                        modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                        return self._reply(200, {"files": modes, "commitOid": None})
                    if action == "commit":
                        return self._commit(repo_id, revision, body)
                    if action == "discussions":  # create_pull_request: the PR's ref is refs/pr/<num>
                        hub.pull_requests.append({"repo_id": repo_id, **json.loads(body)})
                        num = len(hub.pull_requests)
                        return self._reply(200, {"num": num, "url": f"{hub.endpoint}/{repo_id}/discussions/{num}"})
                    if action == "branch":
                        hub.repos[repo_id]["branches"].setdefault(revision, {})
                        return self._reply(200, {})
                self._reply(404, {"error": "not handled by the stand-in"})

            def _create(self, payload: dict) -> None:
                repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
                url = f"{hub.endpoint}/{repo_id}"
                if repo_id in hub.repos:
                    return self._reply(409, {"error": "You already created this model repo", "url": url})
                hub.repos[repo_id] = {
                    "private": payload.get("private") is True or payload.get("visibility") == "private",
                    "branches": {"main": {}},
                    "token": (self.headers.get("Authorization") or "").removeprefix("Bearer "),
                }
                self._reply(200, {"url": url, "name": repo_id})

            def _commit(self, repo_id: str, revision: str, body: bytes) -> None:
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                header = next(line["value"] for line in lines if line["key"] == "header")
                files = {}
                for line in lines:
                    if line["key"] == "file":
                        files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                    elif line["key"] != "header":
                        return self._reply(400, {"error": f"the stand-in takes regular files only, got {line['key']}"})
                branch = hub.repos[repo_id]["branches"].setdefault(revision, {})
                branch.update(files)
                oid = hashlib.sha1(body).hexdigest()
                hub.commits.append(
                    {"repo_id": repo_id, "revision": revision, "summary": header["summary"], "files": files}
                )
                self._reply(
                    200,
                    {"success": True, "commitOid": oid, "commitUrl": f"{hub.endpoint}/{repo_id}/commit/{oid}"},
                )

        return Handler
