#!/usr/bin/env bash
# `make image`: the Cachet image (deploy/Containerfile) from the release binary without its
# debug info, the built admin console and the model, tagged localhost/cachet:latest (and
# localhost/cachet-test-services:latest, Postgres and Redis for `make fleet-test`).
#
#   CACHET_IMAGE_BASE=docker.io/library/debian:bookworm-slim scripts/image.sh
#
# CACHET_IMAGE_BIN=target/debug/cachet stages another build of the binary.
# Without CACHET_IMAGE_BASE the base is localhost/debian-local:bookworm, made here once from
# Debian's mirror with debootstrap when it is missing (no registry needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PODMAN=scripts/podman.sh
BASE=${CACHET_IMAGE_BASE:-localhost/debian-local:bookworm}
if [ "$BASE" = localhost/debian-local:bookworm ] && ! $PODMAN image exists "$BASE"; then
  command -v debootstrap >/dev/null || { echo "image: apt-get install debootstrap (or set CACHET_IMAGE_BASE)" >&2; exit 1; }
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  echo "image: making $BASE with debootstrap (a few minutes, once)"
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
  tar -C "$root" -c . | $PODMAN import - "$BASE" >/dev/null
fi
STAGE=target/image
rm -rf "$STAGE"
mkdir -p "$STAGE/admin-ui" "$STAGE/models"
objcopy --strip-debug "${CACHET_IMAGE_BIN:-target/release/cachet}" "$STAGE/cachet"
cp -r admin-ui/dist "$STAGE/admin-ui/dist"
cp .cachet/models/*.gguf "$STAGE/models/"
$PODMAN build --network=host --build-arg "BASE=$BASE" -f deploy/Containerfile -t localhost/cachet:latest "$STAGE"
$PODMAN build --network=host --build-arg "BASE=$BASE" -t localhost/cachet-test-services:latest deploy/test-services
echo "image: localhost/cachet:latest ($(du -sh "$STAGE" | cut -f1) staged)"
