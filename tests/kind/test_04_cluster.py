"""What the cluster itself must show after the runs above: the operator's
metrics answer inside the cluster through its Service, and the host's kernel
settings are those of before the cluster existed (nodes share the host's
kernel; scripts/kind/node/topotrain-node-init keeps their kubelets off it)."""

from __future__ import annotations

import json
import subprocess
import uuid

from testbed.kube import Kube
from tests.kind.conftest import KindEnv, kubectl_json, wait_for
from tests.kind.host_sysctl import differences, snapshot


def test_operator_metrics_scraped_from_inside_the_cluster(kube: Kube, kind_env: KindEnv) -> None:
    services = kubectl_json(kube, "-n", kind_env.operator_namespace, "get", "services",
                            "-l", "app.kubernetes.io/component=metrics")["items"]  # fmt: skip
    assert len(services) == 1, [s["metadata"]["name"] for s in services]
    svc = services[0]
    url = (f"http://{svc['metadata']['name']}.{kind_env.operator_namespace}.svc:"
           f"{svc['spec']['ports'][0]['port']}/metrics")  # fmt: skip
    operator_image = kubectl_json(kube, "-n", kind_env.operator_namespace, "get", "deployments")[
        "items"][0]["spec"]["template"]["spec"]["containers"][0]["image"]
    pod = f"scrape-{uuid.uuid4().hex[:6]}"
    script = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    # the operator image is loaded onto the control-plane node only (scripts/kind-e2e.sh)
    overrides = {"spec": {
        "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
        "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "containers": [{
            "name": pod, "image": operator_image, "imagePullPolicy": "Never",
            "command": ["python", "-c", script],
            "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False},
        }],
    }}  # fmt: skip
    kube.kubectl("-n", kind_env.namespace, "run", pod, "--restart=Never", f"--image={operator_image}",
                 f"--overrides={json.dumps(overrides)}")  # fmt: skip
    try:
        wait_for(lambda: kubectl_json(kube, "-n", kind_env.namespace, "get", "pod", pod)["status"].get(
            "phase") in ("Succeeded", "Failed"), 120, f"pod {pod} to finish")  # fmt: skip
        text = kube.kubectl("-n", kind_env.namespace, "logs", pod).stdout
        phase = kubectl_json(kube, "-n", kind_env.namespace, "get", "pod", pod)["status"]["phase"]
        assert phase == "Succeeded", text[-2000:]
        # the jobs of the tests above were counted by phase
        assert 'topotrain_jobs{phase="Succeeded"}' in text, text[-2000:]
        assert "topotrain_reconcile_seconds_count" in text
    finally:
        kube.kubectl("-n", kind_env.namespace, "delete", "pod", pod, "--wait=false", check=False)


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
