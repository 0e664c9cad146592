"""The operator's liveness endpoint, answered by a thread of its own.

kopf's own liveness endpoint is served by the event loop that also handles every watch
event, so on a busy fleet (5,000 nodes, 200 jobs; docs/testbed.md) a probe could wait
seconds behind a burst of events although the operator was making progress, and the kubelet
counts a slow answer as a failure. Here the event loop only ticks a heartbeat
(`LoopHealth.run`, every second); `/healthz` is answered by an HTTP server thread from that
heartbeat's age: 200 while the loop has ticked within `stall_seconds`, 503 naming the stall
otherwise. A loop that is stuck (a blocking call, a deadlock) still fails the probe, and the
kubelet restarts the operator; a loop that is merely busy does not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0
DEFAULT_STALL_SECONDS = 60.0


class LoopHealth:
    """The event loop's heartbeat and the verdict on it."""

    def __init__(self, stall_seconds: float = DEFAULT_STALL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.stall_seconds = stall_seconds
        self.clock = clock
        self.last_beat = clock()

    def beat(self) -> None:
        self.last_beat = self.clock()

    def verdict(self) -> tuple[bool, dict[str, object]]:
        """(alive, the body /healthz answers with)."""
        age = max(0.0, self.clock() - self.last_beat)
        alive = age < self.stall_seconds
        body: dict[str, object] = {"alive": alive, "loopHeartbeatAgeSeconds": round(age, 3)}
        if not alive:
            body["message"] = (f"the operator's event loop has not run for {age:.0f} s "
                               f"(limit {self.stall_seconds:.0f} s)")  # fmt: skip
        return alive, body

    async def run(self, period: float = HEARTBEAT_SECONDS) -> None:
        """Tick until cancelled (a task on the operator's event loop)."""
        while True:
            self.beat()
            await asyncio.sleep(period)


class HealthServer:
    """`/healthz` on `port` (0: any free one, see `.port`) in a daemon thread."""

    def __init__(self, health: LoopHealth, port: int, host: str = "0.0.0.0") -> None:
        outer = health

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/healthz":
                    self.send_error(404, "only /healthz is served here")
                    return
                alive, body = outer.verdict()
                data = json.dumps(body).encode()
                self.send_response(200 if alive else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                if not alive:
                    log.error("liveness: %s", body["message"])

            def log_message(self, format: str, *args: object) -> None:
                pass  # a probe every few seconds is not worth a log line

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, name="topotrain-healthz",
                                        daemon=True)  # fmt: skip

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
