"""CHAMP (270 competition math problems, from the `champ-dataset` package) as math problems.

The prompt is the problem statement; the ground truth is CHAMP's final answer
made comparable by `marl.data.champ_answers.ground_truth`.
"""

from __future__ import annotations

import json
from importlib import resources

from marl.data.champ_answers import ground_truth
from marl.problem import Problem

DATA_FILE = "dataset_files/v0.json"


def load() -> list[Problem]:
    """All 270 problems, in CHAMP's order."""
    text = resources.files("champ_dataset").joinpath(DATA_FILE).read_text(encoding="utf-8")
    problems = []
    for identifier, p in json.loads(text)["problems"].items():
        statement = p.get("_text") or p["_raw_text"].replace("@@", "")
        problems.append(
            Problem(id=identifier, prompt=statement.strip(),
                    answer=ground_truth(p["_raw_answer"]), task="math")
        )
    return problems
