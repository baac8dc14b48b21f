"""A TCP proxy on a free loopback port that a test can cut and heal: a network link to a real
server (Redis, PostgreSQL) that goes down and comes back, without touching the server itself.

`cut()` closes every connection through the proxy and refuses new ones (each is accepted and
closed at once, as a link whose far end is gone); `heal()` forwards new connections again.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.closed = False
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.accepted = 0  # connections forwarded
        self.thread = threading.Thread(target=self._accept, name=f"tcp-proxy-{self.port}", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            with self.lock:
                self.pairs.append((client, upstream))
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while True:
                readable, _, _ = select.select([a, b], [], [], 1.0)
                if not self.up or self.closed:
                    return
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peers[sock].sendall(data)
        except OSError:
            return
        finally:
            _close(a)
            _close(b)
            with self.lock:
                if (a, b) in self.pairs:
                    self.pairs.remove((a, b))

    def cut(self) -> None:
        """Every connection through the proxy is closed; new ones are closed as they come."""
        self.up = False
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for a, b in pairs:
            _close(a)
            _close(b)

    def heal(self) -> None:
        self.up = True

    def close(self) -> None:
        self.closed = True
        self.cut()
        _close(self.listener)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
