"""A node deleted while the operator's watch was away (issue 37 item 4), on the real testbed.

The operator talks to the API server through a TCP relay of ours (testbed/tcpproxy.py) that
the test cuts: every connection closed, new ones refused. While it is cut, a free node is
deleted and the API server is restarted, so that when the relay opens again the operator's
node watch, resumed from its resourceVersion, is answered "410 Gone" by the real API server
and kopf LISTs the nodes again. That LIST adds what it finds and removes nothing: the deleted
node stayed in the operator's index and fleet, Ready with all its GPUs free, and a new gang was
pinned to it (and waited out schedulingTimeoutSeconds). Now the resync, brought forward by the
re-list (the periodic one is set 600 s apart here), finds it missing from two metadata-only
LISTs and prunes it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from operator_support import Cluster, OperatorProcess, install_crd, wait_for
from topotrain.controller.process import STARTUP_SECONDS

from testbed.kube import Kube
from testbed.nodes import delete_node
from testbed.tcpproxy import TcpProxy

pytestmark = pytest.mark.integration
RESYNC_DONE = "resync done: the pod and node indexes compared"
GHOST_LINE = re.compile(r"node\(s\) two LISTs do not .*: leaving them out from now on: (.*)")


def ghost_nodes_logged(log: Path) -> set[str]:
    text = log.read_text(errors="replace") if log.exists() else ""
    return {name.strip() for m in GHOST_LINE.finditer(text) for name in m.group(1).split(",")}


def test_a_node_deleted_while_the_watch_was_away_leaves_the_fleet_and_no_gang_is_pinned_to_it(
        kube: Kube, namespace: str, tmp_path: Path) -> None:
    testbed = kube.require_testbed("it cuts the operator's connection and restarts the API server")
    install_crd(kube)
    server = re.search(r"server:\s*https?://[^:/\s]+:(\d+)", kube.kubeconfig.read_text())
    assert server is not None, f"no server port in {kube.kubeconfig}"
    proxy = TcpProxy(int(server.group(1))).start()
    operator = OperatorProcess(proxy.kubeconfig(kube.kubeconfig, tmp_path / "kubeconfig"), namespace,
                               tmp_path / "operator.log", env={"TOPOTRAIN_RESYNC_SECONDS": "600"})
    cluster = Cluster(kube, namespace, operator.start())
    try:
        nodes = cluster.add_nodes(racks=1, per_rack=2)
        cluster.apply(cluster.manifest("first", tensor=8, pipeline=1, data=1))
        busy = wait_for("first Running", lambda: cluster.running_gang("first", 0, 1))[0].spec.node_name
        (free,) = set(nodes) - {busy}
        # Past the start-up LISTs (process.py STARTUP_SECONDS) and the first periodic resync, seen
        # in the operator's log (not a sleep: a loaded machine starts the operator late): the next
        # periodic one is 600 s away, so only the re-list can bring it within this test.
        wait_for("the operator's first resync", lambda: RESYNC_DONE in operator.log.read_text(errors="replace"),
                 timeout=STARTUP_SECONDS + 180)

        proxy.cut()  # the operator's watches are away from here
        delete_node(kube.kubeconfig, free)
        wait_for(f"{free} deleted", lambda: free not in {n.metadata.name for n in kube.core.list_node().items})
        testbed.process("kube-apiserver").stop()  # its watch cache starts after the deletion: a resumed watch is "410 Gone"
        testbed.start_again("kube-apiserver")
        cut_at = time.monotonic()
        proxy.restore()

        # Within the resync the re-list brought forward (5 s after it; the interval is 600 s).
        wait_for(f"the operator to leave the ghost {free} out", lambda: free in ghost_nodes_logged(operator.log),
                 timeout=120)
        assert "a watch LISTed again" in operator.log.read_text(errors="replace")
        print(f"ghost node pruned {time.monotonic() - cut_at:.1f}s after the operator reconnected")

        # A new gang has no free node now (first holds the only one): it waits, pinned nowhere.
        cluster.apply(cluster.manifest("second", tensor=8, pipeline=1, data=1))
        waiting = wait_for("second unschedulable", lambda: (c := cluster.condition("second", "Schedulable"))
                           and c["status"] == "False" and c)
        assert waiting["reason"] == "InsufficientCapacity", waiting
        assert not cluster.pods("second"), [p.metadata.annotations for p in cluster.pods("second")]

        (late,) = cluster.add_nodes(racks=1, per_rack=1, prefix="late")
        gang = wait_for("second Running", lambda: cluster.running_gang("second", 0, 1))
        assert gang[0].spec.node_name == late
        assert cluster.status("second").get("restarts", 0) == 0, cluster.status("second")
    finally:
        print(f"--- TrainingJobs at the end ---\n{cluster.jobs_summary()}")
        operator.stop()
        proxy.stop()
        cluster.cleanup()
        print(f"--- operator log ({operator.log}) ---\n{operator.tail(80)}")
