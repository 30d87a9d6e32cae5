#!/usr/bin/env bash
# Build a local stand-in for python:3.11-slim-bookworm when no image registry is reachable.
#
# debootstrap a minimal Debian bookworm (python3 3.11, venv, pip, CA certs),
# add the host's extra CA certificates (a TLS-intercepting egress proxy signs
# PyPI's certificate with them; without them pip fails inside the build), and
# `podman import` it as $STAND_IN. Skipped when the image already exists.
# Usage: scripts/make_base_image.sh   (root; podman, debootstrap)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/podman_env.sh
STAND_IN="${STAND_IN:-localhost/marl-stand-in/python:3.11-slim-bookworm}"
if podman image exists "$STAND_IN"; then
  echo "base image $STAND_IN exists"
  exit 0
fi
MIRROR="${DEBIAN_MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
ROOTFS="$(mktemp -d "${TMPDIR:-/tmp}/marl-rootfs.XXXXXX")"
trap 'rm -rf "$ROOTFS"' EXIT
start=$(date +%s)
debootstrap --variant=minbase \
  --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
  bookworm "$ROOTFS" "$MIRROR" > "$ROOTFS.log" 2>&1 || { tail -20 "$ROOTFS.log"; exit 1; }
rm -f "$ROOTFS.log"
if compgen -G "/usr/local/share/ca-certificates/*.crt" > /dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
  chroot "$ROOTFS" update-ca-certificates > /dev/null
fi
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | podman import --change 'CMD ["python3"]' - "$STAND_IN" > /dev/null
echo "base image $STAND_IN built in $(( $(date +%s) - start )) s"
