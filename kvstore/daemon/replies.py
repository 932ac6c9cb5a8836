"""One connection's replies, sent in request order while the connection's next request is read.

The data port reads and prepares a connection's next request while the previous reply is still
being sent: built only after frame n's bytes had left, frame n+1's reply (its packed lease, the
header copies, the reply records) left the wire idle between frames (docs/benchmarks.md).
:class:`ReplyQueue` holds the replies prepared and not yet sent, and sends them in order. A
reply is first tried at once, on the reader's turn, when none is queued before it: a small reply
(or a large one's first socket buffer) leaves without a task switch. What the socket cannot
take now goes to the queue's sender task, which sends one reply after another while the reader
goes on to the next request.

Contract:

* Bounded: the reader awaits :meth:`room` before it reads a header, so at most ``depth``
  replies are queued (one being sent and ``depth - 1`` prepared); each request queues one.
* A reply owns what it sends from: ``done(sent)`` is called exactly once, when its last byte
  has left (True) or when it never will (False: a failed or closed connection). A GET's packed
  lease stays held and marked in transfer until then, so no slot is reused while its bytes move.
* Every send has a deadline: the request's (``due``, set by the reader per request: twice the
  transfer timeout from its header) and, for a reply with a payload, the transfer timeout from
  the send's start, whichever comes first; past it the timeout is counted as "request" or
  "transfer" (``tierkv_timeouts_total``) and the connection fails. A ``quiet`` reply (an error
  sent before the connection closes) has one second and is not counted.
* A reply is due to be *read* by the transfer deadline from when it was queued (or its
  request's deadline, if earlier), not only to leave: the kernel takes a reply whole into a
  send buffer the peer never reads, so "sent" says nothing. Each reply handed to the kernel
  is remembered by where its last byte lies in the connection's stream; when the first one
  not acknowledged by the peer (the socket's unsent queue, SIOCOUTQ) is past due, the
  connection fails as a "request" timeout. One ioctl per check, a check per deadline (and per
  ``_PRUNE_AT`` replies, to bound what is remembered).
* A failed send ends every queued reply (``done(False)``) and calls ``on_fail`` (the port
  cancels the connection's reader); :meth:`room` and :meth:`drain` then raise ConnectionError.
* :meth:`close` stops the sender (a copy in a worker thread is waited for first) and ends
  every reply left: no byte of theirs moves after it, even when the caller is cancelled again
  meanwhile (the cancel is absorbed until the sender has stopped, then re-raised). Event loop
  thread only.
"""

from __future__ import annotations

import asyncio
import fcntl
import math
import struct
import termios
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.daemon.logs import RateLimitedLog
from kvstore.daemon.metrics import DaemonMetrics
from rdma.channel import SocketChannel

_QUIET_S = 1.0  # an error reply before the connection closes: the peer may not be reading
_PRUNE_AT = 64  # remembered replies that make a send check what the peer has acknowledged


def unsent_bytes(sock) -> int:
    """Bytes ``sock`` has handed to the kernel that the peer has not acknowledged."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


class _Reply:
    __slots__ = ("bufs", "payload", "due", "done", "quiet", "read_bytes", "queued")

    def __init__(self, bufs, payload, due, done, quiet, read_bytes, queued) -> None:
        self.bufs: list[memoryview] = bufs  # not yet sent: the encoded header, then payload views
        self.payload: bool = payload
        self.due: float = due  # loop time
        self.done: Callable[[bool], None] | None = done
        self.quiet: bool = quiet
        self.read_bytes: int = read_bytes  # private bytes read from disk that it holds
        self.queued: float = queued  # loop time: its read deadline counts from here


class ReplyQueue:
    """The replies of one connection over ``ch``. ``transfer_timeout_s``: a payload's send
    deadline; ``active(d)`` is told +1 when the sender starts and -1 when it stops (the port's
    count of busy connections); ``on_fail`` is called once when a send fails."""

    def __init__(
        self,
        ch: SocketChannel,
        depth: int,
        transfer_timeout_s: float,
        metrics: DaemonMetrics,
        bad: RateLimitedLog,
        peer: str,
        active: Callable[[int], None],
        on_fail: Callable[[], Any],
    ) -> None:
        self.ch = ch
        self.depth = depth
        self.due = math.inf  # the current request's deadline (loop time), set by the reader
        self._transfer_s = transfer_timeout_s
        self._metrics = metrics
        self._bad = bad
        self._peer = peer
        self._active = active
        self._on_fail = on_fail
        self._loop = asyncio.get_running_loop()
        self._items: deque[_Reply] = deque()
        self._task: asyncio.Task | None = None
        self._waiters: list[asyncio.Future] = []  # room/drain: woken at each reply sent
        self._when_idle: list[Callable[[], Any]] = []
        self.failed = False
        # replies in the kernel not yet acknowledged: (their end in ch.bytes_out, due), in order
        self._unread: deque[tuple[int, float]] = deque()
        self._watch: asyncio.TimerHandle | None = None

    @property
    def pending(self) -> int:
        return len(self._items)

    @property
    def read_bytes(self) -> int:
        """Private bytes read from disk that the queued replies hold."""
        return sum(r.read_bytes for r in self._items)

    def send(
        self,
        header: dict[str, Any],
        payloads: Sequence[Any] = (),
        done: Callable[[bool], None] | None = None,
        quiet: bool = False,
        read_bytes: int = 0,
    ) -> None:
        """Queue one frame (``plen`` set from ``payloads``, sent without copying) after those
        queued; see the module docstring. ConnectionError (``done(False)`` called) when the
        connection has failed or the first try at once fails."""
        try:
            if self.failed:
                raise ConnectionError("the connection's send failed")
            bufs = self.ch.frame_views(header, payloads)
            if not self._items and not self.ch.offloads(sum(b.nbytes for b in bufs), send=True):
                i = self.ch.send_ready(bufs)
                if i == len(bufs):
                    if done is not None:
                        done(True)
                    if not quiet:
                        self._in_kernel(self._loop.time(), self.due)
                    return
                del bufs[:i]
        except BaseException:
            if done is not None:
                done(False)
            raise
        due = math.inf if quiet else self.due
        self._items.append(_Reply(bufs, bool(payloads), due, done, quiet, read_bytes, self._loop.time()))
        if self._task is None:
            self._active(1)
            self._task = self._loop.create_task(self._run())

    async def room(self) -> None:
        """Return when fewer than ``depth`` replies are queued."""
        while len(self._items) >= self.depth and not self.failed:
            await self._wake()
        if self.failed:
            raise ConnectionError("the connection's send failed")

    async def drain(self) -> None:
        """Return when every queued reply has been sent."""
        while self._items and not self.failed:
            await self._wake()
        if self.failed:
            raise ConnectionError("the connection's send failed")

    def when_idle(self, fn: Callable[[], Any]) -> None:
        """Call ``fn`` once no reply is queued: now, or when the last has been sent or ended."""
        if self._task is None:
            fn()
        else:
            self._when_idle.append(fn)

    async def close(self) -> None:
        """Stop the sender (its copy in a worker waited for) and end every reply left."""
        t = self._task
        cancelled = False
        if t is not None:
            t.cancel()
            # a second cancel of the caller (a second revoke; stop's cancel on top of its grace
            # period's) must not end this wait: the sender may still be sending from a slot
            while not t.done():
                try:
                    await asyncio.wait({t})
                except asyncio.CancelledError:
                    cancelled = True
        self._end_all()
        self._stop_watch()
        if cancelled:
            raise asyncio.CancelledError

    # ------------------------------------------------------------ the sender

    def _wake(self) -> asyncio.Future:
        fut = self._loop.create_future()
        self._waiters.append(fut)
        return fut

    def _woken(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _run(self) -> None:
        try:
            while self._items:
                r = self._items[0]
                sent = False
                try:
                    await self._send_one(r)
                    sent = True
                    if not r.quiet:
                        self._in_kernel(r.queued, r.due)
                finally:
                    self._items.popleft()
                    if r.done is not None:
                        r.done(sent)
                    self._woken()
        except (ConnectionError, OSError):
            self.failed = True
            self._end_all()
            self._woken()
            self._on_fail()
        finally:
            self._end_all()  # cancelled: the send above waited for its worker, if any
            self._task = None
            self._active(-1)
            self._woken()
            idle, self._when_idle = self._when_idle, []
            for fn in idle:
                fn()

    async def _send_one(self, r: _Reply) -> None:
        start = self._loop.time()
        when, kind = r.due, "request"
        if r.quiet:
            when, kind = start + _QUIET_S, None
        elif r.payload and start + self._transfer_s < when:
            when, kind = start + self._transfer_s, "transfer"
        try:
            async with asyncio.timeout_at(when):
                await self.ch.send_views(r.bufs)
        except TimeoutError:
            if kind is not None:
                self._metrics.timeouts.labels(kind).inc()
                self._bad.info("timeout", peer=self._peer, kind=kind)
            raise ConnectionError(f"reply send deadline passed ({kind or 'error reply'})") from None

    # ------------------------------------------------------------ read deadlines

    def _in_kernel(self, queued: float, due: float) -> None:
        """The reply queued at ``queued`` is wholly in the kernel: it must be acknowledged by
        the transfer deadline from then, or its request's ``due`` if earlier (see the module
        docstring)."""
        self._unread.append((self.ch.bytes_out, min(queued + self._transfer_s, due)))
        if len(self._unread) >= _PRUNE_AT:
            self._acknowledged()
        if self._watch is None and self._unread:
            self._watch = self._loop.call_at(self._unread[0][1], self._check)

    def _acknowledged(self) -> None:
        """Forget the replies the peer has acknowledged (all of them when the socket is gone)."""
        try:
            acked = self.ch.bytes_out - unsent_bytes(self.ch.sock)
        except (OSError, ValueError):
            acked = self.ch.bytes_out
        unread = self._unread
        while unread and unread[0][0] <= acked:
            unread.popleft()

    def _check(self) -> None:
        self._watch = None
        if self.failed:
            return
        self._acknowledged()
        if not self._unread:
            return
        due = self._unread[0][1]
        if due > self._loop.time():
            self._watch = self._loop.call_at(due, self._check)
            return
        self._metrics.timeouts.labels("request").inc()
        self._bad.info("timeout", peer=self._peer, kind="request", why="reply_unread")
        self.failed = True
        self._unread.clear()
        self._woken()
        self._on_fail()

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._unread.clear()

    def _end_all(self) -> None:
        while self._items:
            r = self._items.popleft()
            if r.done is not None:
                r.done(False)
