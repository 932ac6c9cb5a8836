"""The TCP transport: one-sided reads and writes emulated over a :class:`rdma.channel.SocketChannel`.

:class:`TcpTransport` implements :class:`rdma.transport.Transport` over a channel: it moves
the bytes of a batch of descriptors between the local buffers and the channel, in frames
whose headers the store builds and reads (:class:`DescriptorFrames`): this package knows
framing and bytes, never the store's ops or fields.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from rdma.channel import SocketChannel
from rdma.framing import FrameError, payload_len
from rdma.transport import RemoteDescriptor, Transport, TransportError, batches, check_pairs


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
