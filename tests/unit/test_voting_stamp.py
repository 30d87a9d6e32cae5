"""Voting's aggregator is asked for a terse `\\boxed{N}` selection stamp (paper §A.4, §A.6.2):
a valid N gives candidate N's answer; anything else leaves the aggregator's own answer."""

from __future__ import annotations

import pytest

from marl.workflows import prompts
from marl.workflows.voting import stamp
from tests.support.workflows_scripted import CODE, MATH, ScriptedEngine, make_task, run_episode

FENCE = "```"
MATH_CANDIDATES = {0: "first \\boxed{5}", 1: "second \\boxed{4}", 2: "third \\boxed{5}"}


def engine(aggregator: str, candidates: dict[int, str] = MATH_CANDIDATES) -> ScriptedEngine:
    def script(role: str, slot: int, prompt: str) -> str:
        return candidates[slot] if role == "generator" else aggregator

    return ScriptedEngine(script)


@pytest.mark.parametrize(
    ("said", "want"),
    [
        ("\\boxed{1}", 0),
        ("\\boxed{ 3 }", 2),
        ("Candidate 2 is right. \\boxed{2}", 1),
        ("\\boxed{7} then \\boxed{2}", 1),  # the last box counts
        ("\\boxed{2} then \\boxed{7}", None),
        ("\\boxed{0}", None),  # numbers start at 1
        ("\\boxed{4}", None),  # three candidates
        ("\\boxed{-1}", None),
        ("\\boxed{2.0}", None),
        ("\\boxed{Candidate 2}", None),
        ("\\boxed{²}", None),  # a digit to str.isdigit, not a number
        ("2", None),
        ("", None),
    ],
)
def test_stamp_reads_the_last_boxed_whole_number_of_a_candidate(
    said: str, want: int | None
) -> None:
    assert stamp(said, 3) == want


def test_the_prompt_numbers_the_candidates_and_asks_for_a_stamp() -> None:
    (message,) = prompts.selector(MATH, ["a \\boxed{1}", "b"])
    assert message["content"] == (
        "What is 2 + 3?\n\nCandidate 1:\na \\boxed{1}\n\nCandidate 2:\nb\n\n"
        "Pick the best candidate. Reply with only its number in \\boxed{}, "
        "as \\boxed{1} for Candidate 1."
    )


async def test_a_stamp_gives_that_candidates_answer() -> None:
    scripted = engine("\\boxed{2}")
    episode, final = await run_episode(make_task("voting"), scripted)
    assert final == "second \\boxed{4}"
    aggregator = scripted.seen[3]
    assert aggregator.role == "aggregator"
    assert (
        aggregator.prompt
        == prompts.selector(MATH, list(MATH_CANDIDATES.values()))[0]["content"] + "\n\n"
    )
    # majority 5 (candidates 1 and 3), the stamp picked 4
    assert episode.facts == {
        "majority_agreement": 2 / 3,
        "oracle_pass_at_n": 1.0,
        "aggregator_picked_majority": 0.0,
    }
    # the record keeps what the aggregator said: its signatures read its own turn
    assert episode.turns[3].text == "\\boxed{2}"


async def test_a_stamp_of_the_majority() -> None:
    episode, final = await run_episode(make_task("voting"), engine("Third. \\boxed{3}"))
    assert final == "third \\boxed{5}"
    assert episode.facts["aggregator_picked_majority"] == 1.0


@pytest.mark.parametrize("said", ["\\boxed{42}", "\\boxed{0}", "So 5. \\boxed{5}", "five"])
async def test_without_a_valid_stamp_the_aggregators_own_answer_is_final(said: str) -> None:
    episode, final = await run_episode(make_task("voting"), engine(said))
    assert final == said
    assert episode.facts["aggregator_picked_majority"] == float(said.endswith("\\boxed{5}"))


async def test_a_code_stamp_gives_the_candidates_code() -> None:
    code = {s: f"Mine:\n{FENCE}python\ndef f():\n    return {s}\n{FENCE}" for s in range(3)}
    _, final = await run_episode(make_task("voting", problem=CODE), engine("\\boxed{3}", code))
    assert final == code[2]
    own = f"{FENCE}python\ndef f():\n    return 1\n{FENCE}"
    _, final = await run_episode(make_task("voting", problem=CODE), engine(own, code))
    assert final == own


async def test_aggregator_output_answer_scores_the_aggregators_own_answer() -> None:
    from marl.workflows import resolve
    from tests.support.workflows_scripted import make_episode

    scripted = engine("Combining them: \\boxed{2}")
    task = make_task("voting", workflow_args={"aggregator_output": "answer"})
    episode = make_episode(task, scripted)
    episode.args = resolve("voting").parse_args(task.workflow_args)
    final = await resolve("voting").run(episode, MATH)
    assert final == "Combining them: \\boxed{2}"  # its own answer 2, no candidate's number
    assert scripted.seen[3].prompt == prompts.aggregator(
        MATH, list(MATH_CANDIDATES.values()))[0]["content"] + "\n\n"
    assert episode.facts["aggregator_picked_majority"] == 0.0


def test_aggregator_output_takes_index_or_answer_only() -> None:
    from marl.spec.run import SpecError
    from marl.workflows import resolve

    voting = resolve("voting")
    assert voting.parse_args({}).aggregator_output == "index"  # type: ignore[union-attr]
    with pytest.raises(SpecError, match="workflow_args.aggregator_output"):
        voting.parse_args({"aggregator_output": "combine"})
