"""`make demo`: topotrain on the local testbed, narrated.

1. Starts the testbed (real control plane, KWOK GPU nodes of a two-pool
   topology, an S3 server) and the operator (`topotrain run`).
2. Seeds the job's S3 prefix with committed checkpoints (steps 50 and 100) and
   a partial one (step 150, no COMMITTED marker), in the layout of DESIGN.md,
   because in this first version no trainer process runs: KWOK pods run nothing.
3. Applies examples/elastic-two-pools.yaml; prints the placement as a table and
   writes it as SVG.
4. Makes one of the job's nodes NotReady and shows the recovery: only the lost
   pod moves, and the new attempt resumes from step 100 (never 150).
5. Scales the job down (`kubectl scale --replicas=2`) and up again.

    python -m testbed.demo [--keep]      # --keep leaves the testbed and job running
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client
from topotrain.checkpoints import CheckpointStore, job_prefix
from topotrain.cli_plan import table
from topotrain.placement import GangRequest, Plan, PodAssignment
from topotrain.placement.svg import render
from topotrain.topology import Inventory

from testbed.binaries import bin_dir
from testbed.cluster import Testbed
from testbed.faults import node_not_ready, node_ready

REPO = Path(__file__).resolve().parent.parent
TOPOLOGY = REPO / "examples" / "clusters" / "two-pool.yaml"
JOB_FILE = REPO / "examples" / "elastic-two-pools.yaml"
NAMESPACE = "topotrain-demo"
SECRET = "s3-credentials"
T = TypeVar("T")


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def wait(what: str, probe: Callable[[], T | None], timeout: float = 180) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.3)
    raise SystemExit(f"demo: gave up waiting for {what} after {timeout:.0f}s")


class Demo:
    def __init__(self, bed: Testbed, workdir: Path) -> None:
        self.bed = bed
        self.workdir = workdir
        self.env = {**os.environ, "KUBECONFIG": str(bed.kubeconfig),
                    "PATH": f"{bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.api = client.ApiClient(_configuration(bed.kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.operator: subprocess.Popen[bytes] | None = None

    def kubectl(self, *args: str) -> str:
        done = subprocess.run([str(bin_dir() / "kubectl"), *args], env=self.env, check=True,
                              capture_output=True, text=True)
        return done.stdout

    # --- set-up ---------------------------------------------------------------

    def start_operator(self) -> None:
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                     str(REPO / "crds" / "topotrain.io_trainingjobs.yaml"))
        self.kubectl("wait", "--for=condition=Established", "crd/trainingjobs.topotrain.io")
        log = self.workdir / "operator.log"
        say(f"starting the operator: topotrain run --standalone --namespace {NAMESPACE} (log: {log})")
        with log.open("ab") as out:
            self.operator = subprocess.Popen(
                [sys.executable, "-m", "topotrain.cli", "run", "--standalone", "--namespace", NAMESPACE,
                 "--metrics-port", "0", "--health-port", "0"],
                env={**self.env, "TOPOTRAIN_RECONCILE_INTERVAL": "2"}, stdout=out,
                stderr=subprocess.STDOUT,
            )

    def seed(self, bucket: str) -> CheckpointStore:
        s3 = self.bed.s3
        subprocess.run([str(bin_dir() / "kubectl"), "create", "namespace", NAMESPACE],
                       env=self.env, capture_output=True)
        subprocess.run([str(bin_dir() / "kubectl"), "-n", NAMESPACE, "create", "secret", "generic", SECRET,
                        f"--from-literal=AWS_ACCESS_KEY_ID={s3.access_key}",
                        f"--from-literal=AWS_SECRET_ACCESS_KEY={s3.secret_key}"],
                       env=self.env, capture_output=True)
        store = CheckpointStore(job_prefix(f"s3://{bucket}/elastic", NAMESPACE, "elastic"), client=s3.client())
        mesh = {"tensor": 4, "pipeline": 2, "data": 4}
        for step in (50, 100):
            store.write_commit(step, mesh, 1 << 20)
        store.client.put_object(Bucket=bucket, Key=f"{store.step_key(150)}/__0_0.distcp", Body=b"partial")
        say(f"seeded {store.uri}: committed steps 50 and 100, and step 150 without COMMITTED "
            "(an upload cut short: it must never be restored)")
        return store

    def apply_job(self, bucket: str) -> None:
        job = yaml.safe_load(JOB_FILE.read_text())
        job["metadata"]["namespace"] = NAMESPACE
        job["spec"]["checkpoint"].update(uri=f"s3://{bucket}/elastic", endpoint=self.bed.s3.endpoint)
        job["spec"]["failurePolicy"]["backoffSeconds"] = 2
        say(f"applying {JOB_FILE.relative_to(REPO)}: tensor 4 x pipeline 2 x data 4 on 4-GPU pods, "
            "H100 preferred, A100 fallback, minData 2")
        self.custom.create_namespaced_custom_object("topotrain.io", "v1alpha1", NAMESPACE,
                                                    "trainingjobs", job)

    # --- observing ------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        job = self.custom.get_namespaced_custom_object("topotrain.io", "v1alpha1", NAMESPACE,
                                                       "trainingjobs", "elastic")
        return dict(job.get("status") or {})

    def running(self, attempt: int, data: int) -> dict[str, Any] | None:
        status = self.status()
        ok = (status.get("phase") == "Running" and status.get("attempt") == attempt
              and status.get("parallelism", {}).get("data") == data)
        return status if ok else None

    def pods(self) -> list[Any]:
        items = self.core.list_namespaced_pod(NAMESPACE, label_selector="topotrain.io/job=elastic").items
        return [p for p in items if p.metadata.deletion_timestamp is None]

    def show_placement(self, label: str) -> dict[int, str]:
        status = self.status()
        pods = sorted(self.pods(), key=lambda p: int(p.metadata.labels["topotrain.io/index"]))
        nodes = {int(p.metadata.labels["topotrain.io/index"]): p.spec.node_name for p in pods}
        raw_nodes = self.api.sanitize_for_serialization(self.core.list_node().items)
        raw_pods = self.api.sanitize_for_serialization(self.core.list_pod_for_all_namespaces().items)
        inventory = Inventory.from_snapshot(raw_nodes, raw_pods, ignore_pods_of={"topotrain.io/job": "elastic"})
        spec = self.custom.get_namespaced_custom_object("topotrain.io", "v1alpha1", NAMESPACE,
                                                        "trainingjobs", "elastic")["spec"]
        request = GangRequest.from_dict(spec).at_data(status["parallelism"]["data"])
        gpp = request.gpus_per_pod
        plan = Plan(True, pool=status.get("pool"), parallelism=dict(status["parallelism"]),
                    assignments=tuple(PodAssignment(i, n, (i * gpp, i * gpp + gpp - 1))
                                      for i, n in sorted(nodes.items())))
        print(table(plan, request, inventory))
        svg = self.workdir / f"placement-{label}.svg"
        svg.write_text(render(plan, request, inventory.known_in_pool(status["pool"])))
        summary = status.get("placement", {}).get("message", "")
        print(f"placement ({status.get('placement', {}).get('mode')}): {summary}\nSVG: {svg}")
        return nodes

    # --- the story ------------------------------------------------------------

    def run(self, bucket: str) -> None:
        self.start_operator()
        self.seed(bucket)
        self.apply_job(bucket)
        status = wait("the job Running", lambda: self.running(0, 4))
        say(f"the gang is Running: attempt 0, resumed from step {status['checkpoint']['step']} "
            "(the newest committed checkpoint)")
        before = self.show_placement("attempt-0")

        victim_index, victim = 3, before[3]
        say(f"node {victim} (pod {victim_index}) goes NotReady: its kubelet stops reporting")
        node_not_ready(self.bed.kubeconfig, victim)
        try:
            status = wait("the recovery", lambda: self.running(1, 4))
        finally:
            node_ready(self.bed.kubeconfig, victim)
        failure, recovery = status["lastFailure"], status["recovery"]
        say(f"failure detected: {failure['reason']}: {failure['message']}")
        after = self.show_placement("attempt-1")
        moved = sorted(i for i in after if after[i] != before.get(i))
        print(f"pods moved: {moved} (the others restarted on their nodes); "
              f"attempt {status['attempt']} resumed from step {recovery.get('resumeStep')} "
              f"(step 150 was never committed); recovered in {recovery.get('lastSeconds')}s")

        say("kubectl scale tj/elastic --replicas=2: the data degree shrinks to 2")
        self.kubectl("-n", NAMESPACE, "scale", "tj/elastic", "--replicas=2")
        status = wait("data=2", lambda: self.running(2, 2))
        print(f"Running with {len(self.pods())} pods, data={status['parallelism']['data']}, "
              f"resumed from step {status['recovery'].get('resumeStep')}")
        say("kubectl scale tj/elastic --replicas=4: it grows back")
        self.kubectl("-n", NAMESPACE, "scale", "tj/elastic", "--replicas=4")
        status = wait("data=4", lambda: self.running(3, 4))
        print(f"Running with {len(self.pods())} pods, data={status['parallelism']['data']}; "
              f"restarts counted: {status['restarts']} (resizes are not failures)")
        print(self.kubectl("-n", NAMESPACE, "get", "events", "--field-selector",
                           "involvedObject.kind=TrainingJob", "--sort-by=.lastTimestamp"))

    def stop(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(10)
            except subprocess.TimeoutExpired:
                self.operator.kill()


def _configuration(kubeconfig: Path) -> client.Configuration:
    from kubernetes import config

    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)  # type: ignore[no-untyped-call]
    return configuration


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="topotrain demo on the local testbed")
    parser.add_argument("--keep", action="store_true", help="leave the testbed and the job running")
    args = parser.parse_args(argv)
    bed = Testbed()
    say(f"starting the testbed with {TOPOLOGY.relative_to(REPO)} (32 KWOK GPU nodes, H100 and A100 pools)")
    workdir = bed.root / "demo"
    workdir.mkdir(parents=True, exist_ok=True)
    if args.keep:
        bed.up(topology=TOPOLOGY)
        demo = Demo(bed, workdir)
        demo.run(bed.s3.create_bucket("demo"))
        say(f"left running: KUBECONFIG={bed.kubeconfig}; `python -m testbed down` stops it")
        return 0
    with bed.session(topology=TOPOLOGY):
        demo = Demo(bed, workdir)
        try:
            demo.run(bed.s3.create_bucket("demo"))
        finally:
            demo.stop()
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
