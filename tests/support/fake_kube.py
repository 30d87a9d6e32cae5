"""A Kubernetes API on 127.0.0.1 that answers from recorded responses (k8s_responses/).

No API server can run here, so `marl cluster` is tested against this: real HTTP
(and, for exec, a real WebSocket speaking the v4.channel.k8s.io protocol) in
front of JSON shaped exactly as the API server returns it. It honours label
selectors and `tailLines` the way the API server does, records every request,
and answers anything it does not know with a 404 Status, like the real thing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

RESPONSES = Path(__file__).parent / "k8s_responses"
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def _load(name: str) -> Any:
    return json.loads((RESPONSES / name).read_text())


def _matches(labels: dict[str, str], selector: str | None) -> bool:
    if not selector:
        return True
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKube:
    def __init__(self, namespace: str = "marl", token: str = "test-token") -> None:
        self.namespace = namespace
        self.token = token
        self.requests: list[tuple[str, str, Any]] = []
        self.exec_output = (RESPONSES / "xinfo_groups.txt").read_text()
        self.exec_runner: Callable[[list[str]], str] | None = None
        """When set, an exec's command is run by it (a shell on this machine standing in for
        the pod) instead of answered with `exec_output`."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake.handle(self, "GET")

            def do_PATCH(self) -> None:
                fake.handle(self, "PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeKube:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": self.token}}],
                    "contexts": [
                        {
                            "name": "fake",
                            "context": {
                                "cluster": "fake",
                                "user": "tester",
                                "namespace": self.namespace,
                            },
                        }
                    ],
                    "current-context": "fake",
                }
            )
        )
        return path

    # ------------------------------------------------------------------ routing

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        # repeated parameters (exec's `command`) keep every value, in order
        query = {k: v[0] if len(v) == 1 else v for k, v in parse_qs(url.query).items()}
        body = None
        if method == "PATCH":
            body = json.loads(h.rfile.read(int(h.headers.get("Content-Length", 0))))
        self.requests.append((method, url.path, body if body is not None else query))
        if h.headers.get("Authorization") != f"Bearer {self.token}":
            return self.send_json(
                h,
                401,
                {"kind": "Status", "status": "Failure", "message": "Unauthorized", "code": 401},
            )
        ns = re.escape(self.namespace)
        selector = query.get("labelSelector")
        if method == "GET" and re.fullmatch(rf"/api/v1/namespaces/{ns}/pods", url.path):
            return self.send_list(h, "pods.json", selector)
        if method == "GET" and re.fullmatch(
            rf"/apis/apps/v1/namespaces/{ns}/deployments", url.path
        ):
            return self.send_list(h, "deployments.json", selector)
        if method == "GET" and re.fullmatch(
            rf"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers", url.path
        ):
            return self.send_list(h, "hpas.json", selector)
        m = re.fullmatch(rf"/apis/apps/v1/namespaces/{ns}/deployments/([\w-]+)/scale", url.path)
        if method == "PATCH" and m:
            names = [d["metadata"]["name"] for d in _load("deployments.json")["items"]]
            if m.group(1) in names:
                scale = _load("scale.json")
                scale["metadata"]["name"] = m.group(1)
                scale["spec"]["replicas"] = body["spec"]["replicas"]  # type: ignore[index]
                return self.send_json(h, 200, scale)
        m = re.fullmatch(rf"/api/v1/namespaces/{ns}/pods/([\w-]+)/log", url.path)
        if method == "GET" and m and m.group(1).startswith("r-marl-workflow-"):
            lines = (RESPONSES / "workflow.log").read_text().splitlines(keepends=True)
            if "tailLines" in query:
                lines = lines[-int(query["tailLines"]) :]
            return self.send_bytes(h, 200, "".join(lines).encode(), "text/plain")
        m = re.fullmatch(rf"/api/v1/namespaces/{ns}/pods/([\w-]+)/exec", url.path)
        if method == "GET" and m and m.group(1) == "r-marl-redis-0":
            command: Any = query.get("command", [])
            output = self.exec_output if self.exec_runner is None else self.exec_runner(command)
            return self.exec_websocket(h, output)
        self.send_json(h, 404, _load("not_found.json"))

    def send_list(self, h: BaseHTTPRequestHandler, name: str, selector: str | None) -> None:
        data = _load(name)
        data["items"] = [
            i for i in data["items"] if _matches(i["metadata"].get("labels", {}), selector)
        ]
        self.send_json(h, 200, data)

    def send_json(self, h: BaseHTTPRequestHandler, code: int, data: Any) -> None:
        self.send_bytes(h, code, json.dumps(data).encode(), "application/json")

    def send_bytes(self, h: BaseHTTPRequestHandler, code: int, data: bytes, ctype: str) -> None:
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def exec_websocket(self, h: BaseHTTPRequestHandler, output: str) -> None:
        """Upgrade, write stdout on channel 1 and a Success status on channel 3, close."""
        key = h.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        h.send_response(101, "Switching Protocols")
        h.send_header("Upgrade", "websocket")
        h.send_header("Connection", "Upgrade")
        h.send_header("Sec-WebSocket-Accept", accept)
        h.send_header("Sec-WebSocket-Protocol", "v4.channel.k8s.io")
        h.end_headers()
        status = json.dumps({"metadata": {}, "status": "Success"}).encode()
        for payload in (b"\x01" + output.encode(), b"\x03" + status):
            h.wfile.write(_frame(0x2, payload))
        h.wfile.write(_frame(0x8, struct.pack("!H", 1000)))
        h.wfile.flush()
        h.close_connection = True


def _frame(opcode: int, payload: bytes) -> bytes:
    head = bytes([0x80 | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([n])
    elif n < 65536:
        head += bytes([126]) + struct.pack("!H", n)
    else:
        head += bytes([127]) + struct.pack("!Q", n)
    return head + payload
