"""What the cluster itself must show after the runs above: the operator's
metrics answer inside the cluster through its Service, and the host's kernel
settings are those of before the cluster existed (nodes share the host's
kernel; scripts/kind/node/topotrain-node-init keeps their kubelets off it)."""

from __future__ import annotations

import json
import subprocess

from testbed.kube import Kube
from tests.kind.conftest import KindEnv, kubectl_json, scrape
from tests.kind.host_sysctl import differences, snapshot


def test_operator_metrics_scraped_from_inside_the_cluster(kube: Kube, kind_env: KindEnv) -> None:
    services = kubectl_json(kube, "-n", kind_env.operator_namespace, "get", "services",
                            "-l", "app.kubernetes.io/component=metrics")["items"]  # fmt: skip
    assert len(services) == 1, [s["metadata"]["name"] for s in services]
    svc = services[0]
    url = (f"http://{svc['metadata']['name']}.{kind_env.operator_namespace}.svc:"
           f"{svc['spec']['ports'][0]['port']}/metrics")  # fmt: skip
    text = scrape(kube, kind_env, url)
    # the jobs of the tests above were counted by phase
    assert 'topotrain_jobs{phase="Succeeded"}' in text, text[-2000:]
    assert "topotrain_reconcile_seconds_count" in text


def test_host_kernel_settings_unchanged_while_nodes_run(kind_env: KindEnv) -> None:
    before = json.loads(kind_env.host_sysctl_before.read_text())
    changed = differences(before, snapshot())
    assert not changed, "kind nodes changed the host's kernel settings:\n" + "\n".join(changed)
    # the nodes' kubelets did run: they see the values they want, in their own view only
    nodes = subprocess.run(["docker", "ps", "--filter", f"label=io.x-k8s.kind.cluster={kind_env.cluster}",
                            "--format", "{{.Names}}"], capture_output=True, text=True, check=True)  # fmt: skip
    node = nodes.stdout.split()[0]
    seen = subprocess.run(["docker", "exec", node, "cat", "/proc/sys/kernel/panic"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert seen == "10"
