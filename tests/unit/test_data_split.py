"""Train/validation splits and orders: deterministic from the seed, independent of row order."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from marl.data import load_problems
from marl.data.split import ordered, split
from marl.problem import Problem
from marl.spec.run import DataSpec, SpecError, parse_spec

FIXTURES = Path(__file__).parents[1] / "fixtures"


def problems(n: int) -> list[Problem]:
    return [Problem(id=f"p{i}", prompt=f"q{i}", answer=str(i)) for i in range(n)]


def test_split_is_deterministic_disjoint_and_complete() -> None:
    items = problems(100)
    train, val = split(items, seed=1, val_fraction=0.1, name="x")
    assert split(items, seed=1, val_fraction=0.1, name="x") == (train, val)
    assert len(val) == 10 and len(train) == 90
    assert {p.id for p in train} | {p.id for p in val} == {p.id for p in items}
    assert not {p.id for p in train} & {p.id for p in val}


def test_seed_changes_the_split_and_the_order() -> None:
    items = problems(100)
    _, val_a = split(items, seed=1, val_fraction=0.1, name="x")
    _, val_b = split(items, seed=2, val_fraction=0.1, name="x")
    assert {p.id for p in val_a} != {p.id for p in val_b}
    assert ordered(items, 1) != ordered(items, 2)


def test_split_does_not_depend_on_input_order() -> None:
    items = problems(50)
    shuffled = items[:]
    random.Random(0).shuffle(shuffled)
    assert split(items, 3, 0.2, "x") == split(shuffled, 3, 0.2, "x")
    assert ordered(items, 3) == ordered(shuffled, 3)


def test_at_least_one_each_side() -> None:
    train, val = split(problems(3), seed=0, val_fraction=0.01, name="x")
    assert (len(train), len(val)) == (2, 1)
    train, val = split(problems(3), seed=0, val_fraction=0.99, name="x")
    assert (len(train), len(val)) == (1, 2)
    with pytest.raises(SpecError, match="too few to split"):
        split(problems(1), seed=0, val_fraction=0.5, name="tiny")


def test_a_file_split_survives_reordering_its_rows(tmp_path: Path) -> None:
    lines = (FIXTURES / "dapo-math-17k.jsonl").read_text().splitlines()
    reversed_file = tmp_path / "reversed.jsonl"
    reversed_file.write_text("\n".join(reversed(lines)))
    for which in ("train", "val"):
        a = load_problems(DataSpec(train="dapo_math", val="dapo_math", val_fraction=0.25,
                                   train_path=str(FIXTURES / "dapo-math-17k.jsonl")), which, 5)
        b = load_problems(DataSpec(train="dapo_math", val="dapo_math", val_fraction=0.25,
                                   train_path=str(reversed_file)), which, 5)
        assert a == b


def test_different_sets_are_used_whole() -> None:
    spec = DataSpec(train="dapo_math", train_path=str(FIXTURES / "dapo-math-17k.jsonl"),
                    val="dapo_math", val_path=str(FIXTURES / "dapo_math"))
    assert len(load_problems(spec, "train", 0)) == 8
    assert len(load_problems(spec, "val", 0)) == 8


def test_val_path_equal_to_train_path_still_splits() -> None:
    path = str(FIXTURES / "dapo-math-17k.jsonl")
    spec = DataSpec(train="dapo_math", val="dapo_math", train_path=path, val_path=path,
                    val_fraction=0.25)
    assert len(load_problems(spec, "val", 0)) == 2


def test_a_bundled_set_with_a_path_is_refused() -> None:
    spec = DataSpec(train="dapo_math", train_path=str(FIXTURES / "dapo_math"),
                    val="champ", val_path="x.parquet")
    with pytest.raises(SpecError, match=r"field `data.val_path`: champ is bundled"):
        load_problems(spec, "val", 0)


def test_validation_file_set_needs_its_own_path() -> None:
    spec = DataSpec(train="champ", val="dapo_math")
    with pytest.raises(SpecError, match=r"field `data.val_path`: dapo_math is read from a local"):
        load_problems(spec, "val", 0)


def test_unknown_dataset_is_refused_at_spec_time() -> None:
    with pytest.raises(SpecError, match=r"field `data.train`.*'humaneval'"):
        parse_spec({"data": {"train": "gsm8k"}})


def test_same_seed_same_order_across_calls(tmp_path: Path) -> None:
    lines = (FIXTURES / "dapo-math-17k.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    spec = DataSpec(train="dapo_math", val="champ", train_path=str(path))
    assert load_problems(spec, "train", 9) == load_problems(spec, "train", 9)
    assert load_problems(spec, "train", 9) != load_problems(spec, "train", 10)
