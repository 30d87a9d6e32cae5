"""Eval-Opt: a generator answers, an evaluator judges, the generator revises until Correct.

    answer = generator(problem)
    for round in 1..R:                    # R = 3 on math, 2 on code (caps.eval_opt_rounds_*)
        verdict, critique = evaluator(problem, transcript, answer)
        if verdict is Correct: stop
        answer = generator(problem, transcript, answer, critique)  # one revision = one round
    final answer = the generator's last answer

A round is one evaluation followed by one revision; "rounds used" counts
revisions (0 when the first answer is judged Correct). The last revision is not
evaluated again: no verdict could change the final answer. The verdict is the
evaluator's last `\\boxed{Correct}` or `\\boxed{Incorrect}`; anything else counts as
Incorrect. Generator turns take slots 0 (first answer), 1, 2, ... (revisions);
the evaluator's turn before revision k takes slot k-1.

The transcript: every evaluator and reviser turn sees the problem and every earlier
solution and critique of the episode, oldest first, numbered by round (solution k and
the critique of it), then the latest solution (and, for the reviser, its critique).
Within the prompt cap (Table 7: 30720 tokens on math, 6 x 5120, and 10240 on code):
when the whole transcript would render over `caps.prompt_tokens`, the oldest
solution/critique pairs are left out first, one pair at a time, until it fits; the
problem and the latest solution (with its critique) are always kept, and the pairs
shown keep their round numbers, so a gap shows. Prompts are measured with the
episode's own renderer (`render`, the runtime Episode's chat template and tokenizer);
an episode without one (a test fake) is shown the whole transcript. If even the
problem and the latest exchange are over the cap, the turn fails as any prompt over
its cap does (the runtime ends the episode as a failed one).

Facts: `rounds_used`, `verdict_parse_rate` (evaluations with a parseable
verdict), `verdict_accuracy` (verdicts, as acted on, that match whether the
judged answer is correct).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from marl.problem import Problem
from marl.rewards.math_scoring import last_boxed
from marl.spec.run import WorkflowCaps
from marl.workflows import prompts
from marl.workflows.base import Caps, Episode, Messages, TaskName, Workflow, prompt_cap

PROMPT_TOKENS = {"math": 30720, "code": 10240}
"""Table 7: Eval-Opt's prompts carry the answers and critiques, so its math cap is longer."""


def caps(spec: WorkflowCaps, task: TaskName) -> Caps:
    rounds = spec.eval_opt_rounds_code if task == "code" else spec.eval_opt_rounds_math
    return Caps(prompt_tokens=prompt_cap(spec, task, PROMPT_TOKENS), rounds=rounds)


def verdict(text: str) -> bool | None:
    """True for `\\boxed{Correct}`, False for `\\boxed{Incorrect}`, None when neither."""
    boxed = last_boxed(text)
    word = None if boxed is None else boxed.strip().strip(".").lower()
    return {"correct": True, "incorrect": False}.get(word or "")


def within_cap(
    episode: Episode,
    build: Callable[[Sequence[prompts.Exchange]], Messages],
    earlier: Sequence[prompts.Exchange],
) -> Messages:
    """`build(earlier[k:])` for the smallest k whose prompt fits the cap: the oldest
    exchanges go first; with none left, whatever remains is the runtime's to refuse."""
    render = getattr(episode, "render", None)
    if render is None:
        return build(earlier)
    for k in range(len(earlier)):
        messages = build(earlier[k:])
        if len(render(messages)) <= episode.caps.prompt_tokens:
            return messages
    return build(())


async def run(episode: Episode, problem: Problem) -> str:
    answer = await episode.turn("generator", 0, prompts.generator(problem))
    earlier: list[prompts.Exchange] = []
    revisions = parsed = agreed = evaluations = 0
    for round_ in range(episode.caps.rounds):
        number = round_ + 1
        judge = functools.partial(prompts.evaluator, problem, answer, number=number)
        critique = await episode.turn("evaluator", round_, within_cap(episode, judge, earlier))
        said = verdict(critique)
        evaluations += 1
        parsed += said is not None
        agreed += bool(said) == await episode.correct(answer)
        if said:
            break
        revise = functools.partial(prompts.reviser, problem, answer, critique, number=number)
        revised = await episode.turn("generator", number, within_cap(episode, revise, earlier))
        earlier.append((number, answer, critique))
        answer = revised
        revisions += 1
    episode.facts["rounds_used"] = float(revisions)
    if evaluations:
        episode.facts["verdict_parse_rate"] = parsed / evaluations
        episode.facts["verdict_accuracy"] = agreed / evaluations
    return answer


EVAL_OPT = Workflow(name="eval_opt", roles=("generator", "evaluator"), run=run, caps=caps)
