"""A TCP proxy a test can cut: the network between two real parts, as a fault seam.

Put it between the agent and the server ("the central service is down") or between
the server and Postgres ("Postgres restarted mid-ingest"). :meth:`TcpProxy.down`
closes the listening socket and every open connection at once, as a crashed or
restarted peer does: new connections are refused, and a transaction in flight loses
its connection. :meth:`TcpProxy.up` listens again on the same port.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``, until :meth:`down`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.connections = 0  # accepted so far, for tests that want to see traffic
        # Replies to lose: the next N answers from the target are dropped and their
        # connection cut, after the target has done the work ("response lost").
        self.lose_replies = 0
        # Pick a port once; every up() listens on it again.
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port: int = probe.getsockname()[1]
        probe.close()

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def up(self) -> None:
        if self._listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(self.address)
        listener.listen(64)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._thread.start()

    def down(self) -> None:
        """Refuse new connections and cut every open one (RST where possible)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            doomed, self._open = self._open, set()
        for sock in doomed:
            _abort(sock)

    def _take_lost_reply(self) -> bool:
        with self._lock:
            if self.lose_replies <= 0:
                return False
            self.lose_replies -= 1
            return True

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _abort(client)
                continue
            for sock in (client, upstream):
                # Forward each write as it comes: Nagle plus delayed ACKs would add
                # 40 ms to every request that arrives in two writes (head, body).
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    _abort(client)
                    _abort(upstream)
                    return
                self._open.update((client, upstream))
                self.connections += 1
            for a, b, replies in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(a, b, replies), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while data := source.recv(65536):
                if replies and self._take_lost_reply():
                    _abort(sink)
                    _abort(source)
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(source)
                self._open.discard(sink)
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def _abort(sock: socket.socket) -> None:
    """Close with a reset, as a killed process's kernel does, not an orderly FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


@contextmanager
def proxy_to(target: tuple[str, int], *, up: bool = True) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target)
    if up:
        proxy.up()
    try:
        yield proxy
    finally:
        proxy.down()
