"""Signed task entries: a Redis writer without the services' token cannot direct workers.

A task tells a worker which workflow to run, with which adapters, for which run, and
where its rollout goes. Redis is reachable by every marl pod and whatever else gets onto
its network, so the learner signs each task it queues and a worker runs only tasks whose
signature checks: HMAC-SHA256 keyed with the services' token (`$MARL_AUTH_TOKEN`) over a
domain tag, the stream's name and the entry's payload bytes exactly as stored (the
canonical JSON of the task: sorted keys, no spaces). The signature is the entry's `sig`
field next to its `json`.

With authentication off (no token: `marl demo`) tasks are neither signed nor checked.

What this does not protect: a signed task copied and queued again (a replay) runs again;
its rollout carries the task's deterministic id, so the run counts it once and drops the
copy. Whoever holds the token (any marl pod) can sign anything.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

from marl.rollout import Task, json_fields

PAYLOAD_FIELD = "json"
SIGNATURE_FIELD = "sig"
DOMAIN = b"marl.v1.task\n"
"""Keeps a task's MAC from being any other MAC the token makes."""


def canonical(payload: Mapping[str, Any] | Task) -> str:
    """The bytes a task is stored and signed as (ASCII JSON, sorted keys, no spaces): a
    Task's the same as its `to_dict()`'s."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), default=json_fields)


class TaskSigner:
    """Signs (learner) and checks (workers) task entries with the services' token; with
    none, signs nothing and accepts everything."""

    def __init__(self, token: str | None):
        self._key = None if token is None else token.encode("utf-8")

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _mac(self, stream: str, body: str) -> str:
        assert self._key is not None
        message = DOMAIN + stream.encode("utf-8") + b"\n" + body.encode("utf-8")
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def fields(self, stream: str, payload: Mapping[str, Any] | Task) -> dict[str, str]:
        """The fields of a stream entry holding `payload`, signed when a token is set."""
        body = canonical(payload)
        if self._key is None:
            return {PAYLOAD_FIELD: body}
        return {PAYLOAD_FIELD: body, SIGNATURE_FIELD: self._mac(stream, body)}

    def refusal(self, stream: str, fields: Mapping[str, str]) -> str | None:
        """Why an entry's fields are not a task this process may run ("unsigned",
        "bad_signature"), or None when they are (always, with no token)."""
        if self._key is None:
            return None
        sig = fields.get(SIGNATURE_FIELD)
        body = fields.get(PAYLOAD_FIELD)
        if not sig or body is None:
            return "unsigned"
        if not hmac.compare_digest(sig.encode("utf-8", "surrogatepass"),
                                   self._mac(stream, body).encode("ascii")):
            return "bad_signature"
        return None
