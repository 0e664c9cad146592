"""A TCP relay of ours on loopback in front of the API server, that a test can cut.

The client (an operator under test) gets a kubeconfig naming the relay's port; TLS passes
through untouched (the relay is blind to it). `cut()` closes every connection through the
relay at once and refuses new ones until `restore()`: the client's watches are away, and
what happens meanwhile reaches it only through whatever it does on reconnecting (a watch
resumed from its resourceVersion, or a new LIST after "410 Gone"). Nothing reaches the API
server that the client did not send.

Two options for the chaos soak, which puts one relay in front of each operator replica:
`source` binds the relay's side of every connection to a loopback address of its own (the
API server's audit log then names the replica by its source IP), and `delay` (settable at
any time) holds every chunk that much before forwarding it, both ways: the replica's Lease
renewals and watch streams arrive late.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from pathlib import Path


class TcpProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1", source: str | None = None) -> None:
        self.host, self.upstream_port, self.source = host, upstream_port, source
        self.delay = 0.0  # seconds each chunk is held before it is forwarded
        self.port = 0
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._mutex = threading.Lock()

    def start(self) -> TcpProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="tcpproxy").start()
        return self

    def cut(self) -> None:
        """Close the listener and every relayed connection (new connections are refused)."""
        with self._mutex:
            listener, self._listener = self._listener, None
            sockets, self._open = self._open, set()
        for sock in [s for s in (listener,) if s is not None] + list(sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restore(self) -> None:
        """Listen again on the same port."""
        self.start()

    stop = cut

    def kubeconfig(self, original: Path, out: Path) -> Path:
        """A copy of `original` whose server is this relay."""
        text = re.sub(r"(server:\s*https?://[^:/\s]+:)\d+", rf"\g<1>{self.port}", original.read_text())
        out.write_text(text)
        return out

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # cut
                return
            try:
                upstream = socket.create_connection((self.host, self.upstream_port), timeout=5,
                                                    source_address=(self.source, 0) if self.source else None)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._mutex:
                if self._listener is not listener:  # cut meanwhile
                    client.close()
                    upstream.close()
                    return
                self._open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with self._mutex:
                self._open.discard(sock)
