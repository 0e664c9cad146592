# Shared by scripts/kind/*.sh: pinned versions, the cache layout and helpers.
# shellcheck shell=bash
kind_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck source=/dev/null
source "$kind_root/testbed/versions.env"
cache=${TOPOTRAIN_CACHE:-$HOME/.cache/topotrain}
kind_cache="$cache/kind"
kind_bin="$kind_cache/bin"
kind_images="$kind_cache/images"
mkdir -p "$kind_bin" "$kind_images" "$cache/build"
repo=$KIND_IMAGE_REPOSITORY

log() { printf '[kind %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# stamped NAME KEY: bin/NAME exists and was built for KEY
stamped() { [ -e "$kind_bin/$1" ] && [ "$(cat "$kind_bin/.$1.key" 2>/dev/null)" = "$2" ]; }
stamp() { echo "$2" > "$kind_bin/.$1.key"; }

# timed LABEL CMD...: run CMD and log how long it took (docs/kind.md quotes these)
timed() {
  local label=$1 start=$SECONDS
  shift
  "$@"
  log "$label took $((SECONDS - start))s"
}

# The module's directory in the Go module cache (downloaded when missing).
go_module_dir() {
  go mod download -json "$1@$2" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'
}

# Image cache: an image is saved as a tarball keyed by its tag and a content
# key; a warm run loads the tarball instead of rebuilding.
# have_image TAG KEY: the engine holds TAG built for KEY (loads the tarball if needed)
have_image() {
  local tag=$1 key=$2 file
  file="$kind_images/$(echo "$tag" | tr '/:' '__').tar"
  [ "$(cat "$file.key" 2>/dev/null)" = "$key" ] || return 1
  if [ "$(docker image inspect -f '{{index .Config.Labels "io.topotrain.key"}}' "$tag" 2>/dev/null)" = "$key" ]; then
    return 0
  fi
  [ -s "$file" ] && docker load -i "$file" >/dev/null
}
# save_image TAG KEY: keep TAG in the cache
save_image() {
  local tag=$1 key=$2 file
  file="$kind_images/$(echo "$tag" | tr '/:' '__').tar"
  docker save -o "$file.tmp" "$tag"
  mv "$file.tmp" "$file"
  echo "$key" > "$file.key"
}
# key_of STRING... FILE...: a short content hash of strings and files
key_of() {
  local a
  for a in "$@"; do
    if [ -f "$a" ]; then sha256sum < "$a"; else echo "$a"; fi
  done | sha256sum | cut -c1-16
}

# docker build with BuildKit (only the stages a target needs are built, so an
# unpullable upstream base of another flavour is never touched). A Docker CLI
# without the buildx plugin cannot use BuildKit; Debian's docker.io CLI has it
# built in.
docker_build() {
  if docker buildx version >/dev/null 2>&1; then
    DOCKER_BUILDKIT=1 docker build "$@"
  elif [ -x /usr/bin/docker ] && [[ "$(/usr/bin/docker version --format '{{.Client.Version}}')" == 20.* ]]; then
    DOCKER_BUILDKIT=1 /usr/bin/docker build "$@"
  else
    die "no Docker CLI with BuildKit (install the buildx plugin)"
  fi
}

# kind runs `docker` from PATH: put "$kind_wrap" first (scripts/kind/docker).
kind_wrap="$kind_cache/wrap"
mkdir -p "$kind_wrap"
ln -sf "$kind_root/scripts/kind/docker" "$kind_wrap/docker"
