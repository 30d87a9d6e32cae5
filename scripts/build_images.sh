#!/usr/bin/env bash
# Build marl's CPU images (deploy/docker/Dockerfile) and report build times and sizes.
#
# Usage: scripts/build_images.sh [TARGET ...]   default: sandbox inference workflow learner
#        (inference-cuda and learner-cuda build from Dockerfile.cuda, on a GPU builder)
# Environment:
#   ENGINE       podman (default) or docker
#   BASE_IMAGE   the Python 3.11 base; unset with podman = a local Debian stand-in
#                built by scripts/make_base_image.sh (no registry is needed)
#   REGISTRY     registry prefix (default localhost); images are REGISTRY/marl-<target>:TAG,
#                the names the Helm chart pulls with image.registry=REGISTRY image.tag=TAG
#   TAG          image tag (default: the chart's appVersion, deploy/helm/Chart.yaml)
#   PUSH         1: push every image to REGISTRY after it is built
#   LIST         1: print the image names this would build, and build nothing
#   TORCH_WHEEL  a torch 2.13.0 CPU wheel; unset = whatever this host's pip resolves
#                `torch==2.13.0` to (our CI machines keep the CPU wheel on disk;
#                elsewhere pass the CPU wheel, or the image gets the CUDA build)
#   REPORT       where the JSON report goes (default build/images.json)
#   SOURCE       tree (default: the working tree as it is) or a git revision
#                (e.g. HEAD: only committed files, whatever else is in the tree)
# The context is assembled in a temp dir (sources, helpers, wheels/) so no .venv,
# caches or run outputs are ever sent, and the wheel is never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
ENGINE="${ENGINE:-podman}"
REGISTRY="${REGISTRY:-localhost}"
APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' deploy/helm/Chart.yaml)"
TAG="${TAG:-$APP_VERSION}"
REPORT="${REPORT:-build/images.json}"
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(sandbox inference workflow learner)
image_of() { echo "$REGISTRY/marl-$1:$TAG"; }
if [ "${LIST:-0}" = 1 ]; then
  for target in "${TARGETS[@]}"; do image_of "$target"; done
  exit 0
fi
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3

PULL=()
if [ "$ENGINE" = podman ]; then
  source scripts/podman_env.sh
  if [ -z "${BASE_IMAGE:-}" ]; then
    bash scripts/make_base_image.sh
    BASE_IMAGE="localhost/marl-stand-in/python:3.11-slim-bookworm"
    PULL=(--pull=never)
  fi
fi
BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim-bookworm}"

CTX="$(mktemp -d "${TMPDIR:-/tmp}/marl-context.XXXXXX")"
trap 'rm -rf "$CTX"' EXIT
FILES=(pyproject.toml README.md marl services deploy/docker)
if [ "${SOURCE:-tree}" = tree ]; then
  tar -c --exclude=__pycache__ --exclude='*.pyc' "${FILES[@]}" | tar -x -C "$CTX"
else
  git archive "$SOURCE" "${FILES[@]}" | tar -x -C "$CTX"
fi
mkdir -p "$CTX/wheels"
if [[ " ${TARGETS[*]} " =~ \ (inference|workflow|learner)\  ]]; then
  if [ -n "${TORCH_WHEEL:-}" ]; then
    cp "$TORCH_WHEEL" "$CTX/wheels/"
  else
    "$PY" -m pip download -q --no-deps --only-binary=:all: torch==2.13.0 -d "$CTX/wheels"
  fi
  echo "torch wheel: $(ls "$CTX/wheels")"
fi

mkdir -p "$(dirname "$REPORT")"
rows=()
for target in "${TARGETS[@]}"; do
  image="$(image_of "$target")"
  start=$(date +%s.%N)
  dockerfile="$CTX/deploy/docker/Dockerfile"
  [[ "$target" == *-cuda ]] && dockerfile="$CTX/deploy/docker/Dockerfile.cuda"
  "$ENGINE" build -q --network host "${PULL[@]}" --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --target "$target" -t "$image" -f "$dockerfile" "$CTX" > /dev/null
  secs=$("$PY" -c "print(round($(date +%s.%N) - $start, 1))")
  size=$("$ENGINE" image inspect --format '{{.Size}}' "$image")
  printf '%-10s %6s s  %5s MB  %s\n' "$target" "$secs" "$((size / 1000000))" "$image"
  rows+=("{\"target\": \"$target\", \"image\": \"$image\", \"seconds\": $secs, \"bytes\": $size}")
  if [ "${PUSH:-0}" = 1 ]; then
    "$ENGINE" push "$image"
    echo "pushed $image"
  fi
done
(IFS=,; echo "[${rows[*]}]") > "$REPORT"
echo "report: $REPORT"
