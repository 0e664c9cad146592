"""The operator's liveness endpoint, answered by a thread of its own.

kopf's own liveness endpoint is served by the event loop that also handles every watch
event, so on a busy fleet (5,000 nodes, 200 jobs; docs/testbed.md) a probe could wait
seconds behind a burst of events although the operator was making progress, and the kubelet
counts a slow answer as a failure. Here the event loop only ticks a heartbeat
(`LoopHealth.run`, every second); `/healthz` is answered by an HTTP server thread from that
heartbeat's age: 200 while the loop has ticked within `stall_seconds`, 503 naming the stall
otherwise. A loop that is stuck (a blocking call, a deadlock) still fails the probe, and the
kubelet restarts the operator; a loop that is merely busy does not.

The loop ticking is not enough: every job's pass may be stuck in worker threads (API or S3
calls that never end) while the loop itself runs on. So the probe also fails when jobs exist
and no job's pass has completed for `pass_stall_seconds` (`PASSES`, fed by every job's loop,
which passes at least every reconcile interval).
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
DEFAULT_PASS_STALL_SECONDS = 300.0


class PassWatch:
    """How many job loops run, and when one of them last completed a pass (the event loop
    writes it, the probe's thread reads it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.loops = 0
        self.last_pass = clock()

    def loop_started(self) -> None:
        if self.loops == 0:
            self.last_pass = self.clock()  # the first job is not judged by a pass of long ago
        self.loops += 1

    def loop_ended(self) -> None:
        self.loops = max(0, self.loops - 1)

    def pass_done(self) -> None:
        self.last_pass = self.clock()


PASSES = PassWatch()  # the process's job loops (controller/loop.py feeds it)


class LoopHealth:
    """The event loop's heartbeat and the verdict on it."""

    def __init__(self, stall_seconds: float = DEFAULT_STALL_SECONDS,
                 clock: Callable[[], float] = time.monotonic, passes: PassWatch | None = None,
                 pass_stall_seconds: float = DEFAULT_PASS_STALL_SECONDS) -> None:  # fmt: skip
        self.stall_seconds = stall_seconds
        self.clock = clock
        self.last_beat = clock()
        self.passes = passes
        self.pass_stall_seconds = pass_stall_seconds

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
        passes = self.passes
        if passes is not None and passes.loops:
            since = max(0.0, self.clock() - passes.last_pass)
            body.update(jobs=passes.loops, lastPassAgeSeconds=round(since, 3))
            if since >= self.pass_stall_seconds and alive:
                alive = body["alive"] = False
                body["message"] = (f"no job's reconcile pass has completed for {since:.0f} s while "
                                   f"{passes.loops} jobs exist (limit {self.pass_stall_seconds:.0f} s): "
                                   "their calls are stuck")  # fmt: skip
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
