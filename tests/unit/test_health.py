"""topotrain.controller.health: /healthz answered by its own thread from the event loop's heartbeat."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
from topotrain.controller.health import HealthServer, LoopHealth, PassWatch
from topotrain.controller.settings import Settings, SettingsError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def get(port: int, path: str = "/healthz") -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        body = err.read()
        return err.code, json.loads(body) if body.startswith(b"{") else {}


def test_a_stalled_loop_fails_the_probe_with_a_message_and_a_beat_heals_it() -> None:
    clock = Clock()
    health = LoopHealth(stall_seconds=60, clock=clock)
    server = HealthServer(health, 0, host="127.0.0.1").start()
    try:
        clock.now += 59
        assert get(server.port) == (200, {"alive": True, "loopHeartbeatAgeSeconds": 59.0})
        clock.now += 2
        code, body = get(server.port)
        assert code == 503 and body["alive"] is False
        assert "has not run for 61 s (limit 60 s)" in str(body["message"])
        health.beat()
        assert get(server.port)[0] == 200
        assert get(server.port, "/metrics")[0] == 404
    finally:
        server.stop()


def test_the_probe_is_answered_while_the_event_loop_is_busy() -> None:
    """The loop is held inside a blocking call until the probe has been answered: a probe
    served by the loop (kopf's) could never answer, and this test would time out."""
    health = LoopHealth(stall_seconds=60)
    server = HealthServer(health, 0, host="127.0.0.1").start()
    answered: list[int] = []
    done = threading.Event()

    def probe() -> None:
        answered.append(get(server.port)[0])
        done.set()

    async def busy_loop() -> None:
        beating = asyncio.create_task(health.run(period=0.01))
        await asyncio.sleep(0.05)  # a few beats
        threading.Thread(target=probe, daemon=True).start()
        assert done.wait(30), "no answer while the loop was blocked"  # blocks the loop
        beating.cancel()

    try:
        asyncio.run(busy_loop())
    finally:
        server.stop()
    assert answered == [200]


def test_stall_limit_setting_is_checked() -> None:
    assert Settings.from_env({}).liveness_stall_seconds == 60
    assert Settings.from_env({"TOPOTRAIN_LIVENESS_STALL_SECONDS": "90"}).liveness_stall_seconds == 90
    with pytest.raises(SettingsError, match="TOPOTRAIN_LIVENESS_STALL_SECONDS=0: must be > 0"):
        Settings.from_env({"TOPOTRAIN_LIVENESS_STALL_SECONDS": "0"})


def test_passes_that_stop_completing_fail_the_probe_while_the_loop_still_ticks() -> None:
    """Every job's pass stuck in worker threads (API or store calls that never end) while the
    event loop runs on: the probe fails once no pass has completed for pass_stall_seconds, but
    only while jobs exist, and a completed pass heals it."""
    clock = Clock()
    passes = PassWatch(clock=clock)
    health = LoopHealth(stall_seconds=60, clock=clock, passes=passes, pass_stall_seconds=300)
    server = HealthServer(health, 0, host="127.0.0.1").start()
    try:
        clock.now += 1000  # no job yet: nothing to judge passes by
        health.beat()
        assert get(server.port)[0] == 200
        passes.loop_started()
        passes.loop_started()
        clock.now += 299
        health.beat()  # the event loop ticks all along
        code, body = get(server.port)
        assert code == 200 and body["jobs"] == 2 and body["lastPassAgeSeconds"] == 299.0
        clock.now += 2
        health.beat()
        code, body = get(server.port)
        assert code == 503 and body["alive"] is False
        assert "no job's reconcile pass has completed for 301 s while 2 jobs exist" in str(body["message"])
        passes.pass_done()
        assert get(server.port)[0] == 200
        passes.loop_ended()
        passes.loop_ended()
        clock.now += 1000
        health.beat()
        assert get(server.port)[0] == 200  # the jobs are gone
    finally:
        server.stop()


def test_the_pass_watchdog_setting() -> None:
    assert Settings.from_env({}).pass_stall_seconds == 300
    assert Settings.from_env({"TOPOTRAIN_PASS_STALL_SECONDS": "90"}).pass_stall_seconds == 90
    with pytest.raises(SettingsError, match="TOPOTRAIN_PASS_STALL_SECONDS"):
        Settings.from_env({"TOPOTRAIN_PASS_STALL_SECONDS": "0"})
