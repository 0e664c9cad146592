"""The pod process harness (the testbed's stand-in for a kubelet's process execution) starting a
pod whose environment names a Secret while the API server is away: it tries again on the next
pass, as a kubelet does, instead of leaving the pod Running with no process. The API server is
faked at this unit boundary (the snapshot and the Secret reader)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from testbed.harness import PodProcessHarness, _Snapshot


def _pod(uid: str) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "namespace": "ns", "name": f"job-2-{uid}",
                     "labels": {"topotrain.io/job": "job", "topotrain.io/attempt": "2"}},
        "spec": {"nodeName": "node-a", "containers": [{
            "name": "trainer", "command": [sys.executable, "-c", "import time; time.sleep(30)"],
            "env": [{"name": "S3_KEY", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "key"}}}],
        }]},
        "status": {"phase": "Running"},
    }  # fmt: skip


def test_a_pod_whose_secret_read_failed_is_started_on_a_later_pass(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    harness = PodProcessHarness(tmp_path / "kubeconfig", tmp_path, hold_terminating=False)
    pods = {"u1": _pod("u1"), "u2": _pod("u2")}
    monkeypatch.setattr(harness, "_snapshot", lambda: _Snapshot(pods, {"node-a"}))
    api_up = False

    def read(kind: str, namespace: str, name: str) -> dict[str, str] | None:
        if not api_up:
            raise ConnectionRefusedError("the API server is restarting")
        return {"key": "secret"}

    monkeypatch.setattr(harness, "_read_object", read)
    try:
        with pytest.raises(ConnectionRefusedError):
            harness.sync_once()  # the pass fails (the loop logs it and passes again)
        assert harness.running() == []
        api_up = True
        harness.sync_once()
        started = sorted(r.uid for r in harness.running())
        assert started == ["u1", "u2"], "a pod the failed pass tried was never started"
        harness.sync_once()  # and each is started once
        assert len(harness.launches) == 2
    finally:
        harness.stop()
