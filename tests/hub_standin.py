"""A stand-in for the Hub's HTTP endpoints that `create_repo` and `upload_folder` use, on 127.0.0.1 only.

It answers "regular" (plain git blob, base64 in the commit) for every file at preupload, so no LFS or Xet
transfer is involved, and records every request, every repo and every commit it receives.
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
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

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

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                self._reply(404, {"error": "not handled by the stand-in"})

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
                if len(parts) >= 6 and parts[:2] == ["api", "models"]:
                    repo_id, action, revision = f"{parts[2]}/{parts[3]}", parts[4], "/".join(parts[5:])
                    if repo_id not in hub.repos:
                        return self._reply(404, {"error": "Repository not found"})
                    if action == "preupload":
                        files = json.loads(body)["files"]
                        modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                        return self._reply(200, {"files": modes, "commitOid": None})
                    if action == "commit":
                        return self._commit(repo_id, revision, body)
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
