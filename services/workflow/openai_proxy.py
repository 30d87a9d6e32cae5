"""An OpenAI-compatible endpoint inside an episode: every chat call is a recorded role turn.

Agent code written against the `openai` client is trained as it is: the
workflow hands it this endpoint's base URL, and a call with `model="solver"`
(or `"solver:2"` for slot 2 of a parallel role) becomes
`episode.turn("solver", 2, messages)`. So the call is served by that role's
adapter version, and the turn is recorded exactly as any workflow turn is
(prompt and completion token ids, sampling log-probs, finish reason, serving
version) and goes into the episode's rollout.

Sampling is the run's, not the caller's: `temperature`, `top_p`,
`max_tokens` and `seed` in a request are ignored, because the recorded
log-probs must be those of the behaviour policy the learner corrects for.
`stop` is honoured: the answer ends before the first stop string, and the
recorded turn ends with the token that completed it (a prefix of a sample is a
sample of the behaviour policy; what the agent never saw is not trained on).
`tools` are offered to the model through the chat template (as a tool turn is,
marl/workflows/tools.py) and its `<tool_call>` blocks come back as `tool_calls`;
the agent runs them and sends the results as `tool` messages, which are prompt
tokens of its next call, never trained on. What would change which tokens are
recorded is refused with a 400 naming the field (`n` > 1, streaming, a forced
`tool_choice`, and whatever the inference endpoint refuses, see
`marl.protocol.openai`). `/v1/completions` is not offered: a role turn is a chat.

A turn that cannot run (its prompt over the cap, no replica) is answered with
a 503 the client does not retry, and is remembered: `raise_failure` (called by
the worker when the workflow returns or raises) re-raises it, so the episode
is a failed one exactly as if the workflow had called `turn` itself, whatever
the agent did with the HTTP error.

Each episode is reachable under its own random token (`/episodes/<token>/v1`)
for as long as the episode object lives. By default the first episode that
asks starts a loopback-only server on a free port: only code in this worker
calls it, so it is not put on the service's public HTTP port (`install` can
mount it on a given server, before that server starts, where that is wanted).
"""

from __future__ import annotations

import asyncio
import secrets
import weakref
from typing import Any

from aiohttp import web

from marl.protocol import openai as oa
from marl.runtime.http_server import HttpServer, json_response, read_json_object

_TOKEN_ATTR = "_openai_proxy_token"
_FAILURE_ATTR = "_openai_proxy_failure"


class EpisodeProxy:
    """The worker's recording endpoint; one per event loop (see `proxy_for_loop`)."""

    def __init__(self, http: HttpServer | None = None):
        """With `http`, mount on that (not yet started) server, which its owner starts."""
        self.http = http or HttpServer("127.0.0.1", 0)
        self.episodes: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._started = http is not None
        self._lock = asyncio.Lock()
        router = self.http.app.router
        router.add_get("/episodes/{token}/v1/models", self._models)
        router.add_post("/episodes/{token}/v1/chat/completions", self._chat)
        router.add_post("/episodes/{token}/v1/completions", self._completions)

    async def base_url(self, episode: Any) -> str:
        """`http://127.0.0.1:PORT/episodes/<token>/v1` for this episode."""
        async with self._lock:
            if not self._started:
                await self.http.start()
                self._started = True
        token = getattr(episode, _TOKEN_ATTR, None)
        if token is None:
            token = secrets.token_urlsafe(16)
            setattr(episode, _TOKEN_ATTR, token)
            self.episodes[token] = episode
        return f"http://{self.http.address}/episodes/{token}/v1"

    async def close(self) -> None:
        await self.http.stop()

    # ---------------------------------------------------------------- routes

    def _episode(self, request: web.Request) -> Any:
        episode = self.episodes.get(request.match_info["token"])
        if episode is None:
            raise oa.OpenAIError(404, "no such episode (it has ended, or the URL is wrong)",
                                 kind="not_found_error")
        return episode

    async def _models(self, request: web.Request) -> web.Response:
        try:
            episode = self._episode(request)
        except oa.OpenAIError as err:
            return json_response(err.body(), err.status)
        return json_response({"object": "list", "data": [
            oa.model_entry(role, 0, f"{ref.name}@{ref.version}")
            for role, ref in episode.task.adapters.items()]})

    async def _completions(self, request: web.Request) -> web.Response:
        err = oa.OpenAIError(404, "inside an episode only /v1/chat/completions is served: "
                                  "a role turn is a chat", kind="not_found_error")
        return json_response(err.body(), err.status)

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            episode = self._episode(request)
            try:
                body = await read_json_object(request)
            except ValueError as e:
                raise oa.OpenAIError(400, str(e)) from None
            return json_response(await self.turn(episode, body))
        except oa.OpenAIError as e:
            return json_response(e.body(), e.status,
                                 None if e.retry else {"x-should-retry": "false"})

    async def turn(self, episode: Any, body: dict[str, Any]) -> dict[str, Any]:
        """One chat call as one recorded role turn; the OpenAI chat-completion body."""
        req = oa.parse_chat(body)
        sampling = req.sampling
        if sampling.n != 1:
            raise oa.bad("n", "one completion per call inside an episode (each is a turn)")
        role, slot = role_and_slot(req.model, list(episode.task.adapters))
        try:
            turn = await episode.run_turn(role, slot, req.messages,
                                          **({"tools": req.tools} if req.tools else {}))
        except Exception as err:  # re-raised by raise_failure, where the worker judges it
            if getattr(episode, _FAILURE_ATTR, None) is None:
                setattr(episode, _FAILURE_ATTR, err)
            raise oa.OpenAIError(503, f"this turn could not run, so the episode has failed: "
                                      f"{type(err).__name__}: {err}", kind="server_error",
                                 retry=False) from None
        generated = oa.Generated(turn.text, list(turn.completion_ids), list(turn.logprobs),
                                 turn.finish_reason)
        if sampling.stop:
            generated = oa.finish(episode.tokenizer, generated.token_ids, generated.logprobs,
                                  generated.finish_reason, sampling.stop)
            turn.text, turn.completion_ids = generated.text, list(generated.token_ids)
            turn.logprobs, turn.finish_reason = list(generated.logprobs), generated.finish_reason
        return oa.chat_body(req.model, [generated], list(turn.prompt_ids), sampling,
                            episode.tokenizer, req.tools)


def raise_failure(episode: Any) -> None:
    """Re-raise the first error a turn made through this endpoint hit, if any."""
    failure = getattr(episode, _FAILURE_ATTR, None)
    if failure is not None:
        raise failure


def role_and_slot(model: str, roles: list[str]) -> tuple[str, int]:
    role, colon, slot = model.partition(":")
    if role not in roles:
        raise oa.OpenAIError(404, f"model: {model!r} is not a role of this episode (roles: "
                                  f"{', '.join(roles)}); name a role, or role:slot",
                             "model", "not_found_error")
    if colon and not (slot.isdigit() and int(slot) < 1024):
        raise oa.bad("model", f"{model!r}: the slot after ':' must be an integer 0..1023")
    return role, int(slot) if colon else 0


_PROXIES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EpisodeProxy] = (
    weakref.WeakKeyDictionary())


def install(http: HttpServer) -> EpisodeProxy:
    """Serve this loop's episodes from the service's own HTTP server (call before it starts)."""
    _PROXIES[asyncio.get_running_loop()] = proxy = EpisodeProxy(http)
    return proxy


def proxy_for_loop() -> EpisodeProxy:
    """This event loop's proxy (a worker has one loop; tests may run several)."""
    loop = asyncio.get_running_loop()
    if loop not in _PROXIES:
        _PROXIES[loop] = EpisodeProxy()
    return _PROXIES[loop]


async def base_url(episode: Any) -> str:
    return await proxy_for_loop().base_url(episode)
