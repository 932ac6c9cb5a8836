"""One client connection to a node's data port, and the wire side of each op.

:class:`Conn` owns a :class:`rdma.channel.SocketChannel` after a successful HELLO and runs one
request at a time. HELLO may offer the client's queue pair (``rdma``); ``peer_rdma`` is the
node's answer (its queue pair and registered slab) or None, and ``verbs`` is the connected
one-sided transport once :mod:`kvstore.client.rdma` attached it (None: bytes over TCP).
Methods raise ConnectionError/FrameError/ProtocolError (connection now unusable: the caller
closes it) or :class:`NodeRefused` (the node answered with an error that closed the
connection, e.g. a refused token); per-key failures are results, not exceptions.
Requests are the typed messages of :mod:`kvstore.protocol` and replies are parsed with their
``from_wire`` (which names a bad field); no field name appears here. A GET sends keys (and
buffer sizes) only; its reply is columns, each header as the node stores it, decoded once in
``from_wire``. Its payloads are received as one stream straight into the caller's buffers
(:meth:`SocketChannel.recv_views`: ``recvmsg_into`` into several buffers per syscall, one
hand-off to a worker per reply, the xxh3 digests computed as the bytes land), and each header
is judged by :func:`kvstore.block.check_block` (key, the caller's expectation, checksum)
before its block counts as a hit. GET and PUT frames are pipelined: up to
``pipeline`` requests (``ClientConfig.pipeline``) are on the wire before the oldest reply is
read (replies come in request order). :meth:`Conn.transport` lends the
connection to :class:`rdma.tcp.TcpTransport`, whose READ/WRITE frames this module builds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from typing import Any

from kvstore import protocol as P
from kvstore.block import BlockHeader, Expect, check_block, payload_hasher
from kvstore.keys import BlockKey, KeyBatch, Namespace
from kvstore.lookups import tier_names
from kvstore.results import GetResults, PutResult, Status
from rdma.channel import SocketChannel
from rdma.framing import FrameError
from rdma.tcp import DescriptorFrames, TcpTransport
from rdma.transport import QPInfo, Region, RemoteDescriptor, Transport, TransportError

_HEADER_ROOM = 1 << 20  # frame bytes kept free for the header map when cutting PUT batches


class NodeRefused(Exception):
    """The node refused a request with a connection-level error code (``code``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def byte_view(buf: Any) -> memoryview:
    """A writable flat byte view of ``buf`` (bytearray, numpy array, CPU/pinned torch tensor),
    without copying. Raises TypeError naming the problem for anything else."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise TypeError("GET buffers must be contiguous CPU (pinned) tensors")
        import torch  # the caller passed a tensor, so torch is already imported

        buf = buf.reshape(-1).view(torch.uint8).numpy()
    mv = memoryview(buf)
    if mv.readonly:
        raise TypeError("GET buffers must be writable")
    if not mv.c_contiguous:
        raise TypeError("GET buffers must be contiguous")
    return mv.cast("B")


class Conn:
    """``hello`` is the node's HELLO reply map (kept as received for NodeClient, which reads its
    ``salt``); ``welcome`` is the same reply parsed (:class:`~kvstore.protocol.HelloReply`)."""

    def __init__(self, ch: SocketChannel, hello: dict[str, Any], pipeline: int = 4) -> None:
        self.ch = ch
        self.pipeline = pipeline  # GET/PUT frames on the wire ahead of the reply being read
        self.hello = hello
        self.welcome = P.HelloReply.from_wire(hello)
        self.max_frame = self.welcome.max_frame
        # keys per EXISTS: what the node takes, never more than this client sends (a node
        # that says more is not believed past that; one that does not say takes MAX_BATCH)
        self.exists_keys = min(self.welcome.exists_keys, P.MAX_EXISTS_KEYS)
        self.peer_rdma = self.welcome.rdma
        self.verbs: Any = None  # rdma.verbs.VerbsTransport once attached
        self.slab: Region | None = None
        self._rid = itertools.count(1)
        self.frames = _Frames(self._rid)
        self.bytes_in = 0
        self.bytes_out = 0

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        token: str,
        tenant: str | None,
        namespaces: Sequence[Namespace],
        offload: Executor | None = None,
        rdma: QPInfo | None = None,
        worker_wait_s: float = 0.0,
        pipeline: int = 4,
    ) -> Conn:
        """Connect and HELLO (offering ``rdma`` when given). Raises OSError, ConnectionError,
        FrameError, NodeRefused, or ProtocolError for a malformed reply (its ``rdma`` too)."""
        ch = await SocketChannel.connect(host, port, offload, worker_wait_s)
        try:
            hello = P.Hello.of(token, tenant, namespaces, rdma)
            await ch.send_frame(hello.to_wire())
            reply = await ch.recv_header(P.MAX_HEADER, P.MAX_HEADER)
            failed = P.check_reply(reply, hello.rid)
            if failed is not None:
                if failed.code == P.BAD_VERSION:  # a node of another version names its own
                    raise NodeRefused(failed.code, f"{failed.err}; this client speaks {P.PROTOCOL_VERSION}")
                raise NodeRefused(failed.code, failed.err)
            return cls(ch, reply, pipeline)
        except BaseException:
            ch.close()
            raise

    def use_verbs(self, transport: Transport, slab: Region) -> None:
        """Move this connection's LEASE/RESERVE bytes one-sidedly with ``transport`` (connected
        to the node's queue pair) into and out of the node's ``slab``."""
        self.verbs, self.slab = transport, slab

    def drop_verbs(self) -> None:
        """Fall back to TCP for the rest of this connection (after a verbs failure)."""
        if self.verbs is not None:
            self.verbs.destroy()
        self.verbs = self.slab = None

    def close(self) -> None:
        self.drop_verbs()
        self.ch.close()

    @property
    def closed(self) -> bool:
        return self.ch.closed

    def _next(self) -> int:
        return next(self._rid)

    async def _call(self, req: Any, payloads: Sequence[Any] = ()) -> dict[str, Any]:
        """Send ``req`` (a protocol request), read its reply header; NodeRefused for an error
        reply (its payload, if any, skipped), ProtocolError for one that answers another."""
        await self.ch.send_frame(req.to_wire(), payloads)
        return await self._reply(req.rid)

    async def _reply(self, rid: int) -> dict[str, Any]:
        """The reply header to request ``rid`` (the next one on the stream: replies come in
        request order); NodeRefused for an error reply (its payload skipped)."""
        reply = await self.ch.recv_header(P.MAX_REPLY_HEADER, 1 << 62)
        failed = P.check_reply(reply, rid)
        if failed is not None:
            if failed.plen:
                await self.ch.discard(failed.plen)
            raise NodeRefused(failed.code, failed.err)
        return reply

    async def exists(self, keys: KeyBatch) -> bytes:
        """EXISTS of packed ``keys``: one tier code per key (kvstore.lookups)."""
        reply = await self._call(P.ExistsRequest(self._next(), keys))
        return P.ExistsReply.from_wire(reply, len(keys)).codes

    async def get(
        self, keys: Sequence[BlockKey], views: Sequence[memoryview], expect: Sequence[Expect | None]
    ) -> GetResults:
        """GET into ``views``, in frames whose payloads fit the node's ``max_frame``, pipelined:
        up to ``pipeline`` requests are on the wire ahead of the reply being received, so the
        node starts the next batch while this one's bytes still land. The requests carry the
        keys and buffer sizes only; ``expect`` (per key, or None) is checked here, against
        every header the node sends."""
        runs = _batches_by_bytes([v.nbytes for v in views], self.max_frame - _HEADER_ROOM)
        reqs = [
            P.GetRequest(self._next(), tuple(keys[i:j]), tuple(v.nbytes for v in views[i:j])) for i, j in runs
        ]
        out: list[GetResults] = []
        sent = 0
        for n, (i, j) in enumerate(runs):
            # a sliding window: before reply n is read, requests n .. n + pipeline - 1 are out
            # (sending them in groups of pipeline left the node idle at each group's end)
            upto = min(len(reqs), n + self.pipeline)
            if sent < upto:
                await self.ch.send_frames([r.to_wire() for r in reqs[sent:upto]])
                sent = upto
            out.append(await self._get_reply(reqs[n].rid, keys[i:j], views[i:j], expect[i:j]))
        return GetResults.join(out) if out else GetResults.failed(Status.MISS, 0)

    async def _get_reply(
        self, rid: int, keys: Sequence[BlockKey], views: Sequence[memoryview], expect: Sequence[Expect | None]
    ) -> GetResults:
        """Receive the reply to request ``rid``: its columns (every header decoded once), then
        every HIT's payload straight into its view as one transfer (one hand-off, digests
        computed as the bytes land), then each header judged against its key and expectation
        and each HIT's digest against its checksum (:func:`~kvstore.block.check_block`): a
        block that is not the one asked for is MISMATCH, a corrupt one CORRUPT."""
        reply = P.GetReply.from_wire(await self._reply(rid), len(keys))
        blocks = reply.blocks
        hits = reply.hits()
        lens = [blocks[i].payload_len for i in hits]
        if any(n > views[i].nbytes for i, n in zip(hits, lens)):
            raise P.bad("GET reply sent a payload larger than the buffer")
        digests = await self.ch.recv_views([views[i][:n] for i, n in zip(hits, lens)], payload_hasher)
        self.bytes_in += reply.plen
        codes = bytearray(reply.codes)
        digest_of = dict(zip(hits, digests))
        hit_bytes = 0
        for i, b in enumerate(blocks):
            if b is None:
                continue
            st = check_block(b, keys[i], expect[i], digest_of.get(i))
            if st is not Status.HIT:
                codes[i] = st
            elif i in digest_of:
                hit_bytes += b.payload_len
        return GetResults(bytes(codes), tier_names(reply.tiers), blocks.__getitem__, hit_bytes)

    async def put(self, blocks: Sequence[tuple[BlockHeader, Any]]) -> list[PutResult]:
        """PUT ``blocks`` in frames that fit the node's ``max_frame``, pipelined like GET: up to
        ``pipeline`` frames (their payloads streamed) ahead of the reply being read."""
        limit = max(self.max_frame - _HEADER_ROOM, 1)
        views = []
        for hdr, payload in blocks:
            mv = memoryview(payload).cast("B")
            if mv.nbytes != hdr.payload_len:
                raise ValueError(
                    f"block {hdr.key}: payload is {mv.nbytes} bytes, header says {hdr.payload_len}"
                )
            views.append(mv)
        runs = _batches_by_bytes([v.nbytes for v in views], limit)
        out: list[PutResult] = []
        pending: list[tuple[int, int]] = []  # (rid, blocks) of frames sent, replies not yet read
        for i, j in runs:
            if len(pending) >= self.pipeline:
                out += await self._put_reply(*pending.pop(0))
            req = P.PutRequest(self._next(), tuple(h for h, _ in blocks[i:j]))
            await self.ch.send_frame(req.to_wire(), views[i:j])
            self.bytes_out += sum(v.nbytes for v in views[i:j])
            pending.append((req.rid, j - i))
        for rid, n in pending:
            out += await self._put_reply(rid, n)
        return out

    async def _put_reply(self, rid: int, n: int) -> list[PutResult]:
        return list(P.PutReply.from_wire(await self._reply(rid), n).results)

    async def delete(self, keys: KeyBatch) -> bytes:
        """DELETE of packed ``keys``: per key 1 (deleted) or 0."""
        reply = await self._call(P.DeleteRequest(self._next(), keys))
        return P.DeleteReply.from_wire(reply, len(keys)).done

    async def stats(self) -> dict[str, Any]:
        reply = await self._call(P.StatsRequest(self._next()))
        return P.StatsReply.from_wire(reply).stats

    # ---------------------------------------------------------- descriptor (RDMA-shaped) path

    def _one_sided(self, rdma: bool) -> bool:
        if rdma and self.slab is None:
            raise TransportError("one-sided descriptors asked for on a connection without RDMA")
        return rdma

    def _check_desc(self, desc: RemoteDescriptor | None, rdma: bool) -> RemoteDescriptor | None:
        """With ``rdma`` a descriptor must lie in the node's registered slab."""
        if rdma and desc is not None and not self.slab.contains(desc):  # its key is a window's
            raise P.bad(f"descriptor {desc.to_wire()!r} is outside the node's registered slab")
        return desc

    async def lease(self, keys: Sequence[BlockKey], ttl_s: float | None, rdma: bool = False) -> list[tuple]:
        """``[(status, header, tier, RemoteDescriptor | None)]`` per key; leases live on this
        connection until RELEASE or the connection ends. With ``rdma`` the descriptors point
        into the node's slab, and a HIT without one is a block to GET inline (nothing held)."""
        req = P.LeaseRequest(self._next(), tuple(keys), ttl_s, self._one_sided(rdma))
        reply = P.LeaseReply.from_wire(await self._call(req), len(keys))
        return [(e.status, e.block, e.tier, self._check_desc(e.desc, rdma)) for e in reply.entries]

    async def release(self, handles: Sequence[int]) -> list[bool]:
        reply = await self._call(P.ReleaseRequest(self._next(), tuple(handles)))
        return list(P.ReleaseReply.from_wire(reply, len(handles)).res)

    async def reserve(
        self, headers: Sequence[BlockHeader], rdma: bool = False
    ) -> list[tuple[Status | None, RemoteDescriptor | None]]:
        """Per header ``(None, descriptor)`` for a reserved slot or ``(status, None)``; with
        ``rdma``, ``(None, None)`` is a block to PUT inline (its slot is not in the slab)."""
        req = P.ReserveRequest(self._next(), tuple(headers), self._one_sided(rdma))
        reply = P.ReserveReply.from_wire(await self._call(req), len(headers))
        return [(e.status, self._check_desc(e.desc, rdma)) for e in reply.entries]

    async def commit(self, handles: Sequence[int]) -> list[PutResult]:
        reply = await self._call(P.CommitRequest(self._next(), tuple(handles)))
        return list(P.CommitReply.from_wire(reply, len(handles)).results)

    def transport(self) -> TcpTransport:
        """A TCP transport sharing this connection (for descriptors from lease/reserve)."""
        return TcpTransport(self.ch, self.frames)


class _Frames(DescriptorFrames):
    """The READ/WRITE requests of :class:`TcpTransport` on a connection (its request ids)."""

    def __init__(self, rids: Iterator[int]) -> None:
        self._rids = rids

    def request(self, write: bool, descs: Sequence[RemoteDescriptor]) -> tuple[int, dict[str, Any]]:
        req = (P.WriteRequest if write else P.ReadRequest)(next(self._rids), tuple(descs))
        return req.rid, req.to_wire()

    def completions(self, write: bool, rid: int, reply: dict[str, Any], n: int) -> list[bool]:
        try:
            if P.check_reply(reply, rid) is not None:
                raise FrameError("bad_frame", f"request {rid} failed")
            return list((P.WriteReply if write else P.ReadReply).from_wire(reply, n).res)
        except P.ProtocolError as exc:
            raise FrameError("bad_frame", f"reply to request {rid}: {exc}") from exc


def _batches_by_bytes(sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """``[start, end)`` runs of ``sizes`` each summing to at most ``limit`` bytes (a single
    larger item is its own run) and at most MAX_BLOCKS items."""
    out, start, total = [], 0, 0
    for i, s in enumerate(sizes):
        if i > start and (total + s > limit or i - start >= P.MAX_BLOCKS):
            out.append((start, i))
            start, total = i, 0
        total += s
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


__all__ = ["Conn", "FrameError", "NodeRefused", "byte_view"]
