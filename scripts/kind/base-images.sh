#!/usr/bin/env bash
# Base images built from Debian packages, for machines where no upstream
# image can be pulled. Cached as tarballs under $TOPOTRAIN_CACHE/kind/images.
#   $repo/debian:$DEBIAN_SUITE   debootstrap --variant=minbase (debootstrap itself
#                                 is extracted from its .deb into the cache, not installed)
#   $repo/python:$DEBIAN_SUITE   + Debian's python3 as a venv at /usr/local, laid out
#                                 like the upstream python:*-slim images (python, pip
#                                 in /usr/local/bin), so our Dockerfiles build on it
# The host's CA bundle goes into the local images: package downloads inside
# `docker build` then trust what this machine trusts.
set -euo pipefail
# shellcheck source=scripts/kind/lib.sh
source "$(dirname "$0")/lib.sh"

# The Debian mirror this host's apt uses (read at run time, never written down).
debian_mirror() {
  local m
  m=$(sed -nE 's#^URIs: *(\S+/debian)/?$#\1#p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)
  [ -n "$m" ] || m=$(sed -nE 's#^deb +(\[[^]]*\] +)?(\S+/debian)/? .*#\2#p' /etc/apt/sources.list 2>/dev/null | head -n 1)
  [ -n "$m" ] || die "no Debian mirror found in the apt sources"
  echo "$m"
}

debootstrap_tool() {
  local dir="$kind_cache/debootstrap"
  if [ ! -x "$dir/usr/sbin/debootstrap" ]; then
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && apt-get download debootstrap >/dev/null)
    rm -rf "$dir" && mkdir -p "$dir"
    dpkg-deb -x "$tmp"/debootstrap_*.deb "$dir"
    rm -rf "$tmp"
  fi
  echo "$dir"
}

build_debian() {
  local tag="$repo/debian:$DEBIAN_SUITE" key
  key=$(key_of "$DEBIAN_SUITE" minbase-v1 /etc/ssl/certs/ca-certificates.crt)
  have_image "$tag" "$key" && return 0
  local tool rootfs
  tool=$(debootstrap_tool)
  rootfs=$(mktemp -d "$kind_cache/rootfs.XXXXXX")
  DEBOOTSTRAP_DIR="$tool/usr/share/debootstrap" "$tool/usr/sbin/debootstrap" \
    --variant=minbase --include=ca-certificates,passwd "$DEBIAN_SUITE" "$rootfs" "$(debian_mirror)" >&2
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import \
    --change "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
    --change "LABEL io.topotrain.key=$key" --change 'CMD ["bash"]' - "$tag" >/dev/null
  rm -rf "$rootfs"
  save_image "$tag" "$key"
}

build_python() {
  local tag="$repo/python:$DEBIAN_SUITE" key
  key=$(key_of "$(docker image inspect -f '{{.Id}}' "$repo/debian:$DEBIAN_SUITE")" python-v1)
  have_image "$tag" "$key" && return 0
  docker_build -q -t "$tag" --label "io.topotrain.key=$key" - >/dev/null <<DOCKERFILE
FROM $repo/debian:$DEBIAN_SUITE
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* && python3 -m venv /usr/local \
 && /usr/local/bin/python -m pip --version
ENV PYTHONDONTWRITEBYTECODE=1
CMD ["python"]
DOCKERFILE
  save_image "$tag" "$key"
}

"$kind_root/scripts/kind/engine.sh"
timed "base image debian" build_debian
timed "base image python" build_python
