"""`engine: auto` resolves to vLLM exactly when the vllm package can be found."""

import sys
from pathlib import Path

import pytest

from marl.models.engines import resolve_engine, vllm_available
from marl.spec.services import InferenceConfig
from services.inference.factory import make_engine


@pytest.fixture
def vllm_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package named vllm on sys.path (found, never imported)."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('not to be imported')\n")
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture
def vllm_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import vllm` fails however the environment was built (None in sys.modules)."""
    monkeypatch.setitem(sys.modules, "vllm", None)


@pytest.mark.usefixtures("vllm_installed")
def test_auto_is_vllm_where_vllm_is_installed() -> None:
    assert vllm_available() is True
    assert resolve_engine("auto") == "vllm"
    assert resolve_engine("transformers") == "transformers"


@pytest.mark.usefixtures("vllm_missing")
def test_auto_is_transformers_without_vllm() -> None:
    assert vllm_available() is False
    assert resolve_engine("auto") == "transformers"
    assert resolve_engine("vllm") == "vllm"


@pytest.mark.usefixtures("vllm_missing")
def test_the_service_refuses_vllm_by_name_without_vllm() -> None:
    with pytest.raises(ValueError, match="engine=vllm: the vllm package is not installed"):
        make_engine(InferenceConfig(engine="vllm"))
