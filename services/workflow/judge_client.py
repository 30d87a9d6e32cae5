"""How a worker asks the run's judge (`reward.judge`), and records what it said.

Trained judge: when `policy_groups` names the judge role, the role has an adapter in
the task and the judge is an ordinary role turn (`episode.turn`), recorded and trained.
Frozen judge: otherwise the judge is asked over OpenAI's chat-completions protocol:
the run's own inference replicas' `/v1` (their HTTP address from the replica
registry; `model: base` is the frozen base model, or a loaded `run/policy@version`),
or the spec's `endpoint`. From marl's own replicas the turn comes back with its token
ids and log-probs and is recorded as a `Turn` in `rollout.judge_turns`; from another
endpoint, with its text only. Either way the learner does not train on it.
"""

from __future__ import annotations

import os
import re
import zlib
from typing import Any

import aiohttp

from marl.rollout import AdapterRef, Task, Turn
from marl.runtime import replicas
from marl.spec.run import JUDGE_KEY_ENV
from marl.workflows.base import EpisodeError

JUDGE_KEY = re.compile(JUDGE_KEY_ENV)


class JudgeUnavailable(EpisodeError):
    """The judge did not answer (no replica with an HTTP address, an error answer): the
    rollout fails, it is not scored."""


async def endpoint_for(runner: Any, task: Task) -> tuple[str, str, str | None, bool]:
    """(base URL, model name, API key, whether it is marl's own inference)."""
    cfg = task.judge or {}
    if cfg.get("endpoint"):
        env = cfg.get("api_key_env")
        if env and not JUDGE_KEY.match(str(env)):  # the task is input from Redis
            raise JudgeUnavailable(f"reward.judge.api_key_env: {str(env)[:80]!r} is not a "
                                   "MARL_JUDGE_KEY_* variable")
        return str(cfg["endpoint"]).rstrip("/"), str(cfg["model"]), (
            os.environ.get(env) if env else None), False
    live = await replicas.live(runner.redis, "inference")
    served = sorted((info["http_address"], info.get("model_path", ""))
                    for info in live.values() if info.get("serving", True)
                    and info.get("http_address"))
    if not served:
        raise JudgeUnavailable("the judge is the run's own inference, and no serving replica "
                               "has an HTTP address (start it with --http-port)")
    address, model_path = served[zlib.crc32(task.id.encode()) % len(served)]
    model = model_path if cfg.get("model", "base") == "base" else str(cfg["model"])
    return f"http://{address}/v1", model or task.model_path, None, True


async def ask(episode: Any, messages: list[dict[str, str]]) -> str:
    task: Task = episode.task
    cfg = task.judge
    if cfg is None:
        raise JudgeUnavailable("this run has no judge: set reward.judge")
    if cfg["role"] in task.adapters:  # trained: a policy group names the judge role
        return str(await episode.turn(cfg["role"], 0, messages))
    if episode.judge_client is None:
        raise JudgeUnavailable("this episode has no way to reach a judge")
    base, model, key, own = await episode.judge_client(task)
    body: dict[str, Any] = {"model": model, "messages": messages,
                            "max_tokens": cfg["max_tokens"], "temperature": cfg["temperature"]}
    if own:
        body.update(return_token_ids=True, logprobs=True, seed=1 + zlib.crc32(task.id.encode()))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = aiohttp.ClientTimeout(total=float(cfg["timeout_s"]))
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                f"{base}/chat/completions", json=body, headers=headers) as resp:
            answer = await resp.json(content_type=None)
            if resp.status != 200:
                raise JudgeUnavailable(f"the judge at {base} answered {resp.status}: "
                                       f"{str(answer)[:300]}")
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        raise JudgeUnavailable(f"the judge at {base} did not answer: "
                               f"{type(err).__name__}: {err}") from None
    choice = answer["choices"][0]
    text = str(choice["message"].get("content") or "")
    logprobs = [float(t["logprob"]) for t in ((choice.get("logprobs") or {}).get("content")
                                              or [])]
    episode.judge_turns.append(Turn(
        role=cfg["role"], slot=0, prompt_ids=list(answer.get("prompt_token_ids") or []),
        completion_ids=list(choice.get("token_ids") or []), logprobs=logprobs,
        finish_reason=str(choice.get("finish_reason") or ""),
        adapter=AdapterRef(model, 0), text=text))
    return text
