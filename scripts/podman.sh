#!/usr/bin/env bash
# podman as this project's image and fleet scripts run it: runc and cgroupfs, which work on
# VMs with cgroups in hybrid mode (crun does not), and no default ulimits (some kernels refuse
# setrlimit in a container). PODMAN_FLAGS="" runs plain podman where those are not needed.
set -euo pipefail
export CONTAINERS_CONF=${CONTAINERS_CONF:-$(cd "$(dirname "$0")/.." && pwd)/deploy/podman/containers.conf}
# shellcheck disable=SC2086 # flags are words
exec podman ${PODMAN_FLAGS---runtime runc --cgroup-manager=cgroupfs} "$@"
