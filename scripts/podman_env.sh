# Source me: podman settings that work on a CI runner or a dev VM without a container setup.
#
# - runtime runc + cgroupfs: crun refuses hybrid cgroup hierarchies, and there is
#   no systemd session to hand cgroups to;
# - ulimits at the host's hard limits (podman's defaults ask for more and fail);
# - storage under a throwaway directory (MARL_PODMAN_ROOT), never the user's.
# Nothing here is needed with Docker or a configured podman: set
# MARL_PODMAN_NATIVE=1 to keep your own settings.
if [ -z "${MARL_PODMAN_NATIVE:-}" ]; then
  MARL_PODMAN_ROOT="${MARL_PODMAN_ROOT:-${TMPDIR:-/tmp}/marl-podman}"
  mkdir -p "$MARL_PODMAN_ROOT/storage" "$MARL_PODMAN_ROOT/run"
  cat > "$MARL_PODMAN_ROOT/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
  cat > "$MARL_PODMAN_ROOT/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$MARL_PODMAN_ROOT/storage"
runroot = "$MARL_PODMAN_ROOT/run"
CONF
  export CONTAINERS_CONF="$MARL_PODMAN_ROOT/containers.conf"
  export CONTAINERS_STORAGE_CONF="$MARL_PODMAN_ROOT/storage.conf"
  export MARL_PODMAN_ROOT
fi
