"""`make demo`: topotrain on the local testbed, narrated, with a real trainer.

1. Starts the testbed (real control plane, KWOK GPU nodes of a two-pool
   topology, an S3 server), the operator (`topotrain run`) and the pod
   process harness (testbed.harness): KWOK pods run nothing, so the harness
   runs each trainer pod's own command and environment as local processes,
   standing in for a kubelet's process execution.
2. Applies a tiny 3D job (tensor 2 x pipeline 2 x data 2 on 2-GPU pods, H100
   preferred, A100 fallback, minData 1); prints the placement as a table and
   writes it as SVG; streams the trainer's real losses and its asynchronous
   checkpoints to S3.
3. Makes a node of the job NotReady (its processes die with it) and shows the
   recovery: the operator restarts the gang on healthy nodes from the newest
   *committed* checkpoint, and the losses continue where they were.
4. Scales the job down (`kubectl scale --replicas=1`) and up again: the data
   degree changes, the global batch and the sample order do not.

    python -m testbed.demo [--keep]      # --keep leaves the testbed and job running
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client
from topotrain.checkpoints import CheckpointStore, job_prefix
from topotrain.cli.plan import table
from topotrain.placement import GangRequest, Plan, PodAssignment
from topotrain.placement.svg import render
from topotrain.placement.topology import Inventory

from testbed.binaries import bin_dir
from testbed.cluster import STATE_DIR_ENV, Testbed, default_state_dir
from testbed.faults import node_not_ready, node_ready
from testbed.harness import PodProcessHarness
from testbed.harness_proc import json_lines

REPO = Path(__file__).resolve().parent.parent
TOPOLOGY = REPO / "examples" / "clusters" / "two-pool.yaml"
# A job small enough for real trainer processes on a laptop: 8 ranks of the tiny model.
DEMO_JOB: dict[str, Any] = {
    "apiVersion": "topotrain.io/v1alpha1", "kind": "TrainingJob",
    "metadata": {"name": "elastic"},
    "spec": {
        "image": "ghcr.io/topotrain/trainer:0.1.0",
        "parallelism": {"tensor": 2, "pipeline": 2, "data": 2, "minData": 1},
        "worker": {"gpusPerPod": 2, "gpuTypes": ["H100-80GB", "A100-80GB"]},
        "checkpoint": {"uri": "s3://demo/elastic", "credentialsSecret": "s3-credentials",
                       "intervalSteps": 5, "keep": 2},
        "failurePolicy": {"maxRestarts": 10, "backoffSeconds": 2},
        "training": {"model": "tiny", "steps": 40, "globalBatch": 8, "microBatch": 2,
                     "progressEvery": 1, "metricsPort": 0},
    },
}
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
        self.harness: PodProcessHarness | None = None
        self.printed: dict[Path, int] = {}  # JSON lines shown so far, per pod log

    def kubectl(self, *args: str) -> str:
        done = subprocess.run([str(bin_dir() / "kubectl"), *args], env=self.env, check=True,
                              capture_output=True, text=True)
        return done.stdout

    # --- set-up ---------------------------------------------------------------

    def start_operator(self) -> None:
        self.kubectl("apply", "--server-side", "--force-conflicts", "--validate=false", "-f",
                     str(REPO / "crds" / "topotrain.io_trainingjobs.yaml"))
        self.kubectl("wait", "--for=condition=Established", "crd/trainingjobs.topotrain.io")
        log = self.workdir / "operator.log"
        say(f"starting the operator: topotrain run --standalone --namespace {NAMESPACE} (log: {log})")
        with log.open("ab") as out:
            self.operator = subprocess.Popen(
                [sys.executable, "-m", "topotrain.cli", "run", "--standalone", "--namespace", NAMESPACE,
                 "--metrics-port", "0", "--health-port", "0"],
                env={**self.env, "TOPOTRAIN_RECONCILE_INTERVAL": "2",
                     "TOPOTRAIN_CHECKPOINT_ENDPOINTS": "127.0.0.1"},  # the testbed's S3, on loopback
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def prepare(self, bucket: str) -> CheckpointStore:
        s3 = self.bed.s3
        subprocess.run([str(bin_dir() / "kubectl"), "create", "namespace", NAMESPACE],
                       env=self.env, capture_output=True)
        subprocess.run([str(bin_dir() / "kubectl"), "-n", NAMESPACE, "create", "secret", "generic", SECRET,
                        f"--from-literal=AWS_ACCESS_KEY_ID={s3.access_key}",
                        f"--from-literal=AWS_SECRET_ACCESS_KEY={s3.secret_key}"],
                       env=self.env, capture_output=True)
        self.harness = PodProcessHarness(self.bed.kubeconfig, self.workdir / "harness", namespace=NAMESPACE).start()
        say("started the pod process harness: KWOK nodes run no processes, so it runs each trainer "
            f"pod's command as a local process (logs: {self.workdir / 'harness' / 'logs'})")
        return CheckpointStore(job_prefix(f"s3://{bucket}/elastic", NAMESPACE, "elastic"), client=s3.client())

    def apply_job(self, bucket: str) -> None:
        job = yaml.safe_load(yaml.safe_dump(DEMO_JOB))
        job["metadata"]["namespace"] = NAMESPACE
        job["spec"]["checkpoint"].update(uri=f"s3://{bucket}/elastic", endpoint=self.bed.s3.endpoint)
        say("applying a TrainingJob: tensor 2 x pipeline 2 x data 2 on 2-GPU pods (4 pods, 8 ranks of a "
            "tiny Llama-style model), H100 preferred, A100 fallback, minData 1, a checkpoint every 5 steps")
        self.custom.create_namespaced_custom_object("topotrain.io", "v1alpha1", NAMESPACE,
                                                    "trainingjobs", job)

    def stream(self, until: Callable[[dict[str, Any]], bool], timeout: float = 600) -> dict[str, Any]:
        """Print the trainer's new log lines (losses, checkpoints) until `until(line)` holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.harness is not None
            # per log: a line added to one pod's log must not shift what was shown of the others
            for path in self.harness.job_logs(NAMESPACE, "elastic"):
                lines = list(json_lines([path]))
                for line in lines[self.printed.get(path, 0):]:
                    self.printed[path] = self.printed.get(path, 0) + 1
                    _print_event(line)
                    if until(line):
                        return line
            time.sleep(0.5)
        raise SystemExit(f"demo: the trainer logged nothing expected for {timeout:.0f}s")

    def stream_resumed(self, steps: int = 3) -> None:
        """Print the trainer's lines until it has restored a checkpoint and trained `steps` more."""
        restored = self.stream(lambda e: e.get("event") == "restored")
        self.stream(lambda e: e.get("event") == "step" and e["step"] >= restored["step"] + steps)

    def scale(self, data: int, attempt: int) -> dict[str, Any]:
        """`kubectl scale` the job to `data`; its status once `attempt` runs at that degree."""
        self.kubectl("-n", NAMESPACE, "scale", "tj/elastic", f"--replicas={data}")
        return wait(f"data={data}", lambda: self.running(attempt, data), timeout=300)

    # --- observing ------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        job = self.custom.get_namespaced_custom_object("topotrain.io", "v1alpha1", NAMESPACE,
                                                       "trainingjobs", "elastic")
        return dict(job.get("status") or {})

    def running(self, attempt: int, data: int) -> dict[str, Any] | None:
        status = self.status()
        ok = (status.get("phase") == "Running" and int(status.get("attempt") or 0) >= attempt
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
        store = self.prepare(bucket)
        self.apply_job(bucket)
        wait("the job Running", lambda: self.running(0, 2), timeout=300)
        say("the gang is Running (attempt 0); the trainer starts (torch, gloo) and trains:")
        before = self.show_placement("attempt-0")
        committed = self.stream(lambda e: e.get("event") == "checkpoint_committed")
        self.stream(lambda e: e.get("event") == "step" and e["step"] >= committed["step"] + 3)

        victim_index = max(before)
        victim = before[victim_index]
        say(f"node {victim} (pod {victim_index}) goes NotReady: its kubelet stops reporting and the "
            "trainer processes on it die")
        print(f"committed checkpoints in S3 now: {[c.step for c in store.list_committed()]}")
        node_not_ready(self.bed.kubeconfig, victim)
        try:
            status = wait("the recovery", lambda: self.running(1, 2), timeout=300)
        finally:
            node_ready(self.bed.kubeconfig, victim)
        failure, recovery = status["lastFailure"], status["recovery"]
        say(f"failure detected: {failure['reason']}: {failure['message']}")
        after = self.show_placement("attempt-1")
        moved = sorted(i for i in after if after[i] != before.get(i))
        print(f"pods moved: {moved}; attempt {status['attempt']} resumes from step "
              f"{recovery.get('resumeStep')}, the newest committed checkpoint; gang Running again "
              f"{recovery.get('lastSeconds')}s after the failure")
        self.stream_resumed()

        say("kubectl scale tj/elastic --replicas=1: the data degree shrinks to 1, same global batch")
        status = self.scale(data=1, attempt=2)
        print(f"Running with {len(self.pods())} pods, data={status['parallelism']['data']}, "
              f"resuming from step {status['recovery'].get('resumeStep')}")
        self.stream_resumed()
        say("kubectl scale tj/elastic --replicas=2: it grows back")
        status = self.scale(data=2, attempt=3)
        print(f"Running with {len(self.pods())} pods, data={status['parallelism']['data']}; "
              f"restarts counted: {status['restarts']} (resizes are not failures)")
        # A stopped gang's trainer also closes with a "done" line at the step it stopped at (the
        # gang replaced by the grow saved on SIGTERM): wait for the one at the last step.
        last = int(DEMO_JOB["spec"]["training"]["steps"])
        self.stream(lambda e: e.get("event") == "done" and int(e.get("step") or 0) >= last)
        wait("Succeeded", lambda: self.status().get("phase") == "Succeeded", timeout=120)
        say(f"the job Succeeded; its checkpoints stay in S3: {[c.step for c in store.list_committed()]}")
        print(self.kubectl("-n", NAMESPACE, "get", "tj", "-o", "wide"))
        print(self.kubectl("-n", NAMESPACE, "get", "events", "--field-selector",
                           "involvedObject.kind=TrainingJob", "--sort-by=.lastTimestamp"))

    def stop(self) -> None:
        if self.harness is not None:
            self.harness.stop()
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(10)
            except subprocess.TimeoutExpired:
                self.operator.kill()


def _print_event(line: dict[str, Any]) -> None:
    """One trainer log line, as a person wants to read it."""
    event = line.get("event")
    if event == "step":
        print(f"    step {line['step']:>3}  loss {line['loss']:.4f}  ({line['step_seconds']:.2f} s)", flush=True)
    elif event == "checkpoint_saved":
        print(f"    checkpoint step {line['step']}: {line['mode']} save, training paused {line['stall_seconds']:.2f} s")
    elif event == "checkpoint_committed":
        print(f"    checkpoint step {line['step']} COMMITTED in S3 ({line['bytes'] / 1e6:.1f} MB)")
    elif event == "restored":
        print(f"    restored step {line['step']} from S3 onto mesh {line['mesh']} "
              f"(consumed samples {line['consumed_samples']})")
    elif event == "done":
        print(f"    done at step {line['step']}")


def _configuration(kubeconfig: Path) -> client.Configuration:
    from kubernetes import config

    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)  # type: ignore[no-untyped-call]
    return configuration


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="topotrain demo on the local testbed")
    parser.add_argument("--keep", action="store_true", help="leave the testbed and the job running")
    args = parser.parse_args(argv)
    # A testbed of its own: its 32 nodes must not show up in the tests' testbed
    # (the default one, which keeps its etcd data between sessions), nor theirs here.
    bed = Testbed(default_state_dir() / "demo")
    if bed.root.exists():
        # Every run starts from an empty cluster and store: a run stopped half-way (Ctrl-C, a
        # failure) left its TrainingJob in etcd and its checkpoints in S3, and the next run then
        # failed to create the job (409 AlreadyExists) or would have resumed the old run.
        bed.down()
        shutil.rmtree(bed.root)
    say(f"starting the testbed with {TOPOLOGY.relative_to(REPO)} (32 KWOK GPU nodes, H100 and A100 pools)")
    workdir = bed.root / "run"
    workdir.mkdir(parents=True, exist_ok=True)
    if args.keep:
        bed.up(topology=TOPOLOGY)
        demo = Demo(bed, workdir)
        demo.run(bed.s3.create_bucket("demo"))
        say(f"left running: KUBECONFIG={bed.kubeconfig}; "
            f"`{STATE_DIR_ENV}={bed.root} python -m testbed down` stops it")
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
