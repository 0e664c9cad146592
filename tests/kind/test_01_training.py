"""A 3D-parallel job on real kubelets: the trainer image in pods on several
workers, rendezvous through the headless Service's DNS name over the pod
network, asynchronous checkpoints to the in-cluster S3 server, Succeeded."""

from __future__ import annotations

from pathlib import Path

from topotrain.checkpoints import CheckpointStore, job_prefix
from topotrain.contract import MASTER_ADDR
from topotrain.core.manifests import INDEX_LABEL

from testbed.kube import Kube
from tests.kind.conftest import KindEnv, S3Access, wait_for
from tests.kind.jobs import (
    INTERVAL,
    REFERENCE,
    STEPS,
    losses,
    nodes_of,
    of_kind,
    running_job,
)


def test_3d_job_trains_across_workers_and_succeeds(
    kube: Kube, kind_env: KindEnv, s3_access: S3Access, bucket: str, tmp_path: Path
) -> None:
    with running_job(kube, kind_env, bucket, tmp_path, "train3d") as job:
        job.wait_phase("Succeeded")
        pods = job.seen_pods(attempt=0)
        assert len(pods) == 4, [p["metadata"]["name"] for p in pods]
        # 8 GPUs of 4-GPU workers: the gang spans at least two real nodes
        assert len(nodes_of(pods)) >= 2, nodes_of(pods)
        # the rendezvous address is the Service DNS name the operator set, not an IP
        pod0 = next(p for p in pods if p["metadata"]["labels"][INDEX_LABEL] == "0")
        env = {e["name"]: e.get("value", "") for e in pod0["spec"]["containers"][0]["env"]}
        spec0 = pod0["spec"]
        assert env[MASTER_ADDR] == f"{spec0['hostname']}.{spec0['subdomain']}.{kind_env.namespace}.svc"
        events = job.events()[0]
        assert max(losses(events)) == STEPS
        assert of_kind(events, "done"), events[-3:]
        committed = sorted(int(e["step"]) for e in of_kind(events, "checkpoint_committed"))
        assert committed and committed[-1] == STEPS - STEPS % INTERVAL, committed

        store = CheckpointStore(
            job_prefix(f"s3://{bucket}/jobs", kind_env.namespace, job.name),
            s3_access.endpoint, s3_access.access_key, s3_access.secret_key,
        )  # fmt: skip
        latest = store.latest_committed()
        assert latest is not None and latest.step == committed[-1]
        # the operator read the same newest committed step (it polls the store)
        wait_for(lambda: job.status().get("checkpoint", {}).get("step") == latest.step, 60,
                 f"status.checkpoint.step == {latest.step}")  # fmt: skip
        REFERENCE.update(losses(events))

