#!/usr/bin/env bash
# Builds the Go binaries a kind node needs from the Go module proxy, cached
# under $TOPOTRAIN_CACHE/kind/bin keyed by version: kind, containerd (+ ctr
# and the runc shim), crictl, CoreDNS (only the plugins kubeadm's Corefile
# uses), kubeadm, kubelet and kube-proxy (the same wrapper module as the
# testbed's, so the Go build cache is shared), and the pause binary (C, static).
# Usage: scripts/kind/build-bins.sh [component ...]   (default: all)
set -euo pipefail
# shellcheck source=scripts/kind/lib.sh
source "$(dirname "$0")/lib.sh"
# -dwarf=false: every binary is linked with -s -w (no symbol table, no DWARF), so the DWARF the
# compiler would write for each package is thrown away; not generating it saves compile time.
export CGO_ENABLED=0 GOFLAGS="-buildvcs=false -gcflags=all=-dwarf=false" GOTOOLCHAIN=local

# wrapped_build NAME VERSION DIR: DIR holds a main/tools file; tidy and build
# each package listed in $pkgs into kind_bin.
wrapped_module() {
  local dir=$1 module=$2 version=$3
  mkdir -p "$dir"
  (
    cd "$dir"
    printf 'module topotrain.io/kind/%s\n\ngo 1.25\n\nrequire %s %s\n' \
      "$(basename "$dir")" "$module" "$version" > go.mod
    go mod tidy >/dev/null 2>&1 || go mod tidy
  )
}

build_kind() {
  stamped kind "$KIND_VERSION" && return 0
  GOBIN="$kind_bin" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@$KIND_VERSION"
  stamp kind "$KIND_VERSION"
}

build_containerd() {
  local v=$CONTAINERD_VERSION all=1 b
  for b in containerd ctr containerd-shim-runc-v2; do stamped "$b" "$v" || all=0; done
  [ $all = 1 ] && return 0
  local dir="$cache/build/kind-containerd-$v"
  mkdir -p "$dir"
  cat > "$dir/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
GO
  wrapped_module "$dir" github.com/containerd/containerd/v2 "$v"
  local ld="-s -w -X github.com/containerd/containerd/v2/version.Version=$v"
  (cd "$dir" && go build -trimpath -tags "no_btrfs no_devmapper no_zfs no_aufs" -ldflags "$ld" \
    -o "$kind_bin/" github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
    github.com/containerd/containerd/v2/cmd/ctr)
  for b in containerd ctr containerd-shim-runc-v2; do stamp "$b" "$v"; done
}

build_crictl() {
  local v=$CRICTL_VERSION
  stamped crictl "$v" && return 0
  local dir="$cache/build/kind-crictl-$v"
  mkdir -p "$dir"
  printf '//go:build tools\n\npackage tools\n\nimport _ "sigs.k8s.io/cri-tools/cmd/crictl"\n' > "$dir/tools.go"
  wrapped_module "$dir" sigs.k8s.io/cri-tools "$v"
  (cd "$dir" && go build -trimpath -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$v" \
    -o "$kind_bin/crictl" sigs.k8s.io/cri-tools/cmd/crictl)
  stamp crictl "$v"
}

# CoreDNS with only the plugins of kubeadm's default Corefile (plus log):
# a fraction of the full build, which links every cloud provider's SDK.
build_coredns() {
  local v=$COREDNS_VERSION
  stamped coredns "$v" && return 0
  local dir="$cache/build/kind-coredns-$v"
  mkdir -p "$dir"
  cat > "$dir/main.go" <<'GO'
// CoreDNS with the plugins kubeadm's Corefile uses.
package main

import (
	_ "github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func main() { coremain.Run() }
GO
  wrapped_module "$dir" github.com/coredns/coredns "$v"
  (cd "$dir" && go build -trimpath -ldflags "-s -w" -o "$kind_bin/coredns" .)
  stamp coredns "$v"
}

# kubeadm, kubelet and kube-proxy from a wrapper module generated like the
# testbed's (testbed/build.sh): k8s.io/kubernetes with its staging modules
# replaced by their published versions.
build_kubernetes() {
  local v=$KUBERNETES_VERSION all=1 b
  for b in kubeadm kubelet kube-proxy; do stamped "$b" "$v" || all=0; done
  [ $all = 1 ] && return 0
  local dir="$cache/build/kind-kubernetes-$v"
  mkdir -p "$dir"
  cat > "$dir/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kubeadm"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
GO
  (
    cd "$dir"
    local gomod staging="v0.${v#v1.}"
    gomod=$(go mod download -json "k8s.io/kubernetes@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
    {
      echo "module topotrain.io/kind/kubernetes"
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
    local ld="-s -w" pkg
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ld="$ld -X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
      ld="$ld -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    go build -trimpath -ldflags "$ld" -o "$kind_bin/" \
      k8s.io/kubernetes/cmd/kubeadm k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
  )
  for b in kubeadm kubelet kube-proxy; do stamp "$b" "$v"; done
}

# The pause container's binary: kubernetes' own build/pause/linux/pause.c from
# the module cache, linked statically.
build_pause() {
  local v=$PAUSE_VERSION
  stamped pause "$v-$KUBERNETES_VERSION" && return 0
  local src
  src=$(go_module_dir k8s.io/kubernetes "$KUBERNETES_VERSION")/build/pause/linux/pause.c
  gcc -Os -static -DVERSION="v$v-topotrain" -o "$kind_bin/pause" "$src"
  strip "$kind_bin/pause"
  stamp pause "$v-$KUBERNETES_VERSION"
}

components=("$@")
[ ${#components[@]} -eq 0 ] && components=(kind pause crictl containerd kubernetes coredns)
for c in "${components[@]}"; do
  timed "build $c" "build_$c"
done
echo "$kind_bin"
