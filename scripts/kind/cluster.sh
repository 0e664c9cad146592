#!/usr/bin/env bash
# Creates (or deletes) the topotrain kind cluster from kind-config.yaml with the
# offline node image of scripts/kind/images.sh.
#   scripts/kind/cluster.sh create  -> kubeconfig path on the last line
#   scripts/kind/cluster.sh delete
# On top of kind-config.yaml's shape it adds: kubeadm's imageRepository (every
# image preloaded under $KIND_IMAGE_REPOSITORY), kubelet on cgroup v1, short
# node-failure timings (NotReady within about 10 s of a node stopping), no
# default CNI (kindnetd cannot be built offline; the node CNI below, Debian's
# ptp + host-local plugins with a route per node's podCIDR, takes its place),
# and the nvidia.com/gpu capacity of every labelled worker.
# Environment: KIND_CLUSTER (default topotrain), KIND_GPUS_PER_NODE (default 4),
# KIND_WORKER_IMAGE (the workers' node image; default: the node image, as for the control plane).
set -euo pipefail
# shellcheck source=scripts/kind/lib.sh
source "$(dirname "$0")/lib.sh"
cluster=${KIND_CLUSTER:-topotrain}
gpus=${KIND_GPUS_PER_NODE:-4}
state="$kind_cache/clusters/$cluster"
kubeconfig="$state/kubeconfig"
# kind runs `docker` from PATH: the wrapper first (scripts/kind/docker).
export PATH="$kind_cache/wrap:$kind_bin:$cache/bin:$PATH"
mkdir -p "$kind_cache/wrap" "$state"

effective_config() {
  KIND_IMAGE_REPOSITORY=$repo ETCD_VERSION=$ETCD_VERSION KUBERNETES_VERSION=$KUBERNETES_VERSION \
    python3 - "$kind_root/kind-config.yaml" "$cluster" <<'PY'
import sys, yaml, os
config = yaml.safe_load(open(sys.argv[1]))
config["name"] = sys.argv[2]
repo = os.environ["KIND_IMAGE_REPOSITORY"]
config.setdefault("networking", {})["disableDefaultCNI"] = True
args = lambda d: [{"name": k, "value": v} for k, v in d.items()]
cluster = {
    "kind": "ClusterConfiguration",
    "imageRepository": repo,
    "etcd": {"local": {"imageTag": os.environ["ETCD_VERSION"].lstrip("v")}},
    "controllerManager": {"extraArgs": args({
        "enable-hostpath-provisioner": "true",
        "node-monitor-period": "2s",
        "node-monitor-grace-period": "10s",
    })},
}
kubelet = {
    "kind": "KubeletConfiguration",
    "failCgroupV1": False,
    "nodeStatusUpdateFrequency": "2s",
    "nodeLeaseDurationSeconds": 8,
}
patches = config.setdefault("kubeadmConfigPatches", [])
patches += [yaml.safe_dump(cluster), yaml.safe_dump(kubelet)]
image = f"{repo}/kind-node:{os.environ['KUBERNETES_VERSION']}"
worker_image = os.environ.get("KIND_WORKER_IMAGE") or image
for node in config["nodes"]:
    node.setdefault("image", worker_image if node.get("role") == "worker" else image)
print(yaml.safe_dump(config, sort_keys=False))
PY
}

# The node CNI: on every node a ptp + host-local config for its podCIDR and a
# route to each other node's podCIDR through that node's address.
node_cni() {
  local nodes n cidr ip
  nodes=$(kubectl --kubeconfig "$kubeconfig" get nodes \
    -o jsonpath='{range .items[*]}{.metadata.name} {.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}')
  while read -r n cidr ip; do
    [ -n "$cidr" ] || die "node $n has no podCIDR"
    docker exec -i "$n" bash -c 'cat > /etc/cni/net.d/10-topotrain.conflist' <<JSON
{
  "cniVersion": "1.0.0",
  "name": "topotrain",
  "plugins": [
    {"type": "ptp", "ipMasq": false, "mtu": 1500,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$cidr"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
    docker exec "$n" sysctl -q -w net.ipv4.ip_forward=1
    local m mcidr mip
    while read -r m mcidr mip; do
      [ "$m" = "$n" ] && continue
      docker exec "$n" ip route replace "$mcidr" via "$mip"
    done <<< "$nodes"
  done <<< "$nodes"
}

# nvidia.com/gpu on every worker with a GPU product label: the extended-resource
# status patch (the kubelet keeps extended resources it does not manage).
node_gpus() {
  local n
  for n in $(kubectl --kubeconfig "$kubeconfig" get nodes -l nvidia.com/gpu.product -o name); do
    kubectl --kubeconfig "$kubeconfig" patch "$n" --subresource=status --type=json \
      -p "[{\"op\":\"add\",\"path\":\"/status/capacity/nvidia.com~1gpu\",\"value\":\"$gpus\"}]" >/dev/null
  done
}

# The node network, created here as IPv4 only: when kind creates its own it adds
# IPv6, and dockerd then turns on the host's net.ipv6.conf.all.forwarding.
network=${KIND_EXPERIMENTAL_DOCKER_NETWORK:-}

create() {
  [ -n "$network" ] || die "set KIND_EXPERIMENTAL_DOCKER_NETWORK (scripts/kind-e2e.sh does)"
  docker network inspect "$network" >/dev/null 2>&1 \
    || docker network create --driver bridge --label io.topotrain.kind="$cluster" "$network" >/dev/null
  ln -sf "$kind_root/scripts/kind/docker" "$kind_cache/wrap/docker"
  effective_config > "$state/kind-config.yaml"
  clusters=$(kind get clusters 2>/dev/null || true)  # (not piped into grep -q: SIGPIPE under pipefail)
  if ! grep -qx "$cluster" <<<"$clusters"; then
    timed "kind create cluster" kind create cluster --name "$cluster" \
      --config "$state/kind-config.yaml" --kubeconfig "$kubeconfig" --retain=false >&2
  else
    kind get kubeconfig --name "$cluster" > "$kubeconfig"
  fi
  timed "node CNI" node_cni
  timed "nodes Ready" kubectl --kubeconfig "$kubeconfig" wait node --all --for=condition=Ready --timeout=180s >&2
  node_gpus
  # The cluster's own services (CoreDNS here; S3 and the operator in kind-e2e.sh) run on the
  # control-plane node, so that a worker the tests stop or pause takes only training pods with it.
  kubectl --kubeconfig "$kubeconfig" -n kube-system patch deployment coredns --type merge \
    -p '{"spec":{"template":{"spec":{"nodeSelector":{"node-role.kubernetes.io/control-plane":""}}}}}' >/dev/null
  timed "CoreDNS available" kubectl --kubeconfig "$kubeconfig" -n kube-system rollout status deployment/coredns --timeout=180s >&2
  echo "$kubeconfig"
}

delete() {
  ln -sf "$kind_root/scripts/kind/docker" "$kind_cache/wrap/docker"
  timed "kind delete cluster" kind delete cluster --name "$cluster" >&2
  [ -z "$network" ] || docker network rm "$network" >/dev/null 2>&1 || true
  rm -rf "$state"
}

case "${1:-}" in
  create) create ;;
  delete) delete ;;
  *) echo "usage: $0 create|delete" >&2; exit 2 ;;
esac
