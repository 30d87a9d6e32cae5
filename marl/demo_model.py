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
reward sees: answering in the asked format, and adding correctly. The result is
cached by a hash of everything that shapes it.
"""

from __future__ import annotations

import hashlib
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
from marl.data.problem import Problem

BUILDER_VERSION = "4"
BOXED_SHARE = 0.5
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
    words = sorted({w for t in texts for w in re.findall(r"[A-Za-z]+", t)})
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
def greedy_accuracy(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    examples: list[tuple[Messages, str]],
    max_new_tokens: int = 8,
) -> float:
    """Share of examples whose last integer in the greedy output is the target's, in any format."""
    model.eval()
    prompts = [
        tokenizer.encode(
            str(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)),
            add_special_tokens=False,
        )
        for m, _ in examples
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
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    right = 0
    for text, (_, target) in zip(texts, examples, strict=True):
        right += int(_last_integer(text) == _last_integer(target))
    model.train()
    return right / len(examples)


def warm_start(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    builders: list[ExampleBuilder],
    problems: list[Problem],
    seed: int,
    target_accuracy: float = 0.35,
    lr: float = 3e-3,
    batch_size: int = 64,
    max_steps: int = 3000,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Full-parameter SFT on answer tokens; stop once greedy train accuracy >= target."""
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
            if accuracy >= target_accuracy:
                break
    model.eval()
    return {"steps": step, "train_accuracy": accuracy, "seconds": time.monotonic() - start}


def solver_example(
    problem: Problem, rng: random.Random, boxed_share: float = BOXED_SHARE
) -> tuple[Messages, str]:
    from services.workflow import prompts

    return prompts.solver(problem), _answer_text(int(problem.answer), rng, boxed_share)


def aggregator_example(
    problem: Problem, rng: random.Random, boxed_share: float = BOXED_SHARE
) -> tuple[Messages, str]:
    from services.workflow import prompts

    answer = int(problem.answer)
    candidates = [
        _answer_text(
            answer if rng.random() < 0.4 else max(0, answer + rng.randint(-3, 3)), rng, boxed_share
        )
        for _ in range(3)
    ]
    return prompts.aggregator(problem, candidates), _answer_text(answer, rng, boxed_share)


def prepare_demo_model(cache_root: Path, seed: int = 0, log: Callable[[str], None] = print) -> Path:
    """Build (or reuse) the warm-started demo model; returns its directory."""
    from services.workflow import prompts

    texts = [prompts.ALL_TEMPLATE_TEXT, PLAIN_ANSWER, *(p.prompt for p in arithmetic.split(seed)[0][:50])]
    key = hashlib.sha256(
        json.dumps([BUILDER_VERSION, seed, texts, SPLIT_PATTERN, CHAT_TEMPLATE]).encode()
    ).hexdigest()[:12]
    out = cache_root / f"demo-qwen3-tiny-{key}"
    if (out / "model.safetensors").exists():
        log(f"demo model: cached at {out}")
        return out
    log("demo model: building a tiny Qwen3 and warm-starting it on arithmetic")
    tokenizer = build_tokenizer(texts)
    model = build_model(tokenizer, seed)
    train, _ = arithmetic.split(seed)
    stats = warm_start(model, tokenizer, [solver_example, aggregator_example], train, seed, log=log)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "warm_start.json").write_text(json.dumps(stats))
    tmp.rename(out)
    log(f"demo model: ready at {out} ({stats['seconds']:.0f}s warm start)")
    return out
