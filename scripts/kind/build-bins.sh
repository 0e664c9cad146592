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
# kind, containerd, crictl and CoreDNS: built in the Go module groups they share with the
# testbed's tools (testbed/gogroups.sh).
# shellcheck source=testbed/gogroups.sh
source "$kind_root/testbed/gogroups.sh"

# grouped_stamp NAME VERSION: the stamp of a binary built in its Go module group
grouped_stamp() { go_group_stamp "$1" "$2"; }

build_kind() {
  local st
  st=$(grouped_stamp kind "$KIND_VERSION")
  stamped kind "$st" && return 0
  go_group_build kind "$kind_bin/kind" "-s -w" sigs.k8s.io/kind
  stamp kind "$st"
}

build_containerd() {
  local v=$CONTAINERD_VERSION all=1 b st
  st=$(grouped_stamp containerd "$v")
  for b in containerd ctr containerd-shim-runc-v2; do stamped "$b" "$st" || all=0; done
  [ $all = 1 ] && return 0
  go_group_build containerd "$kind_bin/" "-s -w -X github.com/containerd/containerd/v2/version.Version=$v" \
    -tags "no_btrfs no_devmapper no_zfs no_aufs" github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 github.com/containerd/containerd/v2/cmd/ctr
  for b in containerd ctr containerd-shim-runc-v2; do stamp "$b" "$st"; done
}

build_crictl() {
  local v=$CRICTL_VERSION st
  st=$(grouped_stamp crictl "$v")
  stamped crictl "$st" && return 0
  go_group_build crictl "$kind_bin/crictl" "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$v" \
    sigs.k8s.io/cri-tools/cmd/crictl
  stamp crictl "$st"
}

# CoreDNS with only the plugins of kubeadm's default Corefile (plus log), a main package of its
# group's module (testbed/gogroups.sh).
build_coredns() {
  local st
  st=$(grouped_stamp coredns "$COREDNS_VERSION")
  stamped coredns "$st" && return 0
  go_group_build coredns "$kind_bin/coredns" "-s -w" ./coredns
  stamp coredns "$st"
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
