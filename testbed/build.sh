#!/usr/bin/env bash
# Builds the testbed's binaries from upstream Go modules, cached outside the
# repository under $TOPOTRAIN_CACHE (default ~/.cache/topotrain), keyed by version.
# Usage: testbed/build.sh [component ...]   (default: all)
# Prints the bin directory on the last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=/dev/null
source "$here/versions.env"
cache=${TOPOTRAIN_CACHE:-$HOME/.cache/topotrain}
bin="$cache/bin"
mkdir -p "$bin" "$cache/build"
# -dwarf=false: every binary is linked with -s -w (no symbol table, no DWARF), so the DWARF the
# compiler would write for each package is thrown away; not generating it saves compile time.
export CGO_ENABLED=0 GOFLAGS="-buildvcs=false -gcflags=all=-dwarf=false" GOTOOLCHAIN=local

log() { printf '[testbed build] %s\n' "$*" >&2; }
# shellcheck source=testbed/gogroups.sh
source "$here/gogroups.sh"

# stamp NAME VERSION -> true when bin/NAME was built for VERSION
stamped() { [ -x "$bin/$1" ] && [ "$(cat "$bin/.$1.version" 2>/dev/null)" = "$2" ]; }
stamp() { echo "$2" > "$bin/.$1.version"; }

timed() {
  local start=$SECONDS
  "$@"
  log "$* took $((SECONDS - start))s"
}

build_kubernetes() {
  local v=$KUBERNETES_VERSION all=1
  for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    stamped "$b" "$v" || all=0
  done
  [ $all = 1 ] && return 0
  local dir="$cache/build/kubernetes-$v"
  mkdir -p "$dir"
  cp "$here/go/kubernetes/tools.go" "$dir/tools.go"
  (
    cd "$dir"
    # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces
    # them with local paths; a consumer must replace each with its published
    # v0.X.Y. Generate that list from the upstream go.mod.
    local gomod
    gomod=$(go mod download -json "k8s.io/kubernetes@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
    local staging="v0.${v#v1.}"
    {
      echo "module topotrain.io/testbed/kubernetes"
      echo
      grep -E '^go [0-9]' "$gomod"
      echo
      echo "require k8s.io/kubernetes $v"
      echo
      echo "replace ("
      sed -nE 's#^\s*(k8s\.io/[a-z0-9-]+) => \./staging/src/.*#\t\1 => \1 '"$staging"'#p' "$gomod"
      echo ")"
    } > go.mod
    go mod tidy >/dev/null 2>&1 || go mod tidy
    local major=${v#v}; major=${major%%.*}
    local minor=${v#v*.}; minor=${minor%%.*}
    local ld="-s -w"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ld="$ld -X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
      ld="$ld -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    go build -trimpath -ldflags "$ld" -o "$bin/" \
      k8s.io/kubernetes/cmd/kube-apiserver \
      k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler \
      k8s.io/kubernetes/cmd/kubectl
  )
  for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do stamp "$b" "$v"; done
}

build_etcd() {
  local v=$ETCD_VERSION
  stamped etcd "$v" && return 0
  local dir="$cache/build/etcd-$v"
  mkdir -p "$dir"
  cp "$here/go/etcd/main.go" "$dir/main.go"
  (
    cd "$dir"
    printf 'module topotrain.io/testbed/etcd\n\ngo 1.24\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$v" > go.mod
    go mod tidy >/dev/null 2>&1 || go mod tidy
    go build -trimpath -ldflags "-s -w" -o "$bin/etcd" .
  )
  stamp etcd "$v"
}

# build_grouped NAME PACKAGE VERSION [LDFLAGS]: built in its Go module group (testbed/gogroups.sh)
build_grouped() {
  local name=$1 pkg=$2 v=$3 st
  st=$(go_group_stamp "$name" "$v")
  stamped "$name" "$st" && return 0
  go_group_build "$name" "$bin/$name" "-s -w ${4:-}" "$pkg"
  stamp "$name" "$st"
}

build_kwok() {
  build_grouped kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" \
    "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
  build_grouped kwokctl sigs.k8s.io/kwok/cmd/kwokctl "$KWOK_VERSION" \
    "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
  kwok_stages
}

# The kwok binary has no built-in stages (kwokctl passes them in a config
# file). Assemble KWOK's own default node and pod stages, plus its chaos
# stages used for fault injection, from the module at the pinned version.
kwok_stages() {
  local v=$KWOK_VERSION out="$cache/share/kwok-stages-$KWOK_VERSION.yaml"
  [ -s "$out" ] && return 0
  mkdir -p "$cache/share"
  local src
  src=$(go mod download -json "sigs.k8s.io/kwok@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  local stage first=1
  for stage in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
      pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete \
      node/chaos/node-not-ready pod/chaos/pod-container-running-failed; do
    [ $first = 1 ] || echo "---"
    first=0
    cat "$src/kustomize/stage/$stage.yaml"
  done > "$out.tmp"
  mv "$out.tmp" "$out"
}
build_helm() {
  build_grouped helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" \
    "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
}
build_versitygw() {
  build_grouped versitygw github.com/versity/versitygw/cmd/versitygw "$VERSITYGW_VERSION" \
    "-X main.Version=$VERSITYGW_VERSION"
}

# Kueue and JobSet: the manager binaries plus their CRDs, copied from the module cache into
# share/ (the upstream files are taken at build time, never committed). Kueue's source is patched
# for one path (testbed/gogroups.sh, KUEUE_METRICS_CERTS).
build_kueue() {
  module_crds kueue sigs.k8s.io/kueue "$KUEUE_VERSION"
  build_grouped kueue sigs.k8s.io/kueue/cmd/kueue "$KUEUE_VERSION" \
    "-X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
}
build_jobset() {
  build_grouped jobset sigs.k8s.io/jobset "$JOBSET_VERSION"
  module_crds jobset sigs.k8s.io/jobset "$JOBSET_VERSION"
}
# module_crds NAME MODULE VERSION: config/components/crd/bases/*.yaml -> share/NAME-crds-VERSION/
module_crds() {
  local out="$cache/share/$1-crds-$3"
  [ -d "$out" ] && return 0
  local src
  src=$(go mod download -json "$2@$3" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  mkdir -p "$out.tmp"
  cp "$src"/config/components/crd/bases/*.yaml "$out.tmp/"
  chmod u+w "$out.tmp"/*.yaml
  mv "$out.tmp" "$out"
}

# TOPOTRAIN_BUILD_DONE (scripts/test.sh, testbed/binaries.py: BUILD_PENDING_ENV): a directory where
# each binary is marked (an empty file of its name) once built, and the exit status is written to
# .end when the build ends, so tests that need only some binaries start before the rest are built.
done_dir=${TOPOTRAIN_BUILD_DONE:-}
if [ -n "$done_dir" ]; then
  mkdir -p "$done_dir"
  trap 'echo $? > "$done_dir/.end"' EXIT
fi
mark_built() {
  [ -n "$done_dir" ] || return 0
  local b
  case $1 in
    kubernetes) for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do : > "$done_dir/$b"; done ;;
    kwok) : > "$done_dir/kwok"; : > "$done_dir/kwokctl" ;;
    *) : > "$done_dir/$1" ;;
  esac
}

components=("$@")
# Kueue and JobSet (about 11 CPU-minutes cold) only when named: scripts/test.sh builds them in
# the background while the main suites run; bench/versus.py builds them when it starts.
# The S3 server first: the trainer tests need nothing else, and start while the rest builds.
[ ${#components[@]} -eq 0 ] && components=(versitygw etcd kubernetes kwok helm)
for c in "${components[@]}"; do
  log "building $c"
  timed "build_$c"
  mark_built "$c"
done
echo "$bin"
