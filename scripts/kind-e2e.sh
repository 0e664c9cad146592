#!/usr/bin/env bash
# The end-to-end suite on kind, for machines with Docker (docs/kind.md).
# It cannot run on the project's CI machines (no Docker); the suite itself is
# the same one `make test` runs on the testbed, through KUBECONFIG.
#
#   1. kind cluster from kind-config.yaml (workers labelled with blocks, racks
#      and NVLink domains)
#   2. MinIO from its upstream image as the S3 store (pulled by Docker, never
#      built or vendored here), exposed on 127.0.0.1:30900
#   3. KWOK controller in the cluster with the testbed's node and pod stages
#      (including the chaos stages used for fault injection), and KWOK GPU
#      nodes from examples/clusters/tiny.yaml
#   4. operator and trainer images built and loaded into kind; a smoke check
#      runs each on a real kind worker
#   5. pytest tests/e2e with KUBECONFIG and the MinIO endpoint
#
# Environment: KIND_CLUSTER (default topotrain), KEEP_CLUSTER=1 to keep it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cluster=${KIND_CLUSTER:-topotrain}
# shellcheck source=/dev/null
source testbed/versions.env
minio_image=${MINIO_IMAGE:-quay.io/minio/minio:RELEASE.2025-09-07T16-13-09Z}
minio_user=topotrain
minio_password=topotrain-kind-secret
version=$(sed -nE 's/^version = "(.*)"/\1/p' pyproject.toml)

log() { printf '[kind-e2e] %s\n' "$*" >&2; }
need() { command -v "$1" >/dev/null || { log "needs $1 on PATH ($2)"; exit 1; }; }
need docker "the kind path runs nodes as containers"
need kind "https://kind.sigs.k8s.io"

venv=$(scripts/bootstrap.sh trainer | tail -n 1)
bin=$(testbed/build.sh kubernetes kwok helm | tail -n 1)   # kubectl, helm and KWOK's stages, same versions as the testbed
export PATH="$venv/bin:$bin:$PATH"
stages="${TOPOTRAIN_CACHE:-$HOME/.cache/topotrain}/share/kwok-stages-$KWOK_VERSION.yaml"

kubeconfig="$root/.kind/kubeconfig"
mkdir -p "$root/.kind"
cleanup() {
  if [ "${KEEP_CLUSTER:-0}" != 1 ]; then
    log "deleting kind cluster $cluster (KEEP_CLUSTER=1 keeps it)"
    kind delete cluster --name "$cluster" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

if ! kind get clusters 2>/dev/null | grep -qx "$cluster"; then
  log "creating kind cluster $cluster"
  kind create cluster --name "$cluster" --config kind-config.yaml --kubeconfig "$kubeconfig" --wait 180s
else
  kind get kubeconfig --name "$cluster" > "$kubeconfig"
fi
export KUBECONFIG="$kubeconfig"

# Real pods (MinIO, KWOK, the smoke checks) must not land on KWOK nodes.
real_nodes='{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":[{"key":"type","operator":"NotIn","values":["kwok"]}]}]}}}'

log "deploying MinIO ($minio_image) as the S3 store"
kubectl create namespace minio --dry-run=client -o yaml | kubectl apply -f -
kubectl -n minio apply -f - <<YAML
apiVersion: apps/v1
kind: Deployment
metadata: {name: minio}
spec:
  selector: {matchLabels: {app: minio}}
  template:
    metadata: {labels: {app: minio}}
    spec:
      affinity: $real_nodes
      containers:
        - name: minio
          image: $minio_image
          args: [server, /data, --address, ":9000"]
          env:
            - {name: MINIO_ROOT_USER, value: $minio_user}
            - {name: MINIO_ROOT_PASSWORD, value: $minio_password}
          ports: [{containerPort: 9000}]
          readinessProbe: {httpGet: {path: /minio/health/ready, port: 9000}}
          volumeMounts: [{name: data, mountPath: /data}]
      volumes: [{name: data, emptyDir: {}}]
---
apiVersion: v1
kind: Service
metadata: {name: minio}
spec:
  type: NodePort
  selector: {app: minio}
  ports: [{port: 9000, targetPort: 9000, nodePort: 30900}]
YAML
kubectl -n minio rollout status deployment/minio --timeout=300s

log "deploying the KWOK controller $KWOK_VERSION with the testbed's stages"
kubectl apply -f "https://github.com/kubernetes-sigs/kwok/releases/download/$KWOK_VERSION/kwok.yaml"
kubectl -n kube-system patch deployment kwok-controller --type=merge -p "{\"spec\":{\"template\":{\"spec\":{\"affinity\":$real_nodes}}}}"
kubectl -n kube-system rollout status deployment/kwok-controller --timeout=300s
kubectl apply -f "$stages"
python - <<PY
import sys
sys.path.insert(0, "$root")
from testbed.nodes import apply_topology, wait_nodes_ready
names = apply_topology("$kubeconfig", "$root/examples/clusters/tiny.yaml")
wait_nodes_ready("$kubeconfig", names, timeout=180)
print(f"{len(names)} KWOK GPU nodes Ready")
PY

log "building and loading the operator and trainer images ($version)"
docker build -t "ghcr.io/topotrain/operator:$version" -f operator/Dockerfile .
docker build -t "ghcr.io/topotrain/trainer:$version" -f trainer_image/Dockerfile .
kind load docker-image --name "$cluster" "ghcr.io/topotrain/operator:$version" "ghcr.io/topotrain/trainer:$version"

log "smoke: the chart's operator Deployment becomes Available on a real worker"
helm install topotrain-smoke charts/topotrain -n topotrain-smoke --create-namespace \
  --set image.pullPolicy=Never --set-json "affinity=$real_nodes" --wait --timeout 300s
helm uninstall topotrain-smoke -n topotrain-smoke --wait
kubectl delete namespace topotrain-smoke --wait=false

log "smoke: the trainer image trains a few steps on a real worker (one process)"
kubectl -n minio run trainer-smoke --restart=Never --image="ghcr.io/topotrain/trainer:$version" \
  --image-pull-policy=Never --overrides="{\"spec\":{\"affinity\":$real_nodes}}" \
  --env=TOPOTRAIN_TRAINING_CONFIG='{"model":"tiny","steps":3,"metricsPort":0}'
kubectl -n minio wait pod/trainer-smoke --for=jsonpath='{.status.phase}'=Succeeded --timeout=600s
kubectl -n minio logs trainer-smoke | tail -n 3
kubectl -n minio delete pod trainer-smoke --wait=false

log "running the end-to-end suite against kind"
export TOPOTRAIN_E2E_S3_ENDPOINT=http://127.0.0.1:30900
export TOPOTRAIN_E2E_S3_ACCESS_KEY=$minio_user
export TOPOTRAIN_E2E_S3_SECRET_KEY=$minio_password
python -m pytest tests/e2e -m e2e "$@"
