"""Network faults for tests. :class:`SilentServer`: a hung daemon (accepts, never answers).
:class:`SlowLink`: a real slow network link, a TCP forwarder on loopback that delivers every
byte from the server to the client ``delay_s`` after it arrived (a fixed one-way latency, like
netem's ``delay``) and, with ``rate_bps``, at most that many bytes per second on each
connection (like a token bucket filter: the bytes wait in the forwarder). The client side sees
a round trip of at least ``delay_s`` for every request, including the connection's HELLO."""

from __future__ import annotations

import socket
import threading
import time
from collections import deque

_PACE_BYTES = 4096  # a rate-limited link sends this much, then waits its time on the wire


class _Listener:
    """A loopback listener whose accept thread hands each connection to ``_serve``; ``close``
    ends it and every socket kept in ``_socks``."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                continue
            self._serve(client)

    def _serve(self, client: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for s in self._socks:
            _shut(s)
            s.close()


class SilentServer(_Listener):
    """Accepts connections and never answers (a hung daemon)."""

    def _serve(self, client: socket.socket) -> None:
        self._socks.append(client)


class SlowLink(_Listener):
    def __init__(self, target: str, delay_s: float, rate_bps: float = 0.0) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.delay_s = delay_s
        self.rate_bps = rate_bps  # 0: bandwidth not limited
        super().__init__()  # the accept thread starts: the fields above are set

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.target, timeout=5)
        except OSError:  # the target is gone (a test killed it): the client sees a close
            client.close()
            return
        server.settimeout(None)
        client.settimeout(None)
        self._socks += [client, server]
        threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
        threading.Thread(target=self._delayed, args=(server, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _shut(dst)

    def _delayed(self, src: socket.socket, dst: socket.socket) -> None:
        line: deque[tuple[float, bytes]] = deque()
        cond = threading.Condition()
        closed = []

        def send() -> None:
            try:
                while True:
                    with cond:
                        while not line and not closed:
                            cond.wait()
                        if not line:
                            break
                        due, data = line.popleft()
                    wait = due - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    if not self.rate_bps:
                        dst.sendall(data)
                        continue
                    for i in range(0, len(data), _PACE_BYTES):  # the chunk at the link's rate
                        piece = data[i : i + _PACE_BYTES]
                        dst.sendall(piece)
                        time.sleep(len(piece) / self.rate_bps)
            except OSError:
                pass
            finally:
                _shut(dst)

        threading.Thread(target=send, daemon=True).start()
        try:
            while data := src.recv(1 << 20):
                with cond:
                    line.append((time.monotonic() + self.delay_s, data))
                    cond.notify()
        except OSError:
            pass
        with cond:
            closed.append(True)
            cond.notify()


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
