"""A loopback TCP forwarder that a test can cut (bytes stop moving, like a partition) and heal; no root needed."""

from __future__ import annotations

import contextlib
import select
import socket
import threading

_POLL_S = 0.05
_BUF = 1 << 16


class Partition:
    """Listen on 127.0.0.1:`port` (0: a free one) and forward to `target`; `cut()` stalls every connection and
    leaves new ones unanswered until `heal()`. Always `close()` it."""

    def __init__(self, target: tuple[str, int], port: int = 0) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port = self._listener.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._sent = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="partition-accept")]
        self._threads[0].start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def sent(self) -> int:
        """Bytes forwarded from the clients to the target so far."""
        with self._lock:
            return self._sent

    def held(self) -> int:
        """Bytes that wait, unread, in the cut: the most on one side of one connection (up to 64 KiB); a call sent
        into the outage, or its answer, shows here."""
        most = 0
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                most = max(most, len(s.recv(_BUF, socket.MSG_PEEK | socket.MSG_DONTWAIT)))
        return most

    def _accept(self) -> None:
        self._listener.settimeout(_POLL_S)
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            t = threading.Thread(target=self._pump, args=(client, upstream), daemon=True, name="partition-pump")
            t.start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._closed.is_set():
                if not self._open.wait(_POLL_S):
                    continue  # cut: nothing moves either way; the kernel buffers fill and TCP backs off
                ready, _, _ = select.select([a, b], [], [], _POLL_S)
                for s in ready:
                    data = s.recv(_BUF)
                    if not data:
                        return
                    peers[s].sendall(data)
                    if s is a:
                        with self._lock:
                            self._sent += len(data)
        except OSError:
            return
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()
        for t in self._threads:
            t.join(timeout=5)
