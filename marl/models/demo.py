"""The demo's model: a tiny Qwen3 with a word-level tokenizer, warm-started by SFT.

Nothing can be downloaded, so `marl demo` builds its model: a 0.5M-parameter
Qwen3ForCausalLM (hidden 128, 2 layers, 4 heads of head_dim 32 so vLLM's CPU
backend accepts it) and a word-level tokenizer whose vocabulary covers digits,
punctuation, `\\boxed{` and every word the roles are told.

A short supervised warm start on the arithmetic task (answer tokens only)
imitates a weak instruct model: its demonstrations put the sum in `\\boxed{}`
only `BOXED_SHARE` of the time and otherwise say "The answer is N", which the
math reward scores as a format failure, and it stops while the model's sums are
still often wrong (greedy arithmetic accuracy on training prompts >=
`target_accuracy`, whatever the format). RL then has two habits to fix that the
reward sees: answering in the asked format, and adding correctly. It is also shown
Voting's selection prompt (`prompts.selector`) answered with a candidate's number,
a right candidate's only `SELECT_SKILL` of the time: without it the aggregator met
words it was never taught, and RL had a third habit to learn from nothing.
"""

from __future__ import annotations

import json
import random
import re
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from marl.data import arithmetic
from marl.problem import Problem

BUILDER_VERSION = "6"
BOXED_SHARE = 0.5
SELECT_SKILL = 0.5
"""Share of the selection demonstrations that pick a right candidate where one is right
(the rest pick at random): a weak selector for RL to improve."""
WARM_START_STEPS = 700
WARM_START_SEED = 0
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo-model"
EXTRA_WORDS = (
    "a an and answer answers are as at based be best by can candidate candidates check "
    "combine correct critique does each error evaluate evaluator feedback final find first "
    "for from give given if in incorrect is it its mistake no not of on one or orchestrator "
    "outputs plan previous problem reply result review revise revised short solution solve "
    "state step steps subtask synthesizer task that the then this to verdict whether with "
    "worker workers write wrong yes you your"
).split()
"""Words later prompts (Eval-Opt, Orch-Workers, user workflows) are likely to use; each
also gets a capitalised form."""
PLAIN_ANSWER = "The answer is {}"
SPECIALS = ["<pad>", "<unk>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
SPLIT_PATTERN = r"\\boxed\{|\d|[A-Za-z]+|[^\sA-Za-z\d]"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

Messages = list[dict[str, str]]
ExampleBuilder = Callable[[Problem, random.Random], tuple[Messages, str]]


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Word-level tokenizer; whitespace is dropped and decoding concatenates tokens."""
    found = {w for t in texts for w in re.findall(r"[A-Za-z]+", t)}
    words = sorted(found | {w.capitalize() for w in found if w.islower()})
    punct = [c for c in string.punctuation]
    vocab_list = SPECIALS + list(string.digits) + punct + ["\\boxed{"] + words
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(vocab_list))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        ]
    )
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


def _encode(
    tokenizer: PreTrainedTokenizerFast, messages: Messages, answer: str
) -> tuple[list[int], int]:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    p_ids = tokenizer.encode(str(prompt), add_special_tokens=False)
    a_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return p_ids + a_ids, len(p_ids)


def _last_integer(text: str) -> str | None:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


def _answer_text(value: int, rng: random.Random, boxed_share: float) -> str:
    return f"\\boxed{{{value}}}" if rng.random() < boxed_share else PLAIN_ANSWER.format(value)


@torch.no_grad()
def greedy_texts(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    conversations: list[Messages],
    max_new_tokens: int = 8,
) -> list[str]:
    """The model's greedy completion of each conversation (one left-padded batch)."""
    model.eval()
    prompts = [
        tokenizer.encode(
            str(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)),
            add_special_tokens=False,
        )
        for m in conversations
    ]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (
        torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]
    ).long()
    generate: Any = getattr(model, "generate")  # noqa: B009 (transformers' stub rejects the self type)
    out = generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.train()
    return list(tokenizer.batch_decode(out[:, width:], skip_special_tokens=True))


def greedy_accuracy(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    examples: list[tuple[Messages, str]],
    max_new_tokens: int = 8,
) -> float:
    """Share of examples whose last integer in the greedy output is the target's, in any format."""
    texts = greedy_texts(model, tokenizer, [m for m, _ in examples], max_new_tokens)
    right = 0
    for text, (_, target) in zip(texts, examples, strict=True):
        right += int(_last_integer(text) == _last_integer(target))
    return right / len(examples)


def validation_behaviour(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast
) -> dict[str, float]:
    """Greedy answers on the demo's 200 validation problems, as the generator and as an
    aggregator shown three copies of the generator's answer: the untrained workflow."""
    from marl.rewards.math_scoring import last_boxed
    from marl.workflows import prompts

    _, val = arithmetic.split(WARM_START_SEED)
    generated = greedy_texts(model, tokenizer, [prompts.generator(p) for p in val])
    aggregated = greedy_texts(
        model,
        tokenizer,
        [prompts.aggregator(p, [t] * 3) for p, t in zip(val, generated, strict=True)],
    )
    selected = greedy_texts(
        model,
        tokenizer,
        [prompts.selector(p, [t] * 3) for p, t in zip(val, generated, strict=True)],
    )
    out: dict[str, float] = {
        "selector_stamp_rate": sum(
            (last_boxed(t) or "").strip() in ("1", "2", "3") for t in selected) / len(val),
    }
    for role, texts in (("generator", generated), ("aggregator", aggregated)):
        boxed = [(last_boxed(t) or "").strip() for t in texts]
        out[f"{role}_boxed_accuracy"] = sum(
            b == p.answer for b, p in zip(boxed, val, strict=True)
        ) / len(val)
        out[f"{role}_any_format_accuracy"] = sum(
            _last_integer(t) == p.answer for t, p in zip(texts, val, strict=True)
        ) / len(val)
    return out


def warm_start(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    builders: list[ExampleBuilder],
    problems: list[Problem],
    seed: int,
    target_accuracy: float | None = 0.35,
    lr: float = 3e-3,
    batch_size: int = 64,
    max_steps: int = 3000,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Full-parameter SFT on answer tokens; stop once greedy train accuracy >= target
    (None: run exactly `max_steps`)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    probe = [builders[0](p, rng) for p in rng.sample(problems, 128)]
    model.train()
    start = time.monotonic()
    accuracy = 0.0
    step = 0
    for step in range(1, max_steps + 1):
        batch = [rng.choice(builders)(rng.choice(problems), rng) for _ in range(batch_size)]
        encoded = [_encode(tokenizer, m, a) for m, a in batch]
        width = max(len(ids) for ids, _ in encoded)
        input_ids = torch.full((len(encoded), width), tokenizer.pad_token_id)
        labels = torch.full((len(encoded), width), -100)
        attn = torch.zeros((len(encoded), width), dtype=torch.long)
        for i, (ids, n_prompt) in enumerate(encoded):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
            attn[i, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0:
            accuracy = greedy_accuracy(model, tokenizer, probe)
            log(
                f"warm start step {step}: loss {loss.item():.3f}, greedy train accuracy {accuracy:.2f}"
            )
            if target_accuracy is not None and accuracy >= target_accuracy:
                break
    model.eval()
    return {"steps": step, "train_accuracy": accuracy, "seconds": time.monotonic() - start}


def solver_example(
    problem: Problem, rng: random.Random, boxed_share: float = BOXED_SHARE
) -> tuple[Messages, str]:
    from marl.workflows import prompts

    return prompts.generator(problem), _answer_text(int(problem.answer), rng, boxed_share)


def aggregator_example(
    problem: Problem, rng: random.Random, boxed_share: float = BOXED_SHARE
) -> tuple[Messages, str]:
    from marl.workflows import prompts

    answer = int(problem.answer)
    candidates = [
        _answer_text(
            answer if rng.random() < 0.4 else max(0, answer + rng.randint(-3, 3)), rng, boxed_share
        )
        for _ in range(3)
    ]
    return prompts.aggregator(problem, candidates), _answer_text(answer, rng, boxed_share)


def selector_example(
    problem: Problem, rng: random.Random, boxed_share: float = BOXED_SHARE
) -> tuple[Messages, str]:
    """Voting's selection prompt over three candidates, answered `\\boxed{N}`: a right
    candidate's number `SELECT_SKILL` of the time, else any candidate's."""
    from marl.workflows import prompts

    answer = int(problem.answer)
    values = [answer if rng.random() < 0.4 else max(0, answer + rng.randint(-3, 3))
              for _ in range(3)]
    candidates = [_answer_text(v, rng, boxed_share) for v in values]
    right = [i for i, v in enumerate(values) if v == answer]
    pick = rng.choice(right) if right and rng.random() < SELECT_SKILL else rng.randrange(3)
    return prompts.selector(problem, candidates), f"\\boxed{{{pick + 1}}}"


def vocabulary_texts() -> list[str]:
    """Every fixed word the demo tokenizer knows: the roles' template words, the plain
    answer, and `EXTRA_WORDS` so that later prompts mostly stay off `<unk>`."""
    from marl.workflows import prompts

    return [prompts.ALL_TEMPLATE_TEXT, PLAIN_ANSWER, "What is", " ".join(EXTRA_WORDS)]


def build_demo_model(out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the demo model into `out` the same way on every run of this machine.

    One thread, deterministic kernels and a fixed number of SFT steps (no stop rule
    that depends on the arithmetic of the machine). Another machine may still round
    differently, which is why the result ships with marl instead of being rebuilt.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        tokenizer = build_tokenizer(vocabulary_texts())
        model = build_model(tokenizer, WARM_START_SEED)
        train, _ = arithmetic.split(WARM_START_SEED)
        stats = warm_start(
            model,
            tokenizer,
            [solver_example, selector_example, solver_example, aggregator_example],
            train,
            WARM_START_SEED,
            target_accuracy=None,
            max_steps=WARM_START_STEPS,
            log=log,
        )
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {
        "builder_version": BUILDER_VERSION,
        "boxed_share": BOXED_SHARE,
        **stats,
        "validation": validation_behaviour(model, tokenizer),
    }
    (out / "warm_start.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def demo_model_dir() -> Path:
    """The demo model that ships inside the marl package (`scripts/build_demo_model.py`)."""
    if not (SHIPPED_DIR / "model.safetensors").exists():
        raise FileNotFoundError(
            f"the demo model is missing from {SHIPPED_DIR}; rebuild it with "
            "`python scripts/build_demo_model.py`"
        )
    return SHIPPED_DIR
