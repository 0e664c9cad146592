"""topotrain.controller.health: /healthz answered by its own thread from the event loop's heartbeat."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
from topotrain.controller.health import HealthServer, LoopHealth
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
