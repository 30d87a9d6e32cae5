"""The demo model ships with marl, so every machine starts the demo from the same weights."""

from __future__ import annotations

import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from marl.models.demo import EXTRA_WORDS, demo_model_dir, validation_behaviour


def test_the_shipped_demo_model_answers_as_recorded_when_it_was_built() -> None:
    path = demo_model_dir()
    recorded = json.loads((path / "warm_start.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    behaviour = validation_behaviour(model, tokenizer)
    assert behaviour == recorded["validation"]
    # The untrained generator rarely boxes its answer and the aggregator asked for a final
    # answer often garbles the candidates: RL has both the format and the answers to improve.
    assert behaviour["aggregator_boxed_accuracy"] <= 0.05
    assert behaviour["aggregator_any_format_accuracy"] <= 0.3
    assert behaviour["generator_any_format_accuracy"] >= 0.5
    # Voting's selection prompt was taught: the untrained aggregator stamps a candidate
    assert behaviour["selector_stamp_rate"] >= 0.9


def test_the_demo_tokenizer_knows_the_words_later_prompts_use() -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir())
    vocab = tokenizer.get_vocab()
    assert all(w in vocab and w.capitalize() in vocab for w in EXTRA_WORDS)
    ids = tokenizer.encode("Write a short plan for the workers.", add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
