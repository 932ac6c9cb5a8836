"""Syscall loops of :class:`rdma.channel.SocketChannel`'s transfers.

``send_slices`` and ``recv_landing`` are the bodies an offloaded transfer runs in a worker
thread. One send mechanism serves both ends: the daemon (its workers shared by every peer) and
the client (a worker per connection) make their sockets blocking with ``SO_SNDTIMEO`` (a
slice), so the kernel waits for room inside ``sendmsg``; a non-blocking socket (no slice) makes
the same loop return at the first full buffer. The send experiment (docs/benchmarks.md) measured why the kernel's
wait: 1.02-1.05x a plain blocking send's sender CPU per GB, where returning at each full buffer
and waiting for room with ``poll`` (the client's sends before) cost 1.46-1.52x. Every call the
event loop makes on such a socket passes ``MSG_DONTWAIT``. A hand-off ends at the first slice
that waited (a short or timed-out ``sendmsg``): a slow or stalled reader holds a worker about one
slice per hand-off, the rest of its wait is on the loop under the transfer deadline.

``recv_landing`` copies until done or EAGAIN (``MSG_DONTWAIT`` always); it may wait a bounded
slice (``wait_s``) where its owner gave each connection a worker of its own (the client), so a
batch is received by one hand-off to one thread, not one per block. ``advance`` is the
``sendmsg`` bookkeeping both the loop and the workers use.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

IOV_MAX = 512  # below the kernel's IOV_MAX (1024) with room to spare
_RECV_SPAN = 8 << 20  # bytes of views one receive offers: more than a socket's buffer holds


def send_slices(sock: socket.socket, views: list[memoryview], i: int, budget_s: float) -> tuple[int, int]:
    """Worker-thread body of an offloaded send on a blocking socket whose ``SO_SNDTIMEO`` is
    set: the kernel waits for room inside ``sendmsg`` (no return, poll and re-entry at each
    full buffer: docs/benchmarks.md, the one-off experiments); on a non-blocking socket it returns at the first full
    buffer. It returns after the first call that waited its slice out (short, or no room at
    all: a slow or stalled reader; Linux bounds one call's waits, summed, by ``SO_SNDTIMEO``),
    and, for a reader that keeps up, once ``budget_s`` has passed (its send goes back to the
    pool's queue behind the others'). A worker is held about one slice per hand-off for a slow
    reader, the copying time of what it took besides. Returns (index of the first view not
    yet sent, bytes sent)."""
    total = 0
    until = time.monotonic() + budget_s
    while i < len(views) and (not total or time.monotonic() < until):
        asked = sum(v.nbytes for v in views[i : i + IOV_MAX])
        try:
            n = sock.sendmsg(views[i : i + IOV_MAX])
        except (BlockingIOError, InterruptedError, TimeoutError):
            break  # a slice with no room: the owner waits on its loop, with its deadline
        except OSError as exc:
            raise ConnectionError(f"send failed: {exc}") from exc
        total += n
        i = advance(views, i, n)
        if n < asked:
            break  # a short send: its slice ran out waiting for a slow reader; the rest waits on the loop
    return i, total


def advance(views: list[memoryview], i: int, n: int) -> int:
    """After ``sendmsg(views[i:])`` sent ``n`` bytes: drop the views sent whole, trim a part-
    sent one in place; returns the index of the first view not yet sent."""
    while n:
        if n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


class Landing:
    """Where a receive into several views stands: it fills ``views`` in order, each exactly.

    ``hasher`` (a factory such as ``kvstore.block.payload_hasher``): each view's digest is computed as its
    bytes land (each received run hashed at once, while it is still in this core's cache), and
    ``digests[i]`` is set when view ``i`` is full. ``then``: called on the last view once it is
    full, by the thread that received its last bytes; its result is ``result``. Owned by one
    receive at a time: a worker thread or the event loop advances it, never both at once."""

    def __init__(self, views: list[memoryview], hasher: Callable[[], Any] | None = None, then=None) -> None:
        self.views = views
        self.total = sum(v.nbytes for v in views)
        self.i = 0  # the view being filled
        self.pos = 0  # bytes of it already there
        self.digests: list[int | None] = [None] * len(views)
        self.result: Any = None
        self._hasher = hasher
        self._then = then
        self._h = hasher() if hasher is not None and views else None
        # views handed to one recvmsg_into: enough for what a socket can hold, not IOV_MAX
        # (each costs the call a buffer export: 512 views made a 64 KiB receive ~3x slower)
        self.per_call = max(1, min(IOV_MAX, _RECV_SPAN * len(views) // max(1, self.total)))

    @property
    def done(self) -> bool:
        return self.i >= len(self.views)

    def _landed(self, n: int) -> None:
        """``n`` bytes arrived at ``views[i][pos:]`` and on, in order: hash them, move on."""
        views = self.views
        while n:
            v = views[self.i]
            step = min(n, v.nbytes - self.pos)
            if self._h is not None:
                self._h.update(v[self.pos : self.pos + step])
            self.pos += step
            n -= step
            self._skip_full()

    def _skip_full(self) -> None:
        views = self.views
        while self.i < len(views) and self.pos == views[self.i].nbytes:
            if self._h is not None:
                self.digests[self.i] = self._h.intdigest()
                self._h = self._hasher() if self.i + 1 < len(views) else None
            if self.i + 1 == len(views) and self._then is not None:
                self.result = self._then(views[self.i])
            self.i += 1
            self.pos = 0


def recv_landing(sock: socket.socket, land: Landing, wait_s: float = 0.0) -> int:
    """Receive into ``land`` until it is full; returns the bytes received by this call.

    ``recvmsg_into`` fills up to ``land.per_call`` views per syscall. When the socket has
    nothing, ``wait_s == 0`` returns at once (``MSG_DONTWAIT``: a daemon's worker never waits
    for a peer); otherwise it waits for input for at most ``wait_s`` at a time and returns when
    none came (the caller, on the event loop, then waits with its deadline).

    On a blocking socket (the client's, made so for its sends) the kernel does that wait inside
    ``recvmsg``, as ``send_slices`` does for sends: ``SO_RCVTIMEO`` = ``wait_s`` bounds it, and
    no EAGAIN and ``poll`` per wait (the receive experiment, docs/benchmarks.md). A call that times out returns what
    it has. No ``SO_RCVLOWAT``: waiting for runs of 1 MiB cut the client's receive CPU per GB
    of bulk fetches (256 KiB blocks: 1.2x the raw client's with it, 1.6x without) but stalled
    receives, some for the whole slice (0.2 s): a one-block 2 MiB GET 4-5x slower
    (one-block GETs of the former bench/store_throughput.py), and 1 in 3 remote loads of bench/ttft.py's 8,000 tokens
    ~190 ms longer, also with the runs waited for only after a landing's first 2 MiB.
    ConnectionError on EOF or reset (a socket shut down by a cancelled receive included)."""
    land._skip_full()  # empty views
    got = 0
    poller = None
    blocking = wait_s > 0 and sock.getblocking()
    if blocking:
        usec = max(int(wait_s * 1e6), 1)
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", usec // 1000000, usec % 1000000)
        )
    flags = 0 if blocking else socket.MSG_DONTWAIT
    while not land.done:
        i, views = land.i, land.views
        bufs = [views[i][land.pos :], *views[i + 1 : i + land.per_call]]
        try:
            n = sock.recvmsg_into(bufs, 0, flags)[0]
        except (BlockingIOError, InterruptedError, TimeoutError):
            if wait_s <= 0 or blocking:
                break  # nothing (within the slice, when blocking): the caller waits on its loop
            if poller is None:
                poller = select.poll()
                poller.register(sock.fileno(), select.POLLIN)
            if not poller.poll(wait_s * 1000):
                break
            continue
        except OSError as exc:
            raise ConnectionError(f"recv failed: {exc}") from exc
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {land.total} bytes")
        got += n
        land._landed(n)
    return got
