"""Command lines of the control-plane processes, modelled on the flags that
envtest and kwokctl's binary runtime pass. Pure functions of the layout and
the ports, so they read as one table of how the testbed is wired."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from testbed.binaries import binary, kwok_stages
from testbed.pki import SERVICE_CIDR

# KWOK manages only nodes carrying this annotation; removing it is how a node
# "loses its kubelet" (no more heartbeats or lease renewals).
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_VALUE = "fake"
# KWOK renews each node lease every quarter of its duration (every 10 s for
# 40 s, as the kubelet does). The node lifecycle controller marks a node
# Unknown (and taints it unreachable) once its lease is that many seconds
# old. A large fleet on a loaded 2-core machine needs longer (kwokctl uses 200).
DEFAULT_NODE_LEASE_SECONDS = 40


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int


@dataclass(frozen=True)
class Settings:
    """What is chosen once per testbed and kept across restarts."""

    ports: Ports
    node_lease_seconds: int = DEFAULT_NODE_LEASE_SECONDS


@dataclass(frozen=True)
class Layout:
    """Where each piece of state lives under the testbed directory."""

    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def s3_data(self) -> Path:
        return self.root / "s3"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    def component_kubeconfig(self, stem: str) -> Path:
        return self.root / "kubeconfigs" / f"{stem}.kubeconfig"

    def pem(self, name: str) -> str:
        return str(self.pki / name)


def etcd(layout: Layout, settings: Settings) -> list[str]:
    client = f"http://127.0.0.1:{settings.ports.etcd_client}"
    peer = f"http://127.0.0.1:{settings.ports.etcd_peer}"
    return [
        str(binary("etcd")),
        "--name=testbed",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=testbed={peer}",
        # A throwaway cluster: skip fsync as envtest does (durability is not tested here).
        "--unsafe-no-fsync=true",
        "--quota-backend-bytes=4294967296",
        "--log-level=warn",
    ]


def apiserver(layout: Layout, settings: Settings) -> list[str]:
    pem = layout.pem
    return [
        str(binary("kube-apiserver")),
        f"--etcd-servers=http://127.0.0.1:{settings.ports.etcd_client}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={settings.ports.apiserver}",
        f"--tls-cert-file={pem('apiserver.crt')}",
        f"--tls-private-key-file={pem('apiserver.key')}",
        f"--client-ca-file={pem('ca.crt')}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pem('sa.pub')}",
        f"--service-account-signing-key-file={pem('sa.key')}",
        "--authorization-mode=Node,RBAC",
        # Request-header authentication, as kubeadm sets it up: delegated
        # authentication in the controller manager and scheduler reads it.
        f"--requestheader-client-ca-file={pem('ca.crt')}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pem('front-proxy-client.crt')}",
        f"--proxy-client-key-file={pem('front-proxy-client.key')}",
        "--allow-privileged=true",
        # One client fleet on one machine: no request throttling (kwokctl --disable-qps-limits).
        "--max-requests-inflight=0",
        "--max-mutating-requests-inflight=0",
        "--enable-priority-and-fairness=false",
        "--profiling=false",
        "--event-ttl=1h",
        "--v=1",
        *audit_flags(layout),
    ]


AUDIT_POLICY = "audit-policy.yaml"


def audit_flags(layout: Layout) -> list[str]:
    """An audit log (`<root>/audit.log`, JSON lines) when the testbed's owner wrote a policy to
    `<root>/audit-policy.yaml` before starting it (the chaos soak does); none otherwise."""
    policy = layout.root / AUDIT_POLICY
    if not policy.exists():
        return []
    return [f"--audit-policy-file={policy}", f"--audit-log-path={layout.root / 'audit.log'}",
            "--audit-log-format=json"]  # fmt: skip


def _delegated_auth(layout: Layout, stem: str) -> list[str]:
    kubeconfig = str(layout.component_kubeconfig(stem))
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        "--leader-elect=false",
        "--profiling=false",
    ]


def controller_manager(layout: Layout, settings: Settings) -> list[str]:
    pem = layout.pem
    return [
        str(binary("kube-controller-manager")),
        *_delegated_auth(layout, "kube-controller-manager"),
        f"--secure-port={settings.ports.controller_manager}",
        # Every controller but the CSR signers: nothing here signs certificate requests (pki.py
        # issues the testbed's certificates), and their signing files cost four of the host's
        # inotify instances per testbed (fs.inotify.max_user_instances, 128 for all of root's
        # processes: the kind nodes, the Kueue suite's and the multi-cluster test's four testbeds
        # together reached it in CI, 2026-12-07, and a Kueue exited "too many open files").
        "--controllers=*,-csrsigning",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pem('sa.key')}",
        f"--root-ca-file={pem('ca.crt')}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--cluster-name=topotrain-testbed",
        "--node-monitor-period=2s",
        f"--node-monitor-grace-period={settings.node_lease_seconds}s",
        "--kube-api-qps=200",
        "--kube-api-burst=400",
        # EndpointSlices of a gang's headless Service rewritten at most once a second, not on
        # every one of its pods' changes (a 1,024-pod gang's start is thousands of them; the
        # large-cluster setting, off by default)
        "--endpointslice-updates-batch-period=1s",
        # and so is the legacy Endpoints object (the endpoints controller still runs): without a
        # batch period it rewrote the Service's Endpoints, up to 1,000 addresses, for about two of
        # every three of its pods' changes (75 writes for 118 pods' creates and status updates in a
        # 500-node run of bench/scale.py)
        "--endpoint-updates-batch-period=1s",
        "--v=1",
    ]


def scheduler(layout: Layout, settings: Settings) -> list[str]:
    return [
        str(binary("kube-scheduler")),
        *_delegated_auth(layout, "kube-scheduler"),
        f"--secure-port={settings.ports.scheduler}",
        # kube-scheduler's own client limit (50 requests/s, bursts of 100) would bind a 1,024-pod
        # gang in no less than 19 s, whatever placed it: a fleet of thousands of GPU nodes runs it
        # higher, as the controller manager here (and kwokctl --disable-qps-limits) does.
        "--kube-api-qps=500",
        "--kube-api-burst=1000",
        "--v=1",
    ]


# KWOK's options: pod stages played 64 at a time, not 4. One KWOK plays the kubelets of every
# node, from one queue: at 4 a 1,024-pod gang waited ~30 s on KWOK alone; at 16 the pods of jobs
# that arrived just after it waited behind its 1,024 in that queue (about 9 s at 5,000 nodes,
# 2026-12-07), where each node's own kubelet would have started them at once.
# A configuration file replaces KWOK's defaults rather than adding to them (a missing
# nodeLeaseParallelism is 0, refused at start), so every defaulted option is written out, at
# its v0.8.0 default but the one changed.
KWOK_CONFIGURATION = """apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  manageAllNodes: false
  enableDebuggingHandlers: true
  enableContentionProfiling: false
  enableProfilingHandler: true
  podPlayStageParallelism: 64
  nodePlayStageParallelism: 4
  nodeLeaseParallelism: 4
  podsOnNodeSyncParallelism: 1
  enablePodsOnNodeSyncListPager: true
  enablePodsOnNodeSyncStreamWatch: false
"""


def kwok(layout: Layout, settings: Settings) -> list[str]:
    options = layout.root / "kwok-configuration.yaml"
    options.parent.mkdir(parents=True, exist_ok=True)
    options.write_text(KWOK_CONFIGURATION)
    return [
        str(binary("kwok")),
        f"--kubeconfig={layout.component_kubeconfig('kwok')}",
        f"--config={kwok_stages()}",
        f"--config={options}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={KWOK_NODE_VALUE}",
        f"--node-lease-duration-seconds={settings.node_lease_seconds}",
        "--node-ip=10.0.0.1",
        "--cidr=10.244.0.0/16",
        f"--server-address=127.0.0.1:{settings.ports.kwok}",
        "--v=WARN",  # not a line per lease renewal
    ]
