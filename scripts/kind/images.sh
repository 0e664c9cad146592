#!/usr/bin/env bash
# Every image a topotrain kind cluster runs, built locally (nothing is pulled):
#   node     $repo/kind-node:$KUBERNETES_VERSION  the kind node image, with the
#            control-plane, kube-proxy, etcd, CoreDNS and pause images preloaded
#            in its containerd under $repo (kubeadm imageRepository)
#   s3       $repo/s3:$VERSITYGW_VERSION          versitygw (posix backend)
#   operator ghcr.io/topotrain/operator:$version  operator/Dockerfile
#   trainer  ghcr.io/topotrain/trainer:$version-cpu  trainer_image/Dockerfile, FLAVOUR=cpu
#   worker   $repo/kind-worker:$KUBERNETES_VERSION  the node image with the trainer
#            image preloaded too (the cluster's workers; scripts/kind/cluster.sh)
# Each is keyed by the hash of what goes into it and kept in the engine (the
# node and base images also as tarballs under $TOPOTRAIN_CACHE/kind/images).
# Usage: scripts/kind/images.sh [node|s3|operator|trainer|worker|node-packages ...]  (default: all
# but node-packages, the node image's first layer, which `node` builds anyway)
set -euo pipefail
# shellcheck source=scripts/kind/lib.sh
source "$(dirname "$0")/lib.sh"
version=$(sed -nE 's/^version = "(.*)"/\1/p' "$kind_root/pyproject.toml")
tb_bin="$cache/bin"
debian="$repo/debian:$DEBIAN_SUITE"
python_image="$repo/python:$DEBIAN_SUITE"
image_id() { docker image inspect -f '{{.Id}}' "$1"; }

# simple_image TAG KEY CONTEXT_DIR DOCKERFILE_TEXT
simple_image() {
  local tag=$1 key=$2 ctx=$3 text=$4
  have_image "$tag" "$key" && return 0
  printf '%s\n' "$text" | docker_build -q -t "$tag" --label "io.topotrain.key=$key" -f - "$ctx" >/dev/null
  save_image "$tag" "$key"
}

# The images kubeadm and the nodes run, under $repo.
component_images() {
  local ctx
  ctx=$(mktemp -d)
  local b base_id
  base_id=$(image_id "$debian")
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    cp "$tb_bin/$b" "$ctx/"
    simple_image "$repo/$b:$KUBERNETES_VERSION" "$(key_of "$base_id" "$ctx/$b")" "$ctx" \
      "FROM $debian
COPY $b /usr/local/bin/$b
ENTRYPOINT [\"/usr/local/bin/$b\"]"
  done
  cp "$tb_bin/etcd" "$ctx/"
  simple_image "$repo/etcd:${ETCD_VERSION#v}" "$(key_of "$base_id" "$ctx/etcd")" "$ctx" \
    "FROM $debian
COPY etcd /usr/local/bin/etcd
ENTRYPOINT [\"/usr/local/bin/etcd\"]"
  cp "$kind_bin/kube-proxy" "$ctx/"
  simple_image "$repo/kube-proxy:$KUBERNETES_VERSION" "$(key_of "$base_id" "$ctx/kube-proxy" proxy-v1)" "$ctx" \
    "FROM $debian
RUN apt-get update && apt-get install -y --no-install-recommends iptables conntrack ipset kmod \
 && rm -rf /var/lib/apt/lists/*
COPY kube-proxy /usr/local/bin/kube-proxy
ENTRYPOINT [\"/usr/local/bin/kube-proxy\"]"
  cp "$kind_bin/coredns" "$ctx/"
  simple_image "$repo/coredns:$COREDNS_VERSION" "$(key_of "$base_id" "$ctx/coredns")" "$ctx" \
    "FROM $debian
COPY coredns /coredns
EXPOSE 53 53/udp
ENTRYPOINT [\"/coredns\"]"
  cp "$kind_bin/pause" "$ctx/"
  simple_image "$repo/pause:$PAUSE_VERSION" "$(key_of "$ctx/pause")" "$ctx" \
    "FROM scratch
COPY pause /pause
USER 65535:65535
ENTRYPOINT [\"/pause\"]"
  rm -rf "$ctx"
}

# The first layer of the node's base: its Debian packages (downloads and dpkg, minutes on a cold
# machine). `images.sh node-packages` builds it alone, so that CI can build it early, beside the
# Go builds the rest of the node image waits for; node_base then finds the layer in the build cache.
node_packages() {
  cat <<DOCKERFILE
FROM $debian
RUN apt-get update && apt-get install -y --no-install-recommends \
      systemd runc containernetworking-plugins conntrack iptables nftables iproute2 \
      ethtool util-linux mount kmod libseccomp2 pigz bash ca-certificates curl jq procps \
 && rm -rf /var/lib/apt/lists/* \
 && find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete \
 && rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \
      /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \
      /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/* \
 && echo ReadKMsg=no >> /etc/systemd/journald.conf \
 && ln -sf /usr/lib/systemd/systemd /sbin/init
DOCKERFILE
}
build_node-packages() {
  local ctx
  ctx=$(mktemp -d)
  node_packages | docker_build -q -t "$repo/kind-node-packages:$KUBERNETES_VERSION" -f - "$ctx" >/dev/null
  rm -rf "$ctx"
}

# The node's base: Debian packages, kind's own base-image files (from the kind
# module in the Go module cache), containerd/crictl built here, runc and the
# CNI plugins from Debian, and topotrain-node-init in front of kind's entrypoint.
node_base() {
  local kind_files ctx key tag
  kind_files=$(go_module_dir sigs.k8s.io/kind "$KIND_VERSION")/images/base/files
  ctx=$(mktemp -d)
  cp -r "$kind_files" "$ctx/files"
  chmod -R u+w "$ctx/files"
  mkdir -p "$ctx/bin"
  local b
  for b in containerd ctr containerd-shim-runc-v2 crictl kubeadm kubelet; do cp "$kind_bin/$b" "$ctx/bin/"; done
  cp "$tb_bin/kubectl" "$ctx/bin/"
  cp "$kind_root/scripts/kind/node/topotrain-node-init" "$ctx/"
  key=$(key_of "$(image_id "$debian")" "$KIND_VERSION" "$ctx"/bin/* "$ctx/topotrain-node-init" node-base-v2 "$KUBERNETES_VERSION" \
    "$repo" "$PAUSE_VERSION")
  tag="$repo/kind-node-base:$KUBERNETES_VERSION"
  if have_image "$tag" "$key"; then rm -rf "$ctx"; echo "$tag"; return 0; fi
  { node_packages; cat <<DOCKERFILE
COPY --chmod=0755 files/usr/local/bin/ /usr/local/bin/
COPY files/kind/ /kind/
COPY --chmod=0755 files/kind/bin/ /kind/bin/
COPY files/etc/ /etc/
COPY --chmod=0755 bin/containerd bin/ctr bin/containerd-shim-runc-v2 bin/crictl /usr/local/bin/
COPY --chmod=0755 bin/kubeadm bin/kubelet bin/kubectl /usr/bin/
COPY --chmod=0755 topotrain-node-init /usr/local/bin/topotrain-node-init
RUN mkdir -p /opt/cni/bin /etc/kubernetes/manifests && ln -s /usr/lib/cni/* /opt/cni/bin/ \
 && echo "$KUBERNETES_VERSION" > /kind/version \
 && systemctl enable kubelet.service containerd.service undo-mount-hacks.service \
 && systemctl mask systemd-binfmt.service \
 && ctr oci spec \
    | jq '.hooks.createContainer[.hooks.createContainer|length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
    | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json \
 && sed -i -e 's#sandbox_image = .*#sandbox_image = "$repo/pause:$PAUSE_VERSION"#' \
      -e 's#restrict_oom_score_adj = false#restrict_oom_score_adj = true#' /etc/containerd/config.toml \
 && grep -q 'restrict_oom_score_adj = true' /etc/containerd/config.toml \
 && containerd --version && runc --version && kubelet --version && kubeadm version -o short
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/usr/local/bin/topotrain-node-init", "/usr/local/bin/entrypoint", "/sbin/init"]
DOCKERFILE
  } > "$ctx/Dockerfile"
  docker_build -q -t "$tag" --label "io.topotrain.key=$key" "$ctx" >/dev/null
  rm -rf "$ctx"
  save_image "$tag" "$key"
  echo "$tag"
}

# The node image: node_base with the component images imported into its
# containerd (unpacked when first used, as kind does).
build_node() {
  component_images
  local base tag="$repo/kind-node:$KUBERNETES_VERSION" key images=() t
  base=$(node_base)
  images=("$repo/kube-apiserver:$KUBERNETES_VERSION" "$repo/kube-controller-manager:$KUBERNETES_VERSION"
    "$repo/kube-scheduler:$KUBERNETES_VERSION" "$repo/kube-proxy:$KUBERNETES_VERSION"
    "$repo/etcd:${ETCD_VERSION#v}" "$repo/coredns:$COREDNS_VERSION" "$repo/pause:$PAUSE_VERSION")
  key=$( (echo "$content_dir"; for t in "$base" "${images[@]}"; do image_id "$t"; done) | sha256sum | cut -c1-16)
  have_image "$tag" "$key" && return 0
  preload "$base" "$tag" "$key" "" "${images[@]}"
  save_image "$tag" "$key"
}

content_dir=/opt/containerd-content  # (preload, below; part of the node and worker images' keys)
# preload BASE TAG KEY LABEL IMAGE...: TAG is the node image BASE with IMAGEs imported into its
# containerd (k8s.io namespace) and not unpacked: containerd unpacks an image when a container of
# it is first created on the node. LABEL ("name=value", or empty) is put on TAG.
preload() {
  local base=$1 tag=$2 key=$3 label=$4 cid t
  shift 4
  cid=$(docker run -d --entrypoint sleep "$base" infinity)
  # The content store (the images' compressed layers) lives outside /var: kind gives each node a
  # volume at /var, filled with a copy of the image's /var when the node is created, and the
  # blobs copied into four nodes were gigabytes of writes (the trainer image's 3.75 GB on each
  # worker) at every cluster start. Read from the image's own layers they are not copied; the
  # snapshots containerd unpacks them into stay on the /var volume (overlayfs cannot be upper on
  # overlayfs). Measured 2026-12-06: see docs/kind.md.
  docker exec "$cid" bash -c "set -e; c=/var/lib/containerd/io.containerd.content.v1.content
    [ -L \$c ] && exit 0
    mkdir -p /var/lib/containerd
    if [ -d \$c ]; then mv \$c $content_dir; else mkdir -p $content_dir; fi
    ln -s $content_dir \$c"
  docker exec "$cid" bash -c 'nohup containerd >/tmp/containerd.log 2>&1 &'
  for _ in $(seq 30); do docker exec "$cid" ctr version >/dev/null 2>&1 && break; sleep 1; done
  for t in "$@"; do
    docker save "$t" | docker exec -i "$cid" ctr -n k8s.io images import --all-platforms --no-unpack --digests - >/dev/null
  done
  # The listing is read whole before it is searched: `ctr ... | grep -q` under pipefail fails when
  # grep stops reading at its match while ctr still writes (SIGPIPE), a false "not imported" that
  # a loaded machine produced (fixed 2026-12-05).
  local listed
  listed=$(docker exec "$cid" ctr -n k8s.io images ls -q)
  grep -v '^sha256:' <<<"$listed" >&2 || true
  # An import that lost an image (seen once in CI: a worker image without the trainer) is not
  # committed: check every name before the image is tagged with its key.
  for t in "$@"; do
    grep -qxF "$t" <<<"$listed" \
      || { docker rm -f -v "$cid" >/dev/null; echo "preload: $t is not in $tag's containerd after its import" >&2; return 1; }
  done
  docker exec "$cid" bash -c 'kill $(pidof containerd); while pidof containerd >/dev/null; do sleep 0.2; done; rm -f /tmp/containerd.log'
  docker commit --change "LABEL io.topotrain.key=$key" --change "LABEL $built_label" ${label:+--change "LABEL $label"} \
    --change 'ENTRYPOINT ["/usr/local/bin/topotrain-node-init", "/usr/local/bin/entrypoint", "/sbin/init"]' \
    --change 'CMD []' "$cid" "$tag" >/dev/null
  docker rm -f -v "$cid" >/dev/null
}

# The worker node image: the node image with the trainer image preloaded, so that the workers of
# a new cluster hold it from the start instead of each importing it (`kind load`: minutes of
# disk writes after the cluster is up). Not kept in the cache's tars (it is two cached images).
# A new trainer image (any change to our Python sources: the trainer image holds the operator's
# package too) is imported on top of the previous worker image when that was built on the same
# node image: containerd skips the layers it holds already and the commit is one thin layer, instead
# of 3.75 GB written again (measured 2026-12-06: 117 s for the whole import on a quiet machine,
# 204 s beside the tests). At most $worker_depth such layers; then it is built from the node again.
worker_depth=12
build_worker() {
  local node="$repo/kind-node:$KUBERNETES_VERSION" trainer="ghcr.io/topotrain/trainer:$version-cpu"
  local tag="$repo/kind-worker:$KUBERNETES_VERSION" key base node_id on depth
  # ("verified": images committed before preload checked its imports are rebuilt once)
  key=$( (echo verified "$content_dir"; for t in "$node" "$trainer"; do image_id "$t"; done) | sha256sum | cut -c1-16)
  [ "$(docker image inspect -f '{{index .Config.Labels "io.topotrain.key"}}' "$tag" 2>/dev/null)" = "$key" ] \
    && return 0
  node_id=$(image_id "$node")
  base=$node
  on=$(docker image inspect -f '{{index .Config.Labels "io.topotrain.node"}}' "$tag" 2>/dev/null || true)
  if [ "$on" = "$node_id" ]; then
    depth=$(( $(docker image inspect -f '{{len .RootFS.Layers}}' "$tag") - $(docker image inspect -f '{{len .RootFS.Layers}}' "$node") ))
    if [ "$depth" -lt "$worker_depth" ]; then base=$tag; echo "worker image: the new trainer image on the previous worker image ($depth layers on the node image)" >&2; fi
  fi
  preload "$base" "$tag" "$key" "io.topotrain.node=$node_id" "$trainer"
}

build_s3() {
  local ctx
  ctx=$(mktemp -d)
  cp "$tb_bin/versitygw" "$ctx/"
  simple_image "$repo/s3:$VERSITYGW_VERSION" "$(key_of "$(image_id "$debian")" "$ctx/versitygw")" "$ctx" \
    "FROM $debian
COPY versitygw /usr/local/bin/versitygw
RUN useradd --system --uid 65532 --home-dir /data --shell /usr/sbin/nologin s3 \
 && mkdir -p /data && chown 65532 /data
USER 65532
EXPOSE 7070
ENTRYPOINT [\"/usr/local/bin/versitygw\"]"
  rm -rf "$ctx"
}

# Our Dockerfiles: docker build's layer cache makes a warm run fast.
# Labelled, so that the images a rebuild leaves untagged can be pruned (ours only).
built_label=io.topotrain.built-by=scripts/kind/images.sh
build_operator() {
  docker_build -q -t "ghcr.io/topotrain/operator:$version" --label "$built_label" --build-arg "PYTHON_IMAGE=$python_image" \
    -f "$kind_root/operator/Dockerfile" "$kind_root" >/dev/null
}
build_trainer() {
  docker_build -q -t "ghcr.io/topotrain/trainer:$version-cpu" --label "$built_label" --build-arg FLAVOUR=cpu \
    --build-arg "PYTHON_IMAGE=$python_image" -f "$kind_root/trainer_image/Dockerfile" "$kind_root" >/dev/null
}

"$kind_root/scripts/kind/base-images.sh"
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(node s3 operator trainer worker)
for t in "${targets[@]}"; do
  timed "image $t" "build_$t"
done
# An earlier build of our Dockerfiles, untagged by this one, is only disk (GBs for the trainer).
docker image prune -f --filter "label=$built_label" >/dev/null
