"""Write the bring-your-own examples' data next to this file (docs/byo.md):

- `arith_verl.parquet`: 200 sums in verl's preprocessed schema (as verl's
  `examples/data_preprocess/*.py` write it), read unchanged with `data.format: verl`;
- `arith.jsonl`: the same sums as plain rows with other column names (`question`,
  `final`), read with `data.prompt_key` / `data.answer_key`;
- `open_ended.jsonl`: short writing prompts with a reference, for the judged task.

    python examples/byo/make_data.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from marl.data import arithmetic

HERE = Path(__file__).resolve().parent
TOPICS = ["the sea", "a cat", "winter", "a train", "the moon", "bread", "rain", "a garden"]


def main() -> None:
    train, _ = arithmetic.split(0)
    problems = train[:200]
    rows = [{
        "data_source": "arith",
        "prompt": [{"role": "user", "content": f"{p.prompt} Answer in \\boxed{{}}."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": p.answer},
        "extra_info": {"split": "train", "index": i},
    } for i, p in enumerate(problems)]
    pq.write_table(pa.Table.from_pylist(rows), HERE / "arith_verl.parquet")
    with open(HERE / "arith.jsonl", "w") as f:
        for p in problems:
            f.write(json.dumps({"question": p.prompt, "final": p.answer}) + "\n")
    with open(HERE / "open_ended.jsonl", "w") as f:
        for topic in TOPICS:
            f.write(json.dumps({"prompt": f"Write one short sentence about {topic}.",
                                "reference": f"A vivid, correct sentence about {topic}."})
                    + "\n")
    print(f"wrote {len(rows)} rows to {HERE}/arith_verl.parquet, arith.jsonl, open_ended.jsonl")


if __name__ == "__main__":
    main()
