"""A checkpoint endpoint that never finishes answering: a tarpit HTTP server on loopback.

Every request (any method) gets a 200 with a long Content-Length and then one byte every
`interval` seconds, so a client whose timeout is per socket read (botocore's) never times
out. Used by the unit tests of the store pool, the isolation benchmark and the chaos soak
(`checkpoint-tarpit`). `stop()` ends every trickle at once (the reads stuck on it fail and
free their threads) and closes the server. `requests` counts the requests it took (one per
connection), `trickling` those still trickling, `most_trickling` the most at once: what a
benchmark prints as evidence that the reads really reach it.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Tarpit:
    def __init__(self, interval: float = 0.5, host: str = "127.0.0.1") -> None:
        stop = self._stop = threading.Event()
        self.requests = self.trickling = self.most_trickling = 0
        self._counts = threading.Lock()
        pit = self

        class Trickle(BaseHTTPRequestHandler):
            def _trickle(self) -> None:
                pit._count(+1)
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    while not stop.wait(interval):
                        try:
                            self.wfile.write(b" ")
                            self.wfile.flush()
                        except OSError:
                            return
                finally:
                    pit._count(-1)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _trickle

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, 0), Trickle)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"

    def _count(self, change: int) -> None:
        with self._counts:
            self.requests += max(change, 0)
            self.trickling += change
            self.most_trickling = max(self.most_trickling, self.trickling)

    def start(self) -> Tarpit:
        threading.Thread(target=self._server.serve_forever, daemon=True, name="tarpit").start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Tarpit:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
