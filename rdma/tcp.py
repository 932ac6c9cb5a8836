"""The TCP transport: framed messages and raw payload bytes on a non-blocking socket.

A frame is ``[u32 big-endian header length][msgpack map][payload]``; the header's ``plen``
says how many payload bytes follow. Payloads never pass through msgpack or asyncio streams:
they leave with ``sendmsg`` straight from the caller's memoryviews (a DRAM slot, a numpy or
torch buffer) and arrive with ``recv_into`` straight into the destination buffer. The socket
is tried first and the event loop is only awaited when the kernel says EAGAIN, so a large
payload costs a few syscalls and no per-chunk futures.

:class:`SocketChannel` is bound to one event loop and is not safe for concurrent use: one
request/reply at a time per channel (the daemon serves a connection serially; the client
pools connections). :class:`TcpTransport` implements :class:`rdma.transport.Transport` over
a channel: it moves the bytes of a batch of descriptors between the local buffers and the
channel, in frames whose headers the store builds and reads (:class:`DescriptorFrames`):
this package knows framing and bytes, never the store's ops or fields.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

import msgpack

from rdma.transport import RemoteDescriptor, Transport, TransportError, batches, check_pairs

T = TypeVar("T")
_LEN = struct.Struct(">I")
_PLEN = "plen"  # the header field that says how many payload bytes follow (framing's only one)
_IOV_MAX = 512  # below the kernel's IOV_MAX (1024) with room to spare
_DISCARD_CHUNK = 1 << 20
_GROW_CHUNK = 256 << 10
_SOCK_BUF = 4 << 20
OFFLOAD_MIN = 256 << 10  # smaller transfers stay on the event loop: a thread hop costs ~50 us


def payload_len(header: dict[str, Any]) -> int:
    """The payload bytes that follow a frame header (checked by :meth:`SocketChannel.recv_header`)."""
    return header.get(_PLEN, 0)


class FrameError(TransportError):
    """A peer sent a frame we cannot accept. ``code`` is the wire error code (see
    docs/protocol.md): ``bad_frame``, ``too_large``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class SocketChannel:
    """Exact-length sends and receives on a connected non-blocking socket.

    ``send`` and ``recv_into`` either finish or raise ConnectionError (peer closed, reset);
    cancelling them leaves the stream mid-frame, so the owner must then close the channel.

    With an ``offload`` executor, the kernel copies of transfers of at least ``OFFLOAD_MIN``
    bytes run in a worker thread (the GIL is released during the copy), so one process moves
    several large payloads at once on several cores; the event loop stays free. A worker only
    ever runs a non-blocking burst (copy until the socket says EAGAIN, then return): waiting
    for a slow or stalled peer happens on the event loop, so no peer can hold a worker. ``offload_if``, when given,
    is asked before each such transfer: False keeps it on the loop (a daemon serving one
    request at a time saves the two thread hops, ~40% of a 2 MiB GET). A cancelled offloaded
    transfer shuts the socket down and waits for its worker before re-raising, so no thread
    touches the buffer after the await ends.
    """

    def __init__(
        self,
        sock: socket.socket,
        offload: Executor | None = None,
        offload_if: Callable[[], bool] | None = None,
    ) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # MiB-sized payloads: a larger send buffer means fewer EAGAIN wake-ups per block
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._offload = offload
        self._offload_if = offload_if
        self.closed = False
        self._reader_fd: int | None = None  # registered with _on_readable (see _wait_readable)
        self._reader_wait: asyncio.Future | None = None
        self.bytes_in = 0
        self.bytes_out = 0

    @classmethod
    async def connect(cls, host: str, port: int, offload: Executor | None = None) -> SocketChannel:
        """Open a TCP connection (raises OSError when refused or unreachable)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        err: OSError | None = None
        for family, type_, proto, _, addr in infos:
            sock = socket.socket(family, type_, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, addr)
                return cls(sock, offload)
            except OSError as exc:
                sock.close()
                err = exc
        raise err or OSError(f"cannot resolve {host}:{port}")

    async def _wait(self, write: bool) -> None:
        fd = self.sock.fileno()
        if fd < 0:
            raise ConnectionError("channel closed")
        fut = self._loop.create_future()
        if not write:
            await self._wait_readable(fd, fut)
            return

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        self._loop.add_writer(fd, ready)
        try:
            await fut
        finally:
            self._loop.remove_writer(fd)

    async def _wait_readable(self, fd: int, fut: asyncio.Future) -> None:
        """Wait for ``fd`` to be readable. The reader stays registered after the wait (most
        waits are followed by another: a daemon's next request, a client's next reply), which
        saves two epoll_ctl calls and the selector's bookkeeping per wait; it removes itself
        when it fires with no one waiting (epoll is level-triggered: it would fire on every
        pass of the loop) and :meth:`close` removes it."""
        self._reader_wait = fut
        if self._reader_fd is None:
            self._loop.add_reader(fd, self._on_readable)
            self._reader_fd = fd
        try:
            await fut
        finally:
            self._reader_wait = None

    def _on_readable(self) -> None:
        fut = self._reader_wait
        if fut is None:  # no one waits (nor was woken and not yet resumed): stop watching
            self._stop_reader()
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

    def _stop_reader(self) -> None:
        if self._reader_fd is not None:
            fd, self._reader_fd = self._reader_fd, None
            self._loop.remove_reader(fd)

    def _offloads(self, nbytes: int) -> bool:
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
            await asyncio.wait({fut}, timeout=10)
            raise

    async def send(self, buffers: Sequence[Any]) -> None:
        """Send every byte of ``buffers`` (bytes-like, sent without copying) in order."""
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if v.nbytes]
        if self._offloads(sum(v.nbytes for v in views)):
            i = 0
            while i < len(views):
                i, n = await self._in_worker(_send_burst, self.sock, views, i)
                self.bytes_out += n
                if i < len(views):
                    await self._wait(write=True)
            return
        i = 0
        while i < len(views):
            chunk = views[i : i + _IOV_MAX]
            try:
                n = self.sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                await self._wait(write=True)
                continue
            except OSError as exc:
                raise ConnectionError(f"send failed: {exc}") from exc
            self.bytes_out += n
            i = _advance(views, i, n)

    async def recv_into(self, view: Any, then: Callable[[memoryview], T] | None = None) -> T | None:
        """Fill ``view`` (a writable buffer) exactly; ConnectionError on EOF or reset. ``then``,
        when given, is called on the filled view by the thread that copied its last bytes, and
        its result returned: for an offloaded transfer that is the worker, so a pass over the
        bytes (a checksum) reads them from that core's cache and off the event loop."""
        mv = memoryview(view).cast("B")
        if self._offloads(mv.nbytes):
            pos, out = 0, None
            while pos < mv.nbytes:
                got, out = await self._in_worker(_recv_burst, self.sock, mv, pos, then)
                self.bytes_in += got - pos
                pos = got
                if pos < mv.nbytes:
                    await self._wait(write=False)
            return out
        pos, end = 0, mv.nbytes
        while pos < end:
            try:
                n = self.sock.recv_into(mv[pos:])
            except (BlockingIOError, InterruptedError):
                await self._wait(write=False)
                continue
            except OSError as exc:
                raise ConnectionError(f"recv failed: {exc}") from exc
            if n == 0:
                raise ConnectionError(f"peer closed the connection after {pos} of {end} bytes")
            pos += n
            self.bytes_in += n
        return then(mv) if then is not None else None

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
            try:
                data = self.sock.recv(min(n - len(buf), _GROW_CHUNK))
            except (BlockingIOError, InterruptedError):
                await self._wait(write=False)
                continue
            except OSError as exc:
                raise ConnectionError(f"recv failed: {exc}") from exc
            if not data:
                raise ConnectionError(f"peer closed the connection after {len(buf)} of {n} bytes")
            buf += data
            self.bytes_in += len(data)
        return buf

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
        """Read and drop ``n`` bytes (a payload nobody can take), in bounded chunks."""
        scratch = bytearray(min(n, _DISCARD_CHUNK))
        while n > 0:
            step = min(n, len(scratch))
            await self.recv_into(memoryview(scratch)[:step])
            n -= step

    async def send_frame(self, header: dict[str, Any], payloads: Sequence[Any] = ()) -> None:
        """Send one frame; ``plen`` is set from ``payloads`` (which are sent without copying)."""
        plen = sum(memoryview(p).nbytes for p in payloads)
        if plen:
            header = {**header, _PLEN: plen}
        body = msgpack.packb(header, use_bin_type=True)
        await self.send([_LEN.pack(len(body)) + body, *payloads])

    async def recv_header(self, max_header: int, max_frame: int) -> dict[str, Any]:
        """Read one frame header. Raises FrameError (``too_large`` for a length over the limits,
        ``bad_frame`` for garbage) or ConnectionError. The ``plen`` payload bytes are left on
        the socket for the caller to ``recv_into`` or ``discard``."""
        (hlen,) = _LEN.unpack(await self.recv_exact(4))
        if hlen > max_header or hlen > max_frame:
            raise FrameError(
                "too_large", f"header length {hlen} exceeds the maximum {min(max_header, max_frame)}"
            )
        if hlen == 0:
            raise FrameError("bad_frame", "empty header")
        raw = await self.recv_growing(hlen)
        try:
            header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise FrameError("bad_frame", f"header is not valid msgpack: {type(exc).__name__}") from exc
        if not isinstance(header, dict):
            raise FrameError("bad_frame", f"header is a {type(header).__name__}, not a map")
        plen = header.get(_PLEN, 0)
        if not isinstance(plen, int) or isinstance(plen, bool) or plen < 0:
            raise FrameError("bad_frame", f"plen must be a non-negative integer, got {plen!r}")
        if hlen + plen > max_frame:
            raise FrameError("too_large", f"frame of {hlen + plen} bytes exceeds the maximum {max_frame}")
        return header

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._stop_reader()  # first: the loop must not watch an fd number about to be reused
            self.sock.close()


def _send_burst(sock: socket.socket, views: list[memoryview], i: int) -> tuple[int, int]:
    """Worker-thread body of an offloaded send: ``sendmsg`` from ``views[i:]`` until done or
    EAGAIN (never waits). Returns (index of the first view not yet sent, bytes sent)."""
    total = 0
    while i < len(views):
        try:
            n = sock.sendmsg(views[i : i + _IOV_MAX])
        except (BlockingIOError, InterruptedError):
            break
        except OSError as exc:
            raise ConnectionError(f"send failed: {exc}") from exc
        total += n
        i = _advance(views, i, n)
    return i, total


def _advance(views: list[memoryview], i: int, n: int) -> int:
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


def _recv_burst(sock: socket.socket, mv: memoryview, pos: int, then: Callable | None) -> tuple[int, Any]:
    """Worker-thread body of an offloaded ``recv_into``: fill ``mv[pos:]`` until done or EAGAIN
    (never waits). Returns the new position and, once ``mv`` is full, ``then(mv)`` (None until
    then, or without ``then``); ConnectionError on EOF or reset."""
    end = mv.nbytes
    while pos < end:
        try:
            n = sock.recv_into(mv[pos:])
        except (BlockingIOError, InterruptedError):
            break
        except OSError as exc:
            raise ConnectionError(f"recv failed: {exc}") from exc
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {pos} of {end} bytes")
        pos += n
    return pos, (then(mv) if then is not None and pos == end else None)


class DescriptorFrames(abc.ABC):
    """The store's half of :class:`TcpTransport`: the frame header that asks the peer to send
    (read) or take (write) the bytes of a batch of descriptors, and what its reply says. The
    store that hands out the descriptors owns these ops; this package only moves the bytes."""

    @abc.abstractmethod
    def request(self, write: bool, descs: Sequence[RemoteDescriptor]) -> tuple[int, dict[str, Any]]:
        """``(request id, frame header)`` for ``descs`` (a WRITE's payload is their bytes)."""

    @abc.abstractmethod
    def completions(self, write: bool, rid: int, reply: dict[str, Any], n: int) -> list[bool]:
        """Per descriptor of request ``rid``, whether its bytes moved (a read's follow the reply
        in order, ``payload_len(reply)`` in all). TransportError when ``reply`` does not answer
        that request (the channel is then closed)."""


class TcpTransport(Transport):
    """One-sided reads and writes emulated over a :class:`SocketChannel`: the peer copies the
    bytes a descriptor names to or from the socket, so the same descriptor-driven code runs
    on every machine. ``frames`` builds each batch's request and reads its reply. A reply or
    connection failure completes the affected pairs with False; the channel is then closed
    (it may be mid-frame)."""

    name = "tcp"

    def __init__(
        self, channel: SocketChannel, frames: DescriptorFrames, max_wr: int = 256, max_bytes: int = 64 << 20
    ) -> None:
        self.channel = channel
        self.frames = frames
        self.max_wr = max_wr
        self.max_bytes = max_bytes

    async def read(self, pairs: Sequence[tuple[Any, RemoteDescriptor]]) -> list[bool]:
        views = check_pairs(pairs)
        done = [False] * len(pairs)
        for idx in batches(pairs, self.max_wr, self.max_bytes):
            try:
                await self._read_batch(idx, pairs, views, done)
            except (ConnectionError, TransportError):
                self.channel.close()
                break
        return done

    async def _read_batch(self, idx, pairs, views, done) -> None:
        rid, header = self.frames.request(False, [pairs[i][1] for i in idx])
        await self.channel.send_frame(header)
        reply = await self.channel.recv_header(1 << 20, 1 << 62)
        ok = self.frames.completions(False, rid, reply, len(idx))
        plen = payload_len(reply)
        for i, good in zip(idx, ok):
            if good:
                await self.channel.recv_into(views[i])
                plen -= views[i].nbytes
                done[i] = True
        if plen:
            raise FrameError("bad_frame", f"read reply payload length off by {plen}")

    async def write(self, pairs: Sequence[tuple[Any, RemoteDescriptor]]) -> list[bool]:
        views = check_pairs(pairs)
        done = [False] * len(pairs)
        for idx in batches(pairs, self.max_wr, self.max_bytes):
            try:
                rid, header = self.frames.request(True, [pairs[i][1] for i in idx])
                await self.channel.send_frame(header, [views[i] for i in idx])
                reply = await self.channel.recv_header(1 << 20, 1 << 20)
                ok = self.frames.completions(True, rid, reply, len(idx))
            except (ConnectionError, TransportError):
                self.channel.close()
                break
            for i, good in zip(idx, ok):
                done[i] = good
        return done

    def destroy(self) -> None:
        self.channel.close()
