"""`marl sandbox run` and `marl generate`: quick manual checks against a running cluster.

They speak the services' HTTP protocols (SandboxFusion's `POST /run_code`,
OpenAI's `/v1/completions` and `/v1/chat/completions`) with the standard
library only, so the CLI stays light. The endpoint is the `--sandbox` /
`--inference` URL, else `$MARL_SANDBOX_HTTP` / `$MARL_INFERENCE_HTTP`, else the
first `sandbox_http` / `inference_http` entry of `marl up`'s endpoints.json. The sandbox
is sent its own token (`$MARL_SANDBOX_TOKEN`, else the `sandbox_token_file` `marl up`
lists), inference the services' or a user's (`$MARL_AUTH_TOKEN`).
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from marl.spec.services import TLS_CA_ENV, auth_token, sandbox_token

DEFAULT_ENDPOINTS = Path("marl-up") / "endpoints.json"
TIMEOUT_EXIT = 124
"""Exit status for a program that ran out of time (as coreutils' `timeout` uses)."""


class HttpUserError(Exception):
    """Something the user can fix (a missing file, no endpoint, a refused request)."""


def endpoint(flag: str | None, env: str, key: str, endpoints_file: Path = DEFAULT_ENDPOINTS
             ) -> str:
    """Resolve a base URL from the flag, the environment, or endpoints.json."""
    url = flag or os.environ.get(env)
    if not url and endpoints_file.is_file():
        found = json.loads(endpoints_file.read_text()).get(key) or []
        url = found[0] if found else None
    if not url:
        raise HttpUserError(f"no endpoint: pass the URL, set ${env}, or run `marl up` here so "
                            f"{endpoints_file} lists {key}")
    scheme = "https" if os.environ.get(TLS_CA_ENV) else "http"
    return url if "://" in url else f"{scheme}://{url}"


def sandbox_run_token(endpoints_file: Path = DEFAULT_ENDPOINTS) -> str | None:
    """The sandbox's token: `$MARL_SANDBOX_TOKEN`(`_FILE`), else the file `marl up` wrote
    and listed as `sandbox_token_file` in its endpoints.json, else None."""
    try:
        token = sandbox_token()
        if token is None and endpoints_file.is_file():
            listed = json.loads(endpoints_file.read_text()).get("sandbox_token_file")
            if listed:
                token = sandbox_token({"MARL_SANDBOX_TOKEN_FILE": str(listed)})
    except ValueError as err:
        raise HttpUserError(str(err)) from None
    return token


def post_json(url: str, body: dict[str, Any], timeout: float,
              token_from: Callable[[], str | None] = auth_token) -> dict[str, Any]:
    """POST `body` with the token `token_from` gives (by default `$MARL_AUTH_TOKEN`: the
    services' or a user's), if any."""
    headers = {"Content-Type": "application/json"}
    token = token_from()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        ca = os.environ.get(TLS_CA_ENV)
        context = ssl.create_default_context(cafile=ca) if ca else None
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            data: dict[str, Any] = json.loads(resp.read())
            return data
    except urllib.error.HTTPError as err:
        raise HttpUserError(f"{url} answered {err.code}: {_message(err.read())}") from None
    except urllib.error.URLError as err:
        raise HttpUserError(f"{url} is not reachable ({err.reason})") from None


def _message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return str(body)[:500]


def sandbox_run(file: str, stdin_file: str | None, url: str | None, timeout: float) -> int:
    """Run FILE.py in the sandbox; echo its output; exit with its return code."""
    path = Path(file)
    if not path.is_file():
        raise HttpUserError(f"{file}: no such file")
    stdin = None
    if stdin_file is not None:
        if not Path(stdin_file).is_file():
            raise HttpUserError(f"--stdin: {stdin_file}: no such file")
        stdin = Path(stdin_file).read_text()
    base = endpoint(url, "MARL_SANDBOX_HTTP", "sandbox_http")
    resp = post_json(base.rstrip("/") + "/run_code",
                     {"code": path.read_text(), "language": "python", "stdin": stdin,
                      "run_timeout": timeout}, timeout + 30,
                     token_from=sandbox_run_token)
    result = resp.get("run_result") or {}
    sys.stdout.write(result.get("stdout") or "")
    sys.stderr.write(result.get("stderr") or "")
    if resp.get("status") == "SandboxError":
        raise HttpUserError(f"sandbox error: {resp.get('message')}")
    if result.get("status") == "TimeLimitExceeded":
        print(f"marl sandbox run: time limit ({timeout:g} s) exceeded", file=sys.stderr)
        return TIMEOUT_EXIT
    if resp.get("message"):
        print(f"marl sandbox run: {resp['message']}", file=sys.stderr)
    return int(result.get("return_code") or 0)


def generate(model: str, prompt: str, url: str | None, chat: bool, max_tokens: int,
             temperature: float, seed: int | None) -> int:
    """Print one completion of `prompt` by `model` (the base or `run/policy@version`)."""
    base = endpoint(url, "MARL_INFERENCE_HTTP", "inference_http").rstrip("/")
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                            "temperature": temperature}
    if seed is not None:
        body["seed"] = seed
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        resp = post_json(base + "/v1/chat/completions", body, 600)
        print(resp["choices"][0]["message"]["content"])
    else:
        body["prompt"] = prompt
        resp = post_json(base + "/v1/completions", body, 600)
        print(resp["choices"][0]["text"])
    return 0
