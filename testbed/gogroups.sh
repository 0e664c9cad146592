# shellcheck shell=bash
# Go module groups: the upstream tools the testbed and the kind path build (testbed/build.sh,
# scripts/kind/build-bins.sh), built from one generated module per group instead of one module
# each, so the dependencies they share are compiled once.
#
# Each tool's own go.mod selects its own versions of what they all use (k8s.io/api, client-go,
# controller-runtime, golang.org/x/..., grpc): Kueue, JobSet, KWOK, CoreDNS and the rest each
# compiled their own copy of the Kubernetes client libraries, and Go's build cache shares a package
# only when the versions of everything under it match. A group's module requires its members at
# their pinned versions and Go's minimal version selection picks, for every shared module, the
# highest version any member asks for: each member is built at its own release, its dependencies
# moved up at most to what another member of the group already requires (never down). Members of
# a group use the same Kubernetes minor (k8s.io/* v0.X): moving Kueue to client-go v0.36 does not
# compile (its Kubeflow Trainer dependency names an API type that v0.36 removed), so the groups
# follow the minors. Measured cold (docs/testbed.md, "Go module groups"): the ten tools took 1257
# CPU-seconds of Go instead of 1631 (-23 %).
#
# The Kubernetes binaries (testbed/build.sh, scripts/kind/build-bins.sh) and etcd keep their own
# modules: they are what the tests are about, built exactly as their releases pin them.
#
# Needs: $cache (the cache root), testbed/versions.env sourced, GOFLAGS/CGO_ENABLED exported.

# go_group TOOL: the group a tool is built in
go_group() {
  case $1 in
    kueue | coredns) echo k8s35 ;;
    jobset | kwok | kwokctl | versitygw | kind) echo k8s36 ;;
    helm | crictl | containerd | ctr | containerd-shim-runc-v2) echo k8s37 ;;
    *) echo "go_group: no group for $1" >&2; return 1 ;;
  esac
}

# go_group_members GROUP: "module version" lines
go_group_members() {
  case $1 in
    k8s35) printf '%s %s\n' sigs.k8s.io/kueue "$KUEUE_VERSION" github.com/coredns/coredns "$COREDNS_VERSION" ;;
    k8s36) printf '%s %s\n' sigs.k8s.io/jobset "$JOBSET_VERSION" sigs.k8s.io/kwok "$KWOK_VERSION" \
             github.com/versity/versitygw "$VERSITYGW_VERSION" sigs.k8s.io/kind "$KIND_VERSION" ;;
    k8s37) printf '%s %s\n' helm.sh/helm/v3 "$HELM_VERSION" sigs.k8s.io/cri-tools "$CRICTL_VERSION" \
             github.com/containerd/containerd/v2 "$CONTAINERD_VERSION" ;;
    *) echo "go_group_members: no group $1" >&2; return 1 ;;
  esac
}

# go_group_packages GROUP: the main packages built from it (the module's tools.go imports them,
# so `go mod tidy` records every module they need)
go_group_packages() {
  case $1 in
    k8s35) echo sigs.k8s.io/kueue/cmd/kueue ;;  # CoreDNS: ./coredns, a main package in the module
    k8s36) echo sigs.k8s.io/jobset sigs.k8s.io/kwok/cmd/kwok sigs.k8s.io/kwok/cmd/kwokctl \
             github.com/versity/versitygw/cmd/versitygw sigs.k8s.io/kind ;;
    k8s37) echo helm.sh/helm/v3/cmd/helm sigs.k8s.io/cri-tools/cmd/crictl \
             github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/ctr \
             github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 ;;
  esac
}

# go_group_key GROUP: what the group's binaries are built from (stamps carry it, so bumping any
# member rebuilds the group's binaries, whose shared dependencies may have moved)
go_group_key() {
  { go_group_members "$1"; echo "layout-v1 $KUEUE_METRICS_CERTS"; } | sha256sum | cut -c1-12
}

# Kueue reads its metrics certificate from the fixed path /etc/kueue/metrics/certs whenever
# its own certificate management is off (cmd/kueue/main.go), metrics served or not. Writing
# under /etc would change the host, so the testbed's Kueue reads it relative to its working
# directory (testbed/kueue.py starts it in its state directory): the group module replaces the
# Kueue module by a copy of its source with that one string replaced (go refuses -overlay files
# in the module cache); a version whose main.go no longer names the path fails here rather than
# build something else.
KUEUE_METRICS_CERTS=metrics-certs

_go_module_dir() {
  go mod download -json "$1@$2" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'
}

# CoreDNS with the plugins of kubeadm's default Corefile (plus log): a fraction of the full
# build, which links every cloud provider's SDK.
_coredns_main() {
  cat <<'GO'
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
}

# go_group_dir GROUP: the group's module directory, generated once (under a lock: the testbed
# build, the kind builds and the Kueue build run side by side and may ask for it together).
go_group_dir() {
  local group=$1 key dir
  key=$(go_group_key "$group")
  dir="$cache/build/go-$group-$key"
  mkdir -p "$cache/build"
  (
    flock 9
    [ -e "$dir/.ready" ] && exit 0
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
    cd "$dir.tmp"
    local module version replace=""
    {
      printf 'module topotrain.io/testbed/go-%s\n\ngo 1.26\n\nrequire (\n' "$group"
      while read -r module version; do printf '\t%s %s\n' "$module" "$version"; done < <(go_group_members "$group")
      printf ')\n'
    } > go.mod
    if [ "$group" = k8s35 ]; then
      local src
      src=$(_go_module_dir sigs.k8s.io/kueue "$KUEUE_VERSION")
      grep -q '"/etc/kueue/metrics/certs"' "$src/cmd/kueue/main.go" || {
        echo "kueue $KUEUE_VERSION: cmd/kueue/main.go no longer names /etc/kueue/metrics/certs; update testbed/gogroups.sh" >&2
        exit 1
      }
      cp -r "$src" kueue-src && chmod -R u+w kueue-src
      sed -i 's#"/etc/kueue/metrics/certs"#"'"$KUEUE_METRICS_CERTS"'"#' kueue-src/cmd/kueue/main.go
      replace="sigs.k8s.io/kueue=./kueue-src"
      mkdir coredns && _coredns_main > coredns/main.go
    fi
    [ -n "$replace" ] && go mod edit -replace "$replace"
    {
      printf '//go:build tools\n\npackage tools\n\nimport (\n'
      local p
      for p in $(go_group_packages "$group"); do printf '\t_ "%s"\n' "$p"; done
      printf ')\n'
    } > tools.go
    go mod tidy >/dev/null 2>&1 || go mod tidy
    touch .ready
    cd / && rm -rf "$dir" && mv "$dir.tmp" "$dir"
  ) 9>"$dir.lock"
  echo "$dir"
}

# go_group_build TOOL OUT LDFLAGS [go build args...] PACKAGE...: build in the tool's group
go_group_build() {
  local tool=$1 out=$2 ld=$3 dir
  shift 3
  dir=$(go_group_dir "$(go_group "$tool")")
  (cd "$dir" && go build -trimpath -ldflags "$ld" -o "$out" "$@")
}

# go_group_stamp TOOL VERSION: the stamp of a binary built in a group
go_group_stamp() { echo "$2+go-$(go_group "$1")-$(go_group_key "$(go_group "$1")")"; }
