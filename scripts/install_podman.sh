#!/usr/bin/env bash
# Install rootful podman and what the image build needs, from Debian (~15 s). CI runners only.
set -euo pipefail
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah runc debootstrap > /dev/null
podman --version
