"""The paper's validation sets as loader options: `data.val_size` problems held out (1,412 of
DAPO-Math), and `data.val_subset` (DeepCoder's primeintellect subset, 1,000 problems)."""

from __future__ import annotations

from pathlib import Path

import pytest

from marl.data import load_problems
from marl.spec.run import SpecError, parse_spec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def splits(data: dict[str, object], seed: int = 0) -> tuple[list[str], list[str]]:
    spec = parse_spec({"data": data})
    return ([p.id for p in load_problems(spec.data, "train", seed)],
            [p.id for p in load_problems(spec.data, "val", seed)])


def test_val_size_holds_out_that_many_by_the_seed_whatever_the_row_order(tmp_path: Path) -> None:
    rows = (FIXTURES / "dapo-math-17k.jsonl").read_text().splitlines()
    shuffled = tmp_path / "reversed.jsonl"
    shuffled.write_text("\n".join(reversed(rows)) + "\n")
    data = {"train": "dapo_math", "val": "dapo_math", "val_size": 3}
    train, val = splits({**data, "train_path": str(FIXTURES / "dapo-math-17k.jsonl")})
    assert len(val) == 3 and not set(train) & set(val)
    assert len(train) + len(val) == len({*train, *val})
    again = splits({**data, "train_path": str(shuffled)})
    assert again == (train, val)
    assert splits({**data, "train_path": str(shuffled)}, seed=1)[1] != val


def test_val_subset_validates_on_deepcoders_primeintellect_alone() -> None:
    data = {"train": "deepcoder", "val": "deepcoder",
            "train_path": str(FIXTURES / "deepcoder")}
    spec = parse_spec({"data": {**data, "val_subset": "primeintellect", "val_size": 1000}})
    train = load_problems(spec.data, "train", 0)
    val = load_problems(spec.data, "val", 0)
    # every primeintellect problem is held out (the fixture has fewer than 1,000)
    assert val and {p.data_source for p in val} == {"deepcoder_primeintellect"}
    assert "deepcoder_primeintellect" not in {p.data_source for p in train}
    assert {p.data_source for p in train} == {"deepcoder_taco", "deepcoder_lcbv5",
                                              "deepcoder_codeforces"}
    # a separate validation file keeps its primeintellect problems, val_size of them
    separate = parse_spec({"data": {**data, "val_path": str(FIXTURES / "deepcoder"),
                                    "val_subset": "primeintellect", "val_size": 1}})
    kept = load_problems(separate.data, "val", 0)
    assert len(kept) == 1 and kept[0].data_source == "deepcoder_primeintellect"


def test_each_deepcoder_subset_is_read_from_its_tests_layout() -> None:
    from marl.data.deepcoder import subset_of

    assert subset_of({"inputs": ["1"], "outputs": ["2"]}) == "taco"
    assert subset_of([{"type": "stdin_stdout", "input": "1", "output": "2"}]) == "primeintellect"
    assert subset_of([{"input": "1", "output": "2", "testtype": "stdin"}]) == "lcbv5"
    assert subset_of([{"input": "1", "output": "2"}]) == "codeforces"


def test_val_subset_of_another_set_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match="data.val_subset"):
        parse_spec({"data": {"train": "dapo_math", "val_subset": "primeintellect"}})
