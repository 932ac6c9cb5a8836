"""Zero-copy socket I/O: framed messages and raw payload bytes on one socket.

Frames are :mod:`rdma.framing`'s (a length-prefixed msgpack header whose ``plen`` says how
many payload bytes follow). Payloads never pass through msgpack or asyncio streams:
they leave with ``sendmsg`` straight from the caller's memoryviews (a DRAM slot, a numpy or
torch buffer) and arrive with ``recv_into`` straight into the destination buffer. The socket
is tried first (every call on the loop passes ``MSG_DONTWAIT``, whether the socket is
blocking or not) and the event loop is only awaited when the kernel says EAGAIN, so a large
payload costs a few syscalls and no per-chunk futures.

:class:`SocketChannel` is bound to one event loop. It carries one send and one receive at a
time, which may run at once (the daemon reads a connection's next request while its sender
task sends the previous reply); never two sends, or two receives, at once. Both ends of the
data port use it; :mod:`rdma.tcp` moves descriptors' bytes over it. This module knows bytes
and frames, never the store's ops or fields.

It stays one file (over 400 lines) because it is one class: every send and receive path shares the
socket's loop registrations (:class:`_Watch`), its worker hand-off and its byte counters; the
per-syscall loops themselves live in :mod:`rdma.bursts`. Most of its length is the measured
reasons behind each mode, kept beside the code they justify.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

from rdma.bursts import IOV_MAX, Landing, advance, recv_landing, send_slices
from rdma.framing import decode_header, encode_header, header_length

T = TypeVar("T")
_DISCARD_CHUNK = 256 << 10
_GROW_CHUNK = 256 << 10
_SOCK_BUF = 4 << 20
_SLICES_BUDGET_S = 0.1  # one hand-off of a send in slices (rdma/bursts.py: send_slices)
OFFLOAD_MIN = 256 << 10  # smaller transfers stay on the event loop: a thread hop costs ~50 us


class SocketChannel:
    """Exact-length sends and receives on a connected socket.

    ``send`` and ``recv_into`` either finish or raise ConnectionError (peer closed, reset);
    cancelling them leaves the stream mid-frame, so the owner must then close the channel.

    With an ``offload`` executor, the kernel copies of transfers of at least ``OFFLOAD_MIN``
    bytes run in a worker thread (the GIL is released during the copy), so one process moves
    several large payloads at once on several cores; the event loop stays free. A worker
    receives only until the socket says EAGAIN (or, with ``worker_wait_s``, after one slice
    without input) and sends until one slice without room (``send_slice_s``;
    :func:`rdma.bursts.send_slices`): longer waits for a slow or stalled peer happen on the
    event loop, so a peer holds a worker about one slice per hand-off. ``offload_if``, when given,
    is asked before each such transfer: False keeps it on the loop (a daemon serving one
    request at a time saves the two thread hops, ~40% of a 2 MiB GET). A cancelled offloaded
    transfer shuts the socket down and waits for its worker before re-raising (however often
    it is cancelled meanwhile), so no thread touches the buffer after the await ends.

    ``worker_wait_s`` > 0 lets an offloaded receive wait for input in its worker, a slice of at
    most that long at a time, so a streamed batch is received by one hand-off to one thread
    (:meth:`recv_views`). Only for an owner that gives each connection a worker of its own
    (the client's pool: a stalled node holds its own connection's worker, for one slice); the
    daemon keeps 0 (its workers are shared by every peer).

    ``send_slice_s`` > 0 (the daemon: 20 ms; the client: its ``worker_wait_s``, set by
    :meth:`connect`) makes the socket blocking with ``SO_SNDTIMEO`` of that long: an offloaded
    send then lets the kernel wait for room inside ``sendmsg`` (1.02-1.05x a blocking send's
    CPU per GB, where returning at each full buffer and waiting for room with ``poll`` cost
    1.46-1.52x: docs/benchmarks.md). A hand-off ends at the first ``sendmsg`` that waited its
    slice out (short or without room) and after 0.1 s for a reader that keeps up; waits beyond
    it happen on the loop. Sends of at least ``OFFLOAD_MIN`` bytes are then offloaded whatever
    ``offload_if`` says. Without it (0) the socket is non-blocking and the same loop returns
    at the first full buffer.
    """

    def __init__(
        self,
        sock: socket.socket,
        offload: Executor | None = None,
        offload_if: Callable[[], bool] | None = None,
        worker_wait_s: float = 0.0,
        send_slice_s: float = 0.0,
    ) -> None:
        if send_slice_s > 0:
            sock.setblocking(True)
            usec = int(send_slice_s * 1e6)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", usec // 1000000, usec % 1000000)
            )
        else:
            sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # MiB-sized payloads: a larger send buffer means fewer EAGAIN wake-ups per block
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._offload = offload
        self._offload_if = offload_if
        self._worker_wait_s = worker_wait_s
        self._send_slices = send_slice_s > 0
        self.closed = False
        # the reader stays registered across waits (see _on_readable), the writer while a send
        # waits: a large send waits once per socket buffer drained, and two epoll_ctl calls per
        # wait were a tenth of a daemon's loop time on a 256 KiB-block GET
        self._reader = _Watch(self._loop.add_reader, self._loop.remove_reader, self._on_readable)
        self._writer = _Watch(self._loop.add_writer, self._loop.remove_writer, self._on_writable)
        self.bytes_in = 0
        self.bytes_out = 0

    @classmethod
    async def connect(
        cls, host: str, port: int, offload: Executor | None = None, worker_wait_s: float = 0.0
    ) -> SocketChannel:
        """Open a TCP connection (raises OSError when refused or unreachable)."""
        loop = asyncio.get_running_loop()
        infos = _numeric(host, port) or await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        err: OSError | None = None
        for family, type_, proto, _, addr in infos:
            sock = socket.socket(family, type_, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, addr)
                # the connection's own worker waits for room in the kernel, a slice at a time
                return cls(sock, offload, worker_wait_s=worker_wait_s, send_slice_s=worker_wait_s)
            except OSError as exc:
                sock.close()
                err = exc
        raise err or OSError(f"cannot resolve {host}:{port}")

    async def _wait(self, write: bool) -> None:
        fd = self.sock.fileno()
        if fd < 0:
            raise ConnectionError("channel closed")
        await (self._writer if write else self._reader).wait(fd, self._loop.create_future())

    def _on_writable(self) -> None:
        # fired with no one waiting (a worker sends the rest meanwhile): stop watching, or
        # the level-triggered room wakes the loop on every pass until the send ends
        fut = self._writer.waiter
        if fut is None:
            self._writer.stop()
        elif not fut.done():
            fut.set_result(None)

    def _on_readable(self) -> None:
        """The reader stays registered after a wait (most waits are followed by another: a
        daemon's next request, a client's next reply), which saves two epoll_ctl calls and the
        selector's bookkeeping per wait; it removes itself when it fires with no one waiting
        (epoll is level-triggered: it would fire on every pass of the loop) and :meth:`close`
        removes it."""
        fut = self._reader.waiter
        if fut is None:  # no one waits (nor was woken and not yet resumed): stop watching
            self._reader.stop()
        elif not fut.done() and self._has_input():
            fut.set_result(None)

    def _has_input(self) -> bool:
        """A byte, EOF or an error is there to read. The readiness a callback reports may be
        stale (queued before the task it woke read the bytes, then run after the task waits
        again), and a waiter of :meth:`readable` must not be woken without input."""
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        return True

    def offloads(self, nbytes: int, send: bool = False) -> bool:
        """Whether a transfer of ``nbytes`` (a send: ``send``) would copy in a worker thread now."""
        if send and self._send_slices:
            return self._offload is not None and nbytes >= OFFLOAD_MIN
        return (
            self._offload is not None
            and nbytes >= OFFLOAD_MIN
            and (self._offload_if is None or self._offload_if())
        )

    async def _in_worker(self, fn, *args):
        fut = self._loop.run_in_executor(self._offload, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # the worker's next syscall fails at once
            fut.add_done_callback(_retrieved)  # its failure (the socket shut down) is expected
            # no deadline and no way out: until the worker's syscall returns, it may still
            # write into the buffer, whose slot the caller frees once this await ends. A
            # further cancel (a revoke, stop, a failed reply send's on_fail) is absorbed; the
            # socket is shut down, so the syscall returns at once (or at its slice's end).
            while not fut.done():
                try:
                    await asyncio.wait({fut})
                except asyncio.CancelledError:
                    pass
            raise

    async def send(self, buffers: Sequence[Any]) -> None:
        """Send every byte of ``buffers`` (bytes-like, sent without copying) in order."""
        await self.send_views(_byte_views(buffers))

    async def send_views(self, views: list[memoryview]) -> None:
        """:meth:`send` of byte views (none empty; a part-sent one is trimmed in place)."""
        try:
            await self._send(views)
        finally:
            self._writer.stop()

    def send_ready(self, views: list[memoryview]) -> int:
        """Send what the socket takes now from ``views`` (byte views, none empty), never
        waiting: returns the index of the first view not yet sent (a part-sent one is
        trimmed in place). ConnectionError when the send fails."""
        i = 0
        while i < len(views):
            try:
                n = self.sock.sendmsg(views[i : i + IOV_MAX], (), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise ConnectionError(f"send failed: {exc}") from exc
            self.bytes_out += n
            i = advance(views, i, n)
        return i

    @staticmethod
    def frame_views(header: dict[str, Any], payloads: Sequence[Any] = ()) -> list[memoryview]:
        """One frame as byte views (:meth:`send_frame`'s): the encoded header, then the payloads."""
        views = _byte_views(payloads)
        return [memoryview(encode_header(header, sum(v.nbytes for v in views))), *views]

    async def _send(self, views: list[memoryview]) -> None:
        if self.offloads(sum(v.nbytes for v in views), send=True):
            i = 0
            while i < len(views):
                i, n = await self._in_worker(send_slices, self.sock, views, i, _SLICES_BUDGET_S)
                self.bytes_out += n
                if i < len(views):
                    await self._wait(write=True)
            return
        i = 0
        while i < len(views):
            chunk = views[i : i + IOV_MAX]
            try:
                n = self.sock.sendmsg(chunk, (), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                await self._wait(write=True)
                continue
            except OSError as exc:
                raise ConnectionError(f"send failed: {exc}") from exc
            self.bytes_out += n
            i = advance(views, i, n)

    async def recv_into(self, view: Any, then: Callable[[memoryview], T] | None = None) -> T | None:
        """Fill ``view`` (a writable buffer) exactly; ConnectionError on EOF or reset. ``then``,
        when given, is called on the filled view by the thread that copied its last bytes, and
        its result returned: for an offloaded transfer that is the worker, so a pass over the
        bytes (a checksum) reads them from that core's cache and off the event loop."""
        land = Landing([memoryview(view).cast("B")], None, then)
        await self._receive(land)
        return land.result

    async def recv_views(
        self, views: Sequence[Any], hasher: Callable[[], Any] | None = None
    ) -> list[int | None]:
        """Fill each of ``views`` exactly, in order, as one transfer: one hand-off to a worker
        (when offloaded) for the whole batch, not one per view, and ``recvmsg_into`` into
        several views per syscall. With ``hasher`` (``kvstore.block.payload_hasher``) returns each view's
        digest, computed as its bytes land; else Nones. ConnectionError on EOF or reset."""
        land = Landing([memoryview(v).cast("B") for v in views], hasher)
        await self._receive(land)
        return land.digests

    async def _receive(self, land: Landing) -> None:
        offload = self.offloads(land.total)
        while True:
            if offload:
                n = await self._in_worker(recv_landing, self.sock, land, self._worker_wait_s)
            else:
                n = recv_landing(self.sock, land)
            self.bytes_in += n
            if land.done:
                return
            await self._wait(write=False)

    async def recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        await self.recv_into(buf)
        return buf

    async def recv_growing(self, n: int) -> bytearray:
        """Receive exactly ``n`` bytes into a buffer that grows as they arrive, so a peer that
        announces a large length and sends little costs little memory (headers, payloads
        without a slot of their own). Never offloaded."""
        buf = bytearray()
        while len(buf) < n:
            data = self._recv_now(min(n - len(buf), _GROW_CHUNK), len(buf), n)
            if data is None:
                await self._wait(write=False)
            else:
                buf += data
        return buf

    def _recv_now(self, most: int, got: int, total: int) -> bytes | None:
        """Up to ``most`` bytes the socket holds now, None when it holds none yet.
        ConnectionError on EOF (naming ``got`` of ``total`` bytes received) or reset."""
        try:
            data = self.sock.recv(most, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            raise ConnectionError(f"recv failed: {exc}") from exc
        if not data:
            raise ConnectionError(f"peer closed the connection after {got} of {total} bytes")
        self.bytes_in += len(data)
        return data

    async def readable(self) -> None:
        """Wait until a byte (or EOF) can be read; at once when one is buffered already."""
        await self._wait(write=False)

    def peer_closed(self) -> bool:
        """True when the peer has closed or reset this (idle) connection, or sent bytes no
        request asked for: either way it cannot carry the next request. One non-blocking peek."""
        if self.closed:
            return True
        try:
            return len(self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)) >= 0
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    async def discard(self, n: int) -> None:
        """Read and drop ``n`` bytes (a payload nobody can take). No buffer is kept while the
        peer is slow: each chunk exists only for the ``recv`` that returns it, so a stalled
        peer costs about the bytes it sent (docs/security.md). ConnectionError on EOF."""
        left = n
        while left > 0:
            data = self._recv_now(min(left, _DISCARD_CHUNK), n - left, n)
            if data is None:
                await self._wait(write=False)
            else:
                left -= len(data)

    async def send_frame(self, header: dict[str, Any], payloads: Sequence[Any] = ()) -> None:
        """Send one frame; ``plen`` is set from ``payloads`` (which are sent without copying)."""
        await self.send_views(self.frame_views(header, payloads))

    async def send_frames(self, headers: Sequence[dict[str, Any]]) -> None:
        """Send several payload-less frames with one ``sendmsg`` (pipelined requests)."""
        await self.send([encode_header(h, 0) for h in headers])

    async def recv_header(self, max_header: int, max_frame: int) -> dict[str, Any]:
        """Read one frame header. Raises FrameError (``too_large`` for a length over the limits,
        ``bad_frame`` for garbage) or ConnectionError. The ``plen`` payload bytes are left on
        the socket for the caller to ``recv_into`` or ``discard``."""
        hlen = header_length(await self.recv_exact(4), max_header, max_frame)
        return decode_header(await self.recv_growing(hlen), max_frame)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._reader.stop()  # first: the loop must not watch an fd number about to be reused
            self._writer.stop()
            self.sock.close()


class _Watch:
    """One direction's registration of a channel's socket with the event loop, kept across
    waits until :meth:`stop`; ``waiter`` is the future a wait awaits, None between waits."""

    __slots__ = ("_add", "_remove", "_on_ready", "fd", "waiter")

    def __init__(self, add: Callable, remove: Callable, on_ready: Callable[[], None]) -> None:
        self._add, self._remove, self._on_ready = add, remove, on_ready
        self.fd: int | None = None
        self.waiter: asyncio.Future | None = None

    async def wait(self, fd: int, fut: asyncio.Future) -> None:
        self.waiter = fut
        if self.fd is None:
            self._add(fd, self._on_ready)
            self.fd = fd
        try:
            await fut
        finally:
            self.waiter = None

    def stop(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            self._remove(fd)


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _byte_views(buffers: Sequence[Any]) -> list[memoryview]:
    views = [memoryview(b).cast("B") for b in buffers]
    return [v for v in views if v.nbytes]


def _numeric(host: str, port: int) -> list[tuple] | None:
    """getaddrinfo's answer for an IP literal, without it: the loop runs getaddrinfo in its
    default thread pool, where many connections opened at once (32 clients starting together)
    queue behind each other past a short connect timeout, for an answer known here."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    addr = (host, port, 0, 0) if ip.version == 6 else (host, port)
    return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", addr)]
