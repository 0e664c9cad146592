#!/usr/bin/env bash
# Makes sure a Docker engine answers: installs Debian's docker.io when there is
# no dockerd, starts dockerd (as root, logging to $TOPOTRAIN_CACHE/kind/dockerd.log)
# when none runs. Nothing else on the host is changed.
set -euo pipefail
# shellcheck source=scripts/kind/lib.sh
source "$(dirname "$0")/lib.sh"

docker info >/dev/null 2>&1 && exit 0
if ! command -v dockerd >/dev/null; then
  [ "$(id -u)" = 0 ] || die "no Docker engine, and installing docker.io needs root"
  log "installing Debian's docker.io"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker.io >&2 \
    || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker.io >&2; }
fi
if ! pgrep -x dockerd >/dev/null; then
  [ "$(id -u)" = 0 ] || die "dockerd is not running, and starting it needs root"
  log "starting dockerd"
  setsid nohup dockerd >"$kind_cache/dockerd.log" 2>&1 < /dev/null &
fi
for _ in $(seq 60); do
  docker info >/dev/null 2>&1 && exit 0
  sleep 1
done
die "the Docker engine did not answer within 60s (see $kind_cache/dockerd.log)"
