"""Eval-Opt: a generator answers, an evaluator judges, the generator revises until Correct.

    answer = generator(problem)
    for round in 1..R:                    # R = 3 on math, 2 on code (caps.eval_opt_rounds_*)
        verdict, critique = evaluator(problem, answer)
        if verdict is Correct: stop
        answer = generator(problem, answer, critique)    # one revision = one round
    final answer = the generator's last answer

A round is one evaluation followed by one revision; "rounds used" counts
revisions (0 when the first answer is judged Correct). The last revision is not
evaluated again: no verdict could change the final answer. The verdict is the
evaluator's last `\\boxed{Correct}` or `\\boxed{Incorrect}`; anything else counts as
Incorrect. Generator turns take slots 0 (first answer), 1, 2, ... (revisions);
the evaluator's turn before revision k takes slot k-1.

Facts: `rounds_used`, `verdict_parse_rate` (evaluations with a parseable
verdict), `verdict_accuracy` (verdicts, as acted on, that match whether the
judged answer is correct).
"""

from __future__ import annotations

from marl.config import WorkflowCaps
from marl.data.problem import Problem
from marl.rewards.math import last_boxed
from marl.workflows import prompts
from marl.workflows.base import Caps, Episode, TaskName, Workflow, prompt_cap

PROMPT_TOKENS = {"math": 30720, "code": 10240}
"""Table 7: Eval-Opt's prompts carry the answer and critique, so its math cap is longer."""


def caps(spec: WorkflowCaps, task: TaskName) -> Caps:
    rounds = spec.eval_opt_rounds_code if task == "code" else spec.eval_opt_rounds_math
    return Caps(prompt_tokens=prompt_cap(spec, task, PROMPT_TOKENS), rounds=rounds)


def verdict(text: str) -> bool | None:
    """True for `\\boxed{Correct}`, False for `\\boxed{Incorrect}`, None when neither."""
    boxed = last_boxed(text)
    word = None if boxed is None else boxed.strip().strip(".").lower()
    return {"correct": True, "incorrect": False}.get(word or "")


async def run(episode: Episode, problem: Problem) -> str:
    answer = await episode.turn("generator", 0, prompts.generator(problem))
    revisions = parsed = agreed = evaluations = 0
    for round_ in range(episode.caps.rounds):
        critique = await episode.turn("evaluator", round_, prompts.evaluator(problem, answer))
        said = verdict(critique)
        evaluations += 1
        parsed += said is not None
        agreed += bool(said) == await episode.correct(answer)
        if said:
            break
        answer = await episode.turn(
            "generator", round_ + 1, prompts.reviser(problem, answer, critique)
        )
        revisions += 1
    episode.facts["rounds_used"] = float(revisions)
    if evaluations:
        episode.facts["verdict_parse_rate"] = parsed / evaluations
        episode.facts["verdict_accuracy"] = agreed / evaluations
    return answer


EVAL_OPT = Workflow(name="eval_opt", roles=("generator", "evaluator"), run=run, caps=caps)
