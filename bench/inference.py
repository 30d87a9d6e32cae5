"""Inference benchmark: the cost of serving many adapters, and of pushing new ones.

(a) Throughput of a batch whose requests use 4 different adapters (round robin)
    as a ratio of the same batch on the bare base model, same prompts, in one
    in-process engine (`--engine`; default vllm when importable). A batch that
    uses one adapter is shown too, so the table separates the cost of LoRA from
    the cost of mixing adapters, and one of GRPO groups (each prompt 8 times, one
    adapter) against that one-adapter batch: engines that prefill a shared prompt
    once (vLLM's prefix cache, the transformers engine's group prefill) gain there.
    Each kind runs `--rounds` times, interleaved (`interleaved`), and each ratio is the
    median of its rounds' own ratios (`paired_ratio`), here and in (c).
(b) Adapter push latency: a rank-64 adapter streamed over gRPC
    (`Inference.PushAdapter`) to every replica started here, timed from the
    first chunk until all replicas acknowledged (the server answers only once
    the adapter is loaded); median and p95 over `--pushes` successive versions.
(c) Transformers engine only: tokens/s of Voting-shaped episodes (4 generators,
    then an aggregator once they have answered) started 10 ms apart, each request
    with its own token budget, when requests that arrive mid-batch join it at the
    next decode step, as a ratio of the same episodes when they wait for the
    running batch to end (vLLM always batches continuously).

The model is built from a config with random weights (nothing can be
downloaded): `small` for CPUs, `qwen3-0.6b` for Qwen3-0.6B's shapes on a GPU.
Prints a table, then one JSON object as the very last line.

    python bench/inference.py [--engine vllm|transformers] [--model-size small]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from host import describe, host
from snapshot import add_save_option, emit

from marl.models.identity import base_model_id
from marl.protocol import adapter_io
from marl.runtime.heap import keep_freed_heap_until_trimmed
from marl.runtime.processes import free_port
from marl.runtime.serving import wait_healthy
from services.inference.engine import AdapterWeights, Engine, GenerationRequest

BASE = "__base__"
"""Adapter key both engines read as "no adapter"."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIZES: dict[str, dict[str, Any]] = {
    "small": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
}


# model and adapters -------------------------------------------------------------


def build_model(size: str, out: Path) -> Path:
    """A random Qwen3 of the preset's shapes with a word-level tokenizer ("w0", "w1", ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    shape = SIZES[size]
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>"])}
    vocab.update({f"w{i}": i for i in range(len(vocab), shape["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = Qwen3Config(
        **shape, max_position_embeddings=2048, eos_token_id=2, bos_token_id=2, pad_token_id=0
    )
    path = out / f"bench-qwen3-{size}"
    Qwen3ForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def lora_shapes(model_path: Path, rank: int) -> dict[str, tuple[int, ...]]:
    """PEFT state-dict keys and shapes of a LoRA on every linear module of the model."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, target_modules=TARGETS))
    return {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft).items()}


def random_lora(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}


# (a) throughput -----------------------------------------------------------------


async def timed_batch(engine: Engine, requests: list[GenerationRequest]) -> float:
    """Tokens per second of one batch submitted at once."""
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)


async def throughput(args: argparse.Namespace, model_path: Path) -> dict[str, float]:
    from marl.spec.services import InferenceConfig
    from services.inference.factory import make_engine

    cfg = InferenceConfig(engine=args.engine, model=str(model_path), dtype=args.dtype,
                          max_lora_rank=args.rank)
    engine = await asyncio.to_thread(make_engine, cfg)
    shapes = lora_shapes(model_path, args.rank)
    keys = []
    for i in range(4):
        key = f"bench/mixed@{i}"
        weights = AdapterWeights(key, i + 1, args.rank, 32.0, TARGETS, random_lora(shapes, i))
        await engine.load_adapter(weights)
        keys.append(key)
    gen = torch.Generator().manual_seed(1)
    vocab = SIZES[args.model_size]["vocab_size"]
    prompts = [
        torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.requests)
    ]

    groups = [p for p in prompts[: max(1, len(prompts) // 8)] for _ in range(8)]

    def batch(adapters: list[str], texts: list[list[int]] = prompts) -> list[GenerationRequest]:
        return [
            GenerationRequest(p, adapters[i % len(adapters)], args.max_tokens, temperature=1.0)
            for i, p in enumerate(texts)
        ]

    async def timed(adapters: list[str], texts: list[list[int]]) -> float:
        return await timed_batch(engine, batch(adapters, texts))

    kinds = {
        "base": ([BASE], prompts),
        "one_adapter": (keys[:1], prompts),
        "mixed_4": (keys, prompts),
        "groups_of_8": (keys[:1], groups),
    }
    for adapters, texts in kinds.values():  # warm-up: first use loads adapters into slots
        await timed(adapters, texts[:8])
    rates = await interleaved(
        args.rounds, {kind: functools.partial(timed, *how) for kind, how in kinds.items()}
    )
    await engine.close()
    return {
        **{f"{k}_tok_s": statistics.median(v) for k, v in rates.items()},
        "mixed_4_ratio": paired_ratio(rates["mixed_4"], rates["base"]),
        "one_adapter_ratio": paired_ratio(rates["one_adapter"], rates["base"]),
        "groups_ratio": paired_ratio(rates["groups_of_8"], rates["one_adapter"]),
    }


async def interleaved(
    rounds: int, runs: dict[str, Callable[[], Awaitable[float]]]
) -> dict[str, list[float]]:
    """Each of `runs` once a round for `rounds` rounds, in the given order in even rounds and
    reversed in odd ones (a b, b a, ...), so that no kind always runs first; each kind's
    results in round order."""
    rates: dict[str, list[float]] = {kind: [] for kind in runs}
    order = list(runs)
    for i in range(rounds):
        for kind in order if i % 2 == 0 else order[::-1]:
            rates[kind].append(await runs[kind]())
    return rates


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of each round's ratio: the two batches of a ratio run seconds
    apart in the same round (in the order a b, then b a), so a shared VM whose speed
    drifts over the bench's minute moves both, where a ratio of two medians would set one
    round's fast batch against another's slow one."""
    return statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))


# (b) push latency ---------------------------------------------------------------



def start_replica(args: argparse.Namespace, model_path: Path, port: int) -> subprocess.Popen[bytes]:
    code = (
        "import sys; from marl.spec.services import InferenceConfig; "
        "from services.inference.server import run; "
        "run(InferenceConfig(port=int(sys.argv[1]), model=sys.argv[2], engine=sys.argv[3], "
        "dtype=sys.argv[4], max_lora_rank=int(sys.argv[5])))"
    )
    cmd = [sys.executable, "-c", code, str(port), str(model_path), args.engine, args.dtype]
    return subprocess.Popen(
        [*cmd, str(args.rank)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


async def push_one(address: str, manifest: Any, payload: bytes) -> None:
    from marl.protocol.v1 import inference_pb2_grpc
    from marl.runtime import auth

    async with auth.aio_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        resp = await stub.PushAdapter(adapter_io.chunks(manifest, payload), timeout=120)
        assert resp.loaded, f"{address} did not load {manifest.ref}"


async def push_latency(args: argparse.Namespace, model_path: Path) -> dict[str, float]:
    ports = [free_port() for _ in range(args.replicas)]
    procs = [start_replica(args, model_path, p) for p in ports]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    try:
        started = time.perf_counter()
        await asyncio.gather(*(wait_healthy(a, timeout=600) for a in addresses))
        ready_s = time.perf_counter() - started
        shapes = lora_shapes(model_path, args.rank)
        base = base_model_id(model_path)
        latencies, size = [], 0
        for version in range(1, args.pushes + 1):
            payload = adapter_io.serialize(random_lora(shapes, 100 + version))
            manifest = adapter_io.make_manifest(
                "bench/push", version, base, args.rank, 32.0, TARGETS, payload
            )
            start = time.perf_counter()
            await asyncio.gather(*(push_one(a, manifest, payload) for a in addresses))
            latencies.append(time.perf_counter() - start)
            size = len(payload)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    latencies.sort()
    p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
    return {
        "replicas_ready_s": ready_s,
        "push_bytes": size,
        "push_median_s": statistics.median(latencies),
        "push_p95_s": p95,
    }


# (c) requests that arrive while a batch decodes ------------------------------------


async def episode(engine: Engine, prompts: list[list[int]], budgets: list[int],
                  adapter: str, start_s: float) -> int:
    """Voting's shape: generators together, then one aggregator once all have answered."""
    await asyncio.sleep(start_s)
    answers = await asyncio.gather(*(
        engine.generate(GenerationRequest(p, adapter, b, temperature=1.0))
        for p, b in zip(prompts[:-1], budgets[:-1], strict=True)
    ))
    final = await engine.generate(GenerationRequest(prompts[-1], adapter, budgets[-1],
                                                    temperature=1.0))
    return sum(len(a.token_ids) for a in answers) + len(final.token_ids)


async def staggered(args: argparse.Namespace, model_path: Path) -> dict[str, float]:
    """Tokens/s of `--episodes` Voting-shaped episodes started `--stagger-ms` apart, each
    request with its own budget (so rows finish apart), with requests joining the running
    batch and with requests waiting for it to end; interleaved rounds, tok/s medians, the
    ratio `paired_ratio`."""
    from marl.spec.services import InferenceConfig
    from services.inference.transformers_engine import TransformersEngine

    cfg = InferenceConfig(model=str(model_path), dtype=args.dtype)
    engine = await asyncio.to_thread(TransformersEngine, cfg)
    engine.eos_token_ids = []  # random weights: budgets, not a sampled EOS, end the rows
    shapes = lora_shapes(model_path, args.rank)
    key = "bench/staggered@1"
    await engine.load_adapter(AdapterWeights(key, 1, args.rank, 32.0, TARGETS,
                                             random_lora(shapes, 7)))
    gen = torch.Generator().manual_seed(2)
    vocab = SIZES[args.model_size]["vocab_size"]
    shape = [(torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist(),
              int(torch.randint(args.max_tokens // 4, args.max_tokens + 1, (1,),
                                generator=gen)))
             for _ in range(args.episodes * (args.generators + 1))]
    per = args.generators + 1

    async def run_all() -> float:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(
            episode(engine, [p for p, _ in shape[i * per:(i + 1) * per]],
                    [b for _, b in shape[i * per:(i + 1) * per]], key,
                    i * args.stagger_ms / 1000)
            for i in range(args.episodes)
        ))
        return sum(tokens) / (time.perf_counter() - start)

    async def run_joining(join: bool) -> float:
        engine.join_running = join
        return await run_all()

    await run_all()  # warm-up
    rates = await interleaved(
        args.rounds,
        {"joined": functools.partial(run_joining, True),
         "waiting": functools.partial(run_joining, False)},
    )
    await engine.close()
    return {"staggered_joined_tok_s": statistics.median(rates["joined"]),
            "staggered_waiting_tok_s": statistics.median(rates["waiting"]),
            "staggered_join_ratio": paired_ratio(rates["joined"], rates["waiting"])}


# main ---------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    vllm = importlib.util.find_spec("vllm") is not None
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--engine", choices=["vllm", "transformers"], default="vllm" if vllm else "transformers"
    )
    p.add_argument("--model-size", choices=sorted(SIZES), default="qwen3-0.6b" if cuda else "small")
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    p.add_argument("--requests", type=int, default=256 if cuda else 32, help="batch size of (a)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128 if cuda else 32)
    p.add_argument(
        "--rounds", type=int, default=2 if cuda else 6,
        help="timed batches per kind; tok/s: the median; ratios: the median of each round's",
    )
    p.add_argument("--rank", type=int, default=64, help="LoRA rank of every adapter")
    p.add_argument("--replicas", type=int, default=2, help="inference servers pushed to in (b)")
    p.add_argument("--pushes", type=int, default=20)
    p.add_argument("--episodes", type=int, default=16, help="episodes of (c)")
    p.add_argument("--generators", type=int, default=4, help="generators per episode in (c)")
    p.add_argument("--stagger-ms", type=float, default=10.0, help="gap between (c)'s starts")
    p.add_argument("--skip", choices=["throughput", "push", "staggered"],
                   help="leave one part out")
    add_save_option(p)
    return p.parse_args()


def print_table(figures: dict[str, Any]) -> None:
    rows = [
        ("base model, no adapter", "base_tok_s", "tok/s"),
        ("one adapter for the whole batch", "one_adapter_tok_s", "tok/s"),
        ("4 adapters, round robin", "mixed_4_tok_s", "tok/s"),
        ("4 adapters / base", "mixed_4_ratio", "x"),
        ("1 adapter / base", "one_adapter_ratio", "x"),
        ("1 adapter, groups of 8 sharing a prompt", "groups_of_8_tok_s", "tok/s"),
        ("groups of 8 / distinct prompts", "groups_ratio", "x"),
        (f"push rank-{figures['rank']} adapter, median", "push_median_s", "s"),
        (f"push rank-{figures['rank']} adapter, p95", "push_p95_s", "s"),
        ("adapter payload", "push_bytes", "bytes"),
        ("staggered episodes, joining the batch", "staggered_joined_tok_s", "tok/s"),
        ("staggered episodes, waiting for it", "staggered_waiting_tok_s", "tok/s"),
        ("joining / waiting", "staggered_join_ratio", "x"),
    ]
    print(f"\ninference bench: engine={figures['engine']} model={figures['model']}")
    print(f"{'figure':<38} {'value':>12}  unit")
    for label, key, unit in rows:
        if key in figures:
            value = figures[key]
            text = f"{value:.3f}" if isinstance(value, float) else str(value)
            print(f"{label:<38} {text:>12}  {unit}")


def main() -> None:
    args = parse_args()
    figures: dict[str, Any] = {
        "engine": args.engine,
        "model": args.model_size,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "dtype": args.dtype,
        "rank": args.rank,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "replicas": args.replicas,
        "pushes": args.pushes,
    }
    with tempfile.TemporaryDirectory(prefix="marl-bench-") as tmp:
        model_path = build_model(args.model_size, Path(tmp))
        if args.skip != "throughput":
            figures.update(asyncio.run(throughput(args, model_path)))
        if args.skip != "push":
            figures.update(asyncio.run(push_latency(args, model_path)))
        if args.skip != "staggered" and args.engine == "transformers":
            figures.update(asyncio.run(staggered(args, model_path)))
    figures["host"] = host()
    print_table(figures)
    print(describe(figures["host"]))
    emit(figures, args.save)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    keep_freed_heap_until_trimmed()  # this process's engine allocates as the service's does
    main()
