#!/usr/bin/env bash
# The real-data-plane suite (docs/kind.md): one entry point that builds, creates,
# tests and always cleans up.
#   1. a Docker engine (scripts/kind/engine.sh installs Debian's docker.io and
#      starts dockerd when none answers)
#   2. binaries and images built locally, cached by version under
#      $TOPOTRAIN_CACHE (scripts/kind/build-bins.sh, scripts/kind/images.sh);
#      nothing is pulled
#   3. a kind cluster from kind-config.yaml (scripts/kind/cluster.sh): real
#      kubelets, containerd, pod network and cluster DNS in node containers
#   4. in the cluster: the S3 server (versitygw image) and the chart installed
#      by helm with the locally built operator image, so the operator runs as
#      its Deployment; the workers' node image holds the trainer image (step 2
#      preloads it: no `kind load` of it into each worker)
#   5. pytest tests/kind against it
#   6. the cluster deleted; the host's kernel settings compared with those
#      before the run, and no container, network or volume of ours left
# `--prepare` stops after step 2. `--up` stops after step 4, leaving the cluster up (deleted on
# failure); `--test-up` then runs steps 5 and 6 on it (scripts/test.sh runs --prepare in the
# background while the other suites run, then the whole script). Extra arguments go to pytest. Environment:
# KIND_CLUSTER (default topotrain), KEEP_CLUSTER=1 keeps the cluster (and skips the after-run
# checks).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=scripts/kind/lib.sh
source scripts/kind/lib.sh
export KIND_CLUSTER=${KIND_CLUSTER:-topotrain}
# kind's node network, ours alone: deleted with the cluster.
export KIND_EXPERIMENTAL_DOCKER_NETWORK=${KIND_EXPERIMENTAL_DOCKER_NETWORK:-topotrain-$KIND_CLUSTER}
version=$(sed -nE 's/^version = "(.*)"/\1/p' pyproject.toml)
operator_image=ghcr.io/topotrain/operator:$version
trainer_image=ghcr.io/topotrain/trainer:$version-cpu
# The workers' node image holds the trainer image already (scripts/kind/images.sh worker).
export KIND_WORKER_IMAGE=$repo/kind-worker:$KUBERNETES_VERSION
# The S3 server: versitygw from the image scripts/kind/images.sh builds, or MinIO from
# MINIO_IMAGE when that image is present or can be pulled (as on a user's machine;
# nothing can be pulled on ours, so there it falls back to versitygw).
s3_image=$repo/s3:$VERSITYGW_VERSION
s3_server=versitygw
s3_key=topotrain-kind
s3_secret=topotrain-kind-secret
jobs_namespace=topotrain-kind
run_start=$SECONDS

# --prepare: steps 1 and 2 only; --up: 1 to 4; --test-up: 5 and 6 on the cluster --up left.
mode=all
case "${1:-}" in
  --prepare) mode=prepare; shift ;;
  --up) mode=up; shift ;;
  --test-up) mode=test-up; shift ;;
esac
# What the host looked like before the cluster existed, and what --up hands to --test-up; kept
# beside the cluster's own state (scripts/kind/cluster.sh delete removes that).
state="$kind_cache/runs/$KIND_CLUSTER"

scripts/kind/engine.sh
venv=$(scripts/bootstrap.sh trainer | tail -n 1)
tb_bin=$(testbed/build.sh kubernetes etcd helm versitygw | tail -n 1)
kind_bin=$(timed "kind binaries" scripts/kind/build-bins.sh | tail -n 1)
export PATH="$kind_wrap:$venv/bin:$kind_bin:$tb_bin:$PATH"
export PYTHONPATH="$root/operator:$root/trainer_image:$root/sdk:$root${PYTHONPATH:+:$PYTHONPATH}"

if [ $mode != test-up ]; then
  timed "images" scripts/kind/images.sh
  # The smoke runs once per pair of images: `make test` runs --prepare and then the stage, on the
  # same images (about 30 s of the stage's critical path when repeated).
  smoked="$state/smoked-images"
  images_now=$(docker image inspect -f '{{.Id}}' "$trainer_image" "$operator_image")
  if [ -s "$smoked" ] && [ "$(cat "$smoked")" = "$images_now" ]; then
    log "smoke: passed already for these trainer and operator images"
  else
    log "smoke: the trainer image's --help and a three-step training in one process"
    # (the trainer has no --help of its own: its argparse entry point is `prepare`)
    docker run --rm "$trainer_image" prepare --help >/dev/null
    docker run --rm -e TOPOTRAIN_TRAINING_CONFIG='{"model":"tiny","steps":3,"globalBatch":2,"microBatch":1,"metricsPort":0}' \
      "$trainer_image" 2>&1 | tail -n 2
    docker run --rm "$operator_image" --help >/dev/null
    mkdir -p "$state" && echo "$images_now" >"$smoked"
  fi
fi
if [ $mode = prepare ]; then
  log "prepared in $((SECONDS - run_start))s"
  exit 0
fi
if [ $mode != test-up ]; then
# A cluster of this name left by a run that was stopped before its cleanup (an EXIT trap does
# not run on SIGKILL or when the machine stops) holds the name and about 30 GB of volumes: the
# next run deletes it. A run records its owner (TOPOTRAIN_KIND_OWNER: scripts/test.sh's pid under
# `make test`, so its --up and --test-up share one owner; else this script's) as pid and start time, so a live run's cluster is
# never taken for a stale one, and a reused pid is not taken for a live run.
owner_of() { [ -r "/proc/$1/stat" ] && echo "$1 $(awk '{print $22}' "/proc/$1/stat")"; }
owner=$(owner_of "${TOPOTRAIN_KIND_OWNER:-$$}")
mkdir -p "$state"
if [ -s "$state/owner" ] && [ "$(cat "$state/owner")" != "$owner" ] \
    && [ "$(owner_of "$(cut -d' ' -f1 "$state/owner")")" = "$(cat "$state/owner")" ]; then
  die "cluster $KIND_CLUSTER belongs to a run still going (pid $(cut -d' ' -f1 "$state/owner")); set KIND_CLUSTER to run beside it"
fi
if [ -n "$(docker ps -a -q --filter "label=io.x-k8s.kind.cluster=$KIND_CLUSTER")" ]; then
  log "deleting cluster $KIND_CLUSTER, left behind by a run that did not finish"
  scripts/kind/cluster.sh delete
fi
docker network rm "$KIND_EXPERIMENTAL_DOCKER_NETWORK" >/dev/null 2>&1 || true
echo "$owner" > "$state/owner"
# The loaded trainer image alone takes about 9 GB in each worker's volume (docs/kind.md).
need_gb=${KIND_MIN_FREE_GB:-30}
docker_root=$(docker info -f '{{.DockerRootDir}}')
free_gb=$(( $(df -Pk "$docker_root" | awk 'NR==2 {print $4}') / 1048576 ))
[ "$free_gb" -ge "$need_gb" ] \
  || die "only ${free_gb} GB free under $docker_root; a kind cluster with the trainer image on three workers needs about ${need_gb} GB (KIND_MIN_FREE_GB)"

rm -f "$state/up.env"
python3 tests/kind/host_sysctl.py save "$state/host-sysctl-before.json"
docker volume ls -q | sort > "$state/volumes-before"
fi
cleanup() {
  local code=$?
  if [ "${KEEP_CLUSTER:-0}" = 1 ]; then
    log "keeping cluster $KIND_CLUSTER (KUBECONFIG=$kubeconfig)"
    exit $code
  fi
  scripts/kind/cluster.sh delete && rm -f "$state/owner" || code=1
  docker network rm "$KIND_EXPERIMENTAL_DOCKER_NETWORK" >/dev/null 2>&1 || true
  local left
  left=$(docker ps -a -q --filter "label=io.x-k8s.kind.cluster=$KIND_CLUSTER"; \
    docker network ls -q --filter "name=^$KIND_EXPERIMENTAL_DOCKER_NETWORK\$"; \
    docker volume ls -q | sort | comm -13 "$state/volumes-before" -)
  if [ -n "$left" ]; then
    log "left behind after kind delete: $left"
    code=1
  fi
  if ! python3 tests/kind/host_sysctl.py compare "$state/host-sysctl-before.json"; then
    log "the run changed the host's kernel settings"
    code=1
  fi
  log "kind-e2e finished in $((SECONDS - run_start))s (exit $code)"
  exit $code
}
trap cleanup EXIT
if [ $mode = test-up ]; then
  [ -s "$state/up.env" ] || die "no cluster from scripts/kind-e2e.sh --up (no $state/up.env)"
  # shellcheck source=/dev/null
  source "$state/up.env"
  export KUBECONFIG=$kubeconfig
else
kubeconfig=$(scripts/kind/cluster.sh create | tail -n 1)
export KUBECONFIG=$kubeconfig
workers=$(kubectl get nodes -l nvidia.com/gpu.product -o jsonpath='{.items[*].metadata.name}' | tr ' ' ',')
if [ -n "${MINIO_IMAGE:-}" ]; then
  if docker image inspect "$MINIO_IMAGE" >/dev/null 2>&1 || timeout 120 docker pull "$MINIO_IMAGE" >&2; then
    s3_image=$MINIO_IMAGE
    s3_server=minio
  else
    log "MINIO_IMAGE=$MINIO_IMAGE cannot be pulled: the S3 server is versitygw ($s3_image)"
  fi
fi
# Training pods run on the workers; the operator and S3 on the control-plane node (tolerating its
# taint), out of reach of the tests that stop or pause a worker.
control_plane=$(kubectl get nodes -l node-role.kubernetes.io/control-plane -o jsonpath='{.items[0].metadata.name}')
timed "kind load (operator, s3 onto $control_plane)" \
  kind load docker-image --name "$KIND_CLUSTER" --nodes "$control_plane" "$operator_image" "$s3_image" >&2
# The workers' node image holds the trainer image; a worker without it (a node image from an
# older build, seen once in CI) gets it loaded, slower but the same cluster.
missing=()
for node in ${workers//,/ }; do
  # (read whole, then searched: `| grep -q` under pipefail fails on ctr's SIGPIPE)
  listed=$(docker exec "$node" ctr -n k8s.io images ls -q)
  grep -qxF "$trainer_image" <<<"$listed" || missing+=("$node")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "workers ${missing[*]} do not hold $trainer_image (node image $(docker inspect -f '{{.Config.Image}}' "${missing[0]}")); loading it"
  timed "kind load (trainer onto ${missing[*]})" \
    kind load docker-image --name "$KIND_CLUSTER" --nodes "$(IFS=,; echo "${missing[*]}")" "$trainer_image" >&2
fi
# Each worker unpacks the trainer image now, all side by side and beside the S3 server and the
# chart, instead of when a test first starts a pod there (the workers' node image holds it packed:
# 40-60 s a node, measured 2026-12-06, twice on the critical path of the suite). A failed unpack is
# only logged: the kubelet unpacks it on first use, as before.
unpacks=()
for node in ${workers//,/ }; do
  (docker exec "$node" bash -c "mkdir -p /tmp/unpack && ctr -n k8s.io images mount --snapshotter overlayfs \
     '$trainer_image' /tmp/unpack && ctr -n k8s.io images unmount --rm /tmp/unpack" 2>&1 \
     | grep -vE 'DEPRECATION|^sha256:|^/tmp/unpack$' >&2 || true) &
  unpacks+=($!)
done
unpacked() { local p start=$SECONDS; for p in "${unpacks[@]}"; do wait "$p" || true; done
             log "trainer image unpacked on the workers (waited $((SECONDS - start))s)"; }
on_control_plane='{"node-role.kubernetes.io/control-plane": ""}'
control_plane_toleration='[{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}]'

if [ "$s3_server" = minio ]; then
  s3_args='[server, /data, --address, ":7070"]'
else
  s3_args='[--access, $(ACCESS), --secret, $(SECRET), --region, us-east-1, --port, ":7070", posix, /data]'
fi
log "S3 server: $s3_server ($s3_image) in namespace topotrain-s3"
kubectl create namespace topotrain-s3 --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl -n topotrain-s3 apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Secret
metadata: {name: s3-root}
stringData: {access: $s3_key, secret: $s3_secret}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: s3}
spec:
  selector: {matchLabels: {app: s3}}
  template:
    metadata: {labels: {app: s3}}
    spec:
      nodeSelector: $on_control_plane
      tolerations: $control_plane_toleration
      containers:
        - name: $s3_server
          image: $s3_image
          imagePullPolicy: IfNotPresent
          args: $s3_args
          env:
            - {name: ACCESS, valueFrom: {secretKeyRef: {name: s3-root, key: access}}}
            - {name: SECRET, valueFrom: {secretKeyRef: {name: s3-root, key: secret}}}
            - {name: MINIO_ROOT_USER, valueFrom: {secretKeyRef: {name: s3-root, key: access}}}
            - {name: MINIO_ROOT_PASSWORD, valueFrom: {secretKeyRef: {name: s3-root, key: secret}}}
          ports: [{containerPort: 7070}]
          readinessProbe: {tcpSocket: {port: 7070}, periodSeconds: 2}
          volumeMounts: [{name: data, mountPath: /data}]
      volumes: [{name: data, emptyDir: {}}]
---
apiVersion: v1
kind: Service
metadata: {name: s3}
spec:
  selector: {app: s3}
  ports: [{port: 7070, targetPort: 7070}]
YAML
timed "S3 server available" kubectl -n topotrain-s3 rollout status deployment/s3 --timeout=180s >&2

log "the chart, with the operator image $operator_image"
kubectl create namespace "$jobs_namespace" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl -n "$jobs_namespace" create secret generic s3-credentials \
  --from-literal=AWS_ACCESS_KEY_ID=$s3_key --from-literal=AWS_SECRET_ACCESS_KEY=$s3_secret \
  --dry-run=client -o yaml | kubectl apply -f - >/dev/null
timed "helm install" helm install topotrain charts/topotrain -n topotrain-system --create-namespace \
  --set image.pullPolicy=Never --set "image.tag=$version" \
  --set-json "rbac.checkpointSecrets=[{\"namespace\":\"$jobs_namespace\",\"names\":[\"s3-credentials\"]}]" \
  --set-json "nodeSelector=$on_control_plane" --set-json "tolerations=$control_plane_toleration" \
  --set operator.reconcileIntervalSeconds=2 --set operator.checkpointPollSeconds=2 \
  --wait --timeout 180s >&2
unpacked
fi
if [ $mode = up ]; then
  printf 'kubeconfig=%q\n' "$kubeconfig" > "$state/up.env"
  log "cluster $KIND_CLUSTER up in $((SECONDS - run_start))s; scripts/kind-e2e.sh --test-up runs the suite"
  trap - EXIT
  exit 0
fi

export TOPOTRAIN_KIND=1
export TOPOTRAIN_KIND_CLUSTER=$KIND_CLUSTER
export TOPOTRAIN_KIND_NAMESPACE=$jobs_namespace
export TOPOTRAIN_KIND_TRAINER_IMAGE=$trainer_image
export TOPOTRAIN_KIND_S3_ENDPOINT=http://s3.topotrain-s3.svc.cluster.local:7070
export TOPOTRAIN_KIND_S3_SECRET=s3-credentials
export TOPOTRAIN_KIND_OPERATOR_NAMESPACE=topotrain-system
export TOPOTRAIN_KIND_HOST_SYSCTL="$state/host-sysctl-before.json"
timed "pytest tests/kind" python -m pytest tests/kind -m kind -p no:cacheprovider --durations=10 "$@"
