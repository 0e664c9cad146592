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

# go install works for modules whose go.mod has no replace directives.
build_install() {
  local name=$1 pkg=$2 v=$3
  stamped "$name" "$v" && return 0
  GOBIN="$bin" go install -trimpath -ldflags "-s -w ${4:-}" "$pkg@$v"
  stamp "$name" "$v"
}

build_kwok() {
  build_install kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" \
    "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
  build_install kwokctl sigs.k8s.io/kwok/cmd/kwokctl "$KWOK_VERSION" \
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
  build_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" \
    "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
}
build_versitygw() {
  build_install versitygw github.com/versity/versitygw/cmd/versitygw "$VERSITYGW_VERSION" \
    "-X main.Version=$VERSITYGW_VERSION"
}

# Kueue and JobSet: the manager binaries plus their CRDs, copied from the module
# cache into share/ (the upstream files are taken at build time, never committed).
# Built inside the module's own directory, with its own go.mod and go.sum (`go install
# sigs.k8s.io/kueue/cmd/kueue@v` first asks the proxy for a module at the package path,
# which it refuses with 403, not 404, and go install stops there).
# Built inside the module's own source, with its own go.mod and go.sum (`go install
# sigs.k8s.io/kueue/cmd/kueue@v` first asks the proxy for a module at the package path,
# which it refuses with 403, not 404, and go install stops there).
build_in_module() {
  local name=$1 module=$2 v=$3 pkg=$4
  stamped "$name" "$v" && return 0
  local src
  src=$(go mod download -json "$module@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  (cd "$src" && go build -trimpath -ldflags "-s -w ${5:-}" -o "$bin/$name" "$pkg")
  stamp "$name" "$v"
}
# Kueue reads its metrics certificate from the fixed path /etc/kueue/metrics/certs whenever
# its own certificate management is off (cmd/kueue/main.go), metrics served or not. Writing
# under /etc would change the host, so the testbed's Kueue reads it relative to its working
# directory (testbed/kueue.py starts it in its state directory): a copy of the module's source
# (go refuses -overlay files in the module cache) with that one string replaced; a version
# whose main.go no longer names the path fails here rather than build something else.
KUEUE_METRICS_CERTS=metrics-certs
build_kueue() {
  local v=$KUEUE_VERSION stampv="$KUEUE_VERSION+$KUEUE_METRICS_CERTS"
  module_crds kueue sigs.k8s.io/kueue "$v"
  stamped kueue "$stampv" && return 0
  local src dir="$cache/build/kueue-$v"
  src=$(go mod download -json "sigs.k8s.io/kueue@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  grep -q '"/etc/kueue/metrics/certs"' "$src/cmd/kueue/main.go" || {
    log "kueue $v: cmd/kueue/main.go no longer names /etc/kueue/metrics/certs; update build_kueue"
    return 1
  }
  rm -rf "$dir" && mkdir -p "$dir"
  cp -r "$src" "$dir/src" && chmod -R u+w "$dir/src"
  sed -i 's#"/etc/kueue/metrics/certs"#"'"$KUEUE_METRICS_CERTS"'"#' "$dir/src/cmd/kueue/main.go"
  (cd "$dir/src" && go build -trimpath -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$v" \
    -o "$bin/kueue" ./cmd/kueue)
  rm -rf "$dir"
  stamp kueue "$stampv"
}
build_jobset() {
  build_in_module jobset sigs.k8s.io/jobset "$JOBSET_VERSION" .
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

components=("$@")
# Kueue and JobSet (about 11 CPU-minutes cold) only when named: scripts/test.sh builds them in
# the background while the main suites run; bench/versus.py builds them when it starts.
[ ${#components[@]} -eq 0 ] && components=(etcd kubernetes kwok helm versitygw)
for c in "${components[@]}"; do
  log "building $c"
  timed "build_$c"
done
echo "$bin"
