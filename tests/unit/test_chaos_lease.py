"""Invariant 11 (testbed.chaos.checkers_lease) on hand-written audit records: a pod write the
API server accepted from a replica that was not the Lease's holder is a violation; and the
pieces that make the record (the audit event's fields, each replica's own source address, a
relay that delays)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from testbed.chaos import audit
from testbed.chaos.checkers_lease import check_fenced_pod_writes
from testbed.tcpproxy import TcpProxy

T0 = 1_000_000.0
A, B = "operator-1000", "operator-999"
REPLICAS = [{"number": 1000, "identity": A, "address": "127.0.10.1", "lease": "tt"},
            {"number": 999, "identity": B, "address": "127.0.10.2", "lease": "tt"}]  # fmt: skip


def lease(t: float, holder: str, source: str, code: int = 200, name: str = "tt") -> dict[str, Any]:
    return {"received": t - 0.01, "done": t, "verb": "update", "resource": "leases", "name": name,
            "code": code, "source": source, "holder": holder}  # fmt: skip


def pod(t: float, verb: str, source: str, code: int = 201, name: str = "p-0") -> dict[str, Any]:
    return {"received": t, "done": t + 0.01, "verb": verb, "resource": "pods", "name": name,
            "code": code, "source": source, "holder": None}  # fmt: skip


def takeover() -> list[dict[str, Any]]:
    """A holds the Lease from T0; B takes it at T0 + 30 (A stopped renewing at T0 + 10)."""
    return [lease(T0, A, "127.0.10.1"), lease(T0 + 10, A, "127.0.10.1"), lease(T0 + 30, B, "127.0.10.2"),
            pod(T0 + 5, "create", "127.0.10.1"), pod(T0 + 31, "delete", "127.0.10.2")]  # fmt: skip


def test_pod_writes_by_the_holder_pass() -> None:
    verdict = check_fenced_pod_writes(REPLICAS, takeover())
    assert verdict.ok and verdict.checked == 2


def test_a_pod_write_by_the_replica_that_lost_the_lease_is_a_violation() -> None:
    events = [*takeover(), pod(T0 + 32, "delete", "127.0.10.1", code=200, name="p-1")]
    verdict = check_fenced_pod_writes(REPLICAS, events)
    assert not verdict.ok
    assert verdict.details == (f"t={T0 + 32:.3f}: {A} deleted pod p-1 while the Lease's holder was {B}",)


def test_a_write_before_any_holder_or_by_a_replica_whose_take_failed_is_a_violation() -> None:
    early = [pod(T0 - 1, "create", "127.0.10.1"), *takeover()]
    assert "holder was nobody" in check_fenced_pod_writes(REPLICAS, early).details[0]
    # B's take refused (409): A is still the holder, and B's create is not fenced.
    refused = [lease(T0, A, "127.0.10.1"), lease(T0 + 30, B, "127.0.10.2", code=409),
               pod(T0 + 31, "create", "127.0.10.2")]  # fmt: skip
    assert f"{B} created pod p-0 while the Lease's holder was {A}" in check_fenced_pod_writes(REPLICAS, refused).details[0]


def test_refused_pod_writes_and_other_writers_do_not_count() -> None:
    events = [*takeover(), pod(T0 + 32, "delete", "127.0.10.1", code=409),  # the fence's CAS refused
              pod(T0 + 33, "delete", "127.0.0.1")]  # the soak itself, or the garbage collector
    verdict = check_fenced_pod_writes(REPLICAS, events)
    assert verdict.ok and verdict.checked == 2


def test_without_lease_writes_nothing_is_judged() -> None:
    verdict = check_fenced_pod_writes(REPLICAS, [pod(T0, "create", "127.0.10.1")])
    assert verdict.ok and verdict.checked == 0 and "not judged" in verdict.notes[0]
    other = [lease(T0, A, "127.0.10.1", name="someone-elses"), pod(T0 + 1, "create", "127.0.10.1")]
    assert check_fenced_pod_writes(REPLICAS, other).checked == 0


def test_an_audit_event_gives_its_source_holder_and_times() -> None:
    event = {"stage": "ResponseComplete", "verb": "update", "sourceIPs": ["127.0.10.2"],
             "user": {"username": "system:serviceaccount:ns:topotrain"},
             "objectRef": {"resource": "leases", "namespace": "ns", "name": "tt", "apiGroup": "coordination.k8s.io"},
             "responseStatus": {"code": 200}, "requestObject": {"spec": {"holderIdentity": B}},
             "requestReceivedTimestamp": "2026-12-06T04:00:00.250000Z",
             "stageTimestamp": "2026-12-06T04:00:00.500000Z"}  # fmt: skip
    record = audit.event_record(event)
    assert record is not None and (record["holder"], record["source"], record["code"]) == (B, "127.0.10.2", 200)
    assert record["done"] - record["received"] == 0.25
    created = {**event, "verb": "create", "objectRef": {"resource": "pods", "namespace": "ns"},
               "requestObject": {"metadata": {"name": "p-3"}}}  # fmt: skip
    assert audit.event_record(created)["name"] == "p-3"  # type: ignore[index]
    assert audit.event_record({**event, "objectRef": {"resource": "pods", "subresource": "status"}}) is None
    assert "namespaces: [ns]" in audit.policy("ns")


def test_each_replica_has_its_own_loopback_address() -> None:
    addresses = {audit.replica_address(n) for n in range(1000, 400, -1)}
    assert len(addresses) == 600 and audit.replica_address(1000) == "127.0.10.1"
    assert all(a.startswith("127.") for a in addresses)


def test_the_relay_connects_from_its_source_address_and_delays_each_chunk() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[str] = []

    def echo() -> None:
        conn, peer = server.accept()
        seen.append(peer[0])
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    relay = TcpProxy(server.getsockname()[1], source="127.0.10.7").start()
    try:
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as client:
            client.sendall(b"fast")
            assert client.recv(16) == b"fast"
            relay.delay = 0.2
            started = time.monotonic()
            client.sendall(b"slow")
            assert client.recv(16) == b"slow"
            assert time.monotonic() - started >= 0.4  # held both ways
        assert seen == ["127.0.10.7"]
    finally:
        relay.cut()
        server.close()
