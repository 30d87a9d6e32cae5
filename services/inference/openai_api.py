"""OpenAI-compatible `/v1/models`, `/v1/completions` and `/v1/chat/completions` on a replica.

For evaluating and debugging a policy with the tools people have (the `openai`
package, lm-evaluation-harness, agent frameworks): "what does the aggregator
adapter at version 40 answer to this?" is `model="run/aggregator@40"`.

Every request goes to the very engine object the gRPC `Generate` handler uses,
so it is batched with the replica's other traffic on either engine, and it
holds its adapter version in the same registry (a version in use is never
unloaded under it). `model` is the base model (its id from `/v1/models`, the
model directory's name, or the path the replica was started with) or a loaded
`run/policy@version`; anything else is a 404, never the base model silently.
With authentication on, a user sees and uses only its own runs' adapters (and the
base model); another user's is a 404 as one never loaded.
Chat prompts are rendered exactly as a workflow's role turn renders them.
The protocol itself (checks, bodies) lives in `marl.protocol.openai`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from marl.models.limits import ModelLimits
from marl.protocol import openai as oa
from marl.runtime import auth
from marl.runtime.http_server import HttpServer, json_response, read_json_object
from services.inference.adapters import AdapterNotLoaded, LoadedVersion
from services.inference.engine import GenerationRequest, check_request

log = logging.getLogger(__name__)

BASE_KEY = "__base__"
"""The engines' key for the bare base model (both engines define it under this name)."""


class OpenAIApi:
    """Routes bound to one replica's `InferenceService` (its engine and adapter registry)."""

    def __init__(self, service: Any, model_path: str):
        self.service = service
        self.model_path = model_path
        self.tokenizer: Any = None
        config = json.loads((Path(model_path) / "config.json").read_text())
        self.context = int(config.get("max_position_embeddings") or 2048)
        self.vocab_size = int(config.get("vocab_size") or 0)

    async def load_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_path)

    def add_routes(self, http: HttpServer) -> None:
        http.app.router.add_get("/v1/models", self._wrap(self.models))
        http.app.router.add_post("/v1/completions", self._wrap(self.completions))
        http.app.router.add_post("/v1/chat/completions", self._wrap(self.chat))

    def _wrap(self, handler: Any) -> Any:
        async def route(request: web.Request) -> web.Response:
            if self.service.engine_or_none is None or self.tokenizer is None:
                return json_response(oa.OpenAIError(503, "the engine is still loading; retry",
                                                    kind="server_error").body(), 503,
                                     {"Retry-After": "1"})
            try:
                return json_response(await handler(request))
            except oa.OpenAIError as err:
                return json_response(err.body(), err.status)

        return route

    # ---------------------------------------------------------------- models

    @property
    def base_id(self) -> str:
        return str(self.service.engine.base_model)

    def _base_names(self) -> set[str]:
        return {self.base_id, self.base_id.split(":", 1)[0], self.model_path,
                str(Path(self.model_path).resolve())}

    def _served(self) -> list[LoadedVersion]:
        """The versions the caller may use."""
        return [v for v in self.service.registry.all(auth.owner_filter()) if not v.retired]

    async def models(self, request: web.Request) -> dict[str, Any]:
        started = min((v.loaded_at for v in self._served()), default=0.0)
        data = [oa.model_entry(self.base_id, started, None)]
        data += [oa.model_entry(v.key, v.loaded_at, self.base_id) for v in self._served()]
        return {"object": "list", "data": data}

    def _acquire(self, model: str) -> LoadedVersion | None:
        """The adapter version `model` names (held until released), or None for the base."""
        if model in self._base_names():
            return None
        name, at, version = model.rpartition("@")
        if at and name and version.isdigit():
            try:
                loaded: LoadedVersion = self.service.registry.acquire(
                    name, int(version), user=auth.owner_filter())
                return loaded
            except AdapterNotLoaded:
                pass
        raise oa.not_found(model, [self.base_id, *(v.key for v in self._served())])

    # ---------------------------------------------------------------- generation

    async def _generate(self, model: str, prompts: list[list[int]], sampling: oa.Sampling
                        ) -> list[oa.Generated]:
        for ids in prompts:
            room = self.context - len(ids)
            if room < 1:
                raise oa.bad("prompt", f"{len(ids)} tokens leave no room in the model's "
                                       f"{self.context}-token context")
            if sampling.max_tokens is not None and sampling.max_tokens > room:
                raise oa.bad("max_tokens", f"{sampling.max_tokens} + {len(ids)} prompt tokens "
                                           f"is over the model's {self.context}-token context")
        version = self._acquire(model)
        key = BASE_KEY if version is None else version.key
        stop_ids = oa.single_token_stops(self.tokenizer, sampling.stop)
        requests = [
            GenerationRequest(
                prompt_token_ids=ids,
                adapter_key=key,
                max_tokens=sampling.max_tokens or self.context - len(ids),
                temperature=sampling.temperature,
                top_p=sampling.top_p if 0 < sampling.top_p < 1 else 1.0,
                # choice j of n gets seed+j: one seed, n different samples; choice 0
                # equals gRPC Generate with the same seed
                seed=(sampling.seed + j) if sampling.seed else None,
                stop_token_ids=stop_ids,
            )
            for ids in prompts
            for j in range(sampling.n)
        ]
        limits = ModelLimits(self.context, self.vocab_size)
        for r in requests:  # the gRPC path's checks too (finite, bounded), before any batch
            try:
                check_request(r, limits)
            except ValueError as err:
                if version is not None:
                    await self.service.registry.release(version)
                field, _, why = str(err).partition(": ")
                raise oa.bad(field.removeprefix("sampling.").split("[")[0], why) from None
        try:
            results = await asyncio.gather(*(self.service.engine.generate(r) for r in requests))
        except Exception as err:  # the engine's failure, reported to this caller only
            log.exception("generation failed")
            raise oa.OpenAIError(500, f"generation failed: {err}", kind="server_error") from None
        finally:
            if version is not None:
                await self.service.registry.release(version)
        return [oa.finish(self.tokenizer, r.token_ids, r.logprobs, r.finish_reason, sampling.stop)
                for r in results]

    async def completions(self, request: web.Request) -> dict[str, Any]:
        body = await _body(request)
        req = oa.parse_completion(body)
        prompt_ids = [oa.encode_prompt(self.tokenizer, p, self.vocab_size or 1 << 31)
                      for p in req.prompts]
        choices = await self._generate(req.model, prompt_ids, req.sampling)
        return oa.completion_body(req.model, choices, prompt_ids, req.sampling, self.tokenizer)

    async def chat(self, request: web.Request) -> dict[str, Any]:
        body = await _body(request)
        req = oa.parse_chat(body)
        try:
            prompt_ids = oa.render_chat(self.tokenizer, req.messages, req.template_kwargs,
                                        req.tools)
        except Exception as err:  # a template that rejects these messages (e.g. role order)
            raise oa.bad("messages", f"the model's chat template refused them: {err}") from None
        choices = await self._generate(req.model, [prompt_ids], req.sampling)
        return oa.chat_body(req.model, choices, prompt_ids, req.sampling, self.tokenizer,
                            req.tools)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        return await read_json_object(request)
    except ValueError as err:
        raise oa.OpenAIError(400, str(err)) from None
