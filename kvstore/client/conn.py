"""One client connection to a node's data port, and the wire side of each op.

:class:`Conn` owns a :class:`rdma.tcp.SocketChannel` after a successful HELLO and runs one
request at a time. HELLO may offer the client's queue pair (``rdma``); ``peer_rdma`` is the
node's answer (its queue pair and registered slab) or None, and ``verbs`` is the connected
one-sided transport once :mod:`kvstore.client.rdma` attached it (None: bytes over TCP).
Methods raise ConnectionError/FrameError/ProtocolError (connection now unusable: the caller
closes it) or :class:`NodeRefused` (the node answered with an error that closed the
connection, e.g. a refused token); per-key failures are results, not exceptions.
GET payloads are received with ``recv_into`` straight into the caller's buffers and each one
is checked against its header (key, expectation, checksum) before it counts as a hit.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from kvstore import protocol as P
from kvstore.block import BlockHeader, checksum
from kvstore.keys import BlockKey, Namespace
from kvstore.results import Expect, GetResult, PutResult, Status
from rdma.tcp import FrameError, SocketChannel, TcpTransport
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
    def __init__(self, ch: SocketChannel, hello: dict[str, Any]) -> None:
        self.ch = ch
        self.hello = hello
        self.max_frame = int(hello.get("max_frame", 64 << 20))
        self.peer_rdma = P.RdmaReply.from_wire(hello.get("rdma"))
        self.verbs: Any = None  # rdma.verbs.VerbsTransport once attached
        self.slab: Region | None = None
        self._rid = itertools.count(1)
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
    ) -> Conn:
        """Connect and HELLO (offering ``rdma`` when given). Raises OSError, ConnectionError,
        FrameError, NodeRefused, or ProtocolError for a reply whose ``rdma`` is malformed."""
        ch = await SocketChannel.connect(host, port, offload)
        try:
            await ch.send_frame(
                {
                    "op": "HELLO",
                    "rid": 0,
                    "v": P.PROTOCOL_VERSION,
                    "token": token,
                    "tenant": tenant,
                    "ns": [P.namespace_to_wire(ns) for ns in namespaces],
                    "rdma": rdma.to_wire() if rdma is not None else None,
                }
            )
            reply = await ch.recv_header(P.MAX_HEADER, P.MAX_HEADER)
            if not reply.get("ok"):
                raise NodeRefused(str(reply.get("code")), str(reply.get("err")))
            return cls(ch, reply)
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

    async def _call(self, header: dict[str, Any], payloads: Sequence[Any] = ()) -> dict[str, Any]:
        rid = next(self._rid)
        await self.ch.send_frame({**header, "rid": rid}, payloads)
        reply = await self.ch.recv_header(P.MAX_REPLY_HEADER, 1 << 62)
        if reply.get("rid") != rid and reply.get("ok") is not False:
            raise P.bad(f"reply for request {reply.get('rid')!r}, expected {rid}")
        if not reply.get("ok"):
            code, err = str(reply.get("code")), str(reply.get("err"))
            if reply.get("plen"):
                await self.ch.discard(reply["plen"])
            raise NodeRefused(code, err)
        return reply

    async def exists(self, keys: Sequence[BlockKey]) -> list[str | None]:
        reply = await self._call({"op": "EXISTS", "keys": [k.raw for k in keys]})
        tiers = reply.get("tiers")
        if not isinstance(tiers, list) or len(tiers) != len(keys):
            raise P.bad("EXISTS reply has the wrong number of tiers")
        return [t if isinstance(t, str) else None for t in tiers]

    async def get_into(
        self, keys: Sequence[BlockKey], views: Sequence[memoryview], expect: Sequence[Expect | None]
    ) -> list[GetResult]:
        """GET into ``views``, in frames whose payloads fit the node's ``max_frame``."""
        out: list[GetResult] = []
        for i, j in _batches_by_bytes([v.nbytes for v in views], self.max_frame - _HEADER_ROOM):
            out += await self._get_batch(keys[i:j], views[i:j], expect[i:j])
        return out

    async def _get_batch(
        self, keys: Sequence[BlockKey], views: Sequence[memoryview], expect: Sequence[Expect | None]
    ) -> list[GetResult]:
        exp = [None if e is None else [e.parent.raw if e.parent else None, e.token_bytes] for e in expect]
        reply = await self._call(
            {
                "op": "GET",
                "keys": [k.raw for k in keys],
                "caps": [v.nbytes for v in views],
                "exp": exp if any(e is not None for e in exp) else None,
            }
        )
        res = reply.get("res")
        if not isinstance(res, list) or len(res) != len(keys):
            raise P.bad("GET reply has the wrong number of results")
        parsed = [P.get_result_from_wire(r) for r in res]
        plen = reply.get("plen", 0)
        if plen != sum(h.payload_len for st, h, _ in parsed if st is Status.HIT):
            raise P.bad("GET reply payload length does not match its headers")
        out = []
        for i, (st, hdr, tier) in enumerate(parsed):
            if st is Status.HIT:
                if hdr.payload_len > views[i].nbytes:
                    raise P.bad("GET reply sent a payload larger than the buffer")
                dst = views[i][: hdr.payload_len]
                await self.ch.recv_into(dst)
                self.bytes_in += hdr.payload_len
                st = check_payload(hdr, keys[i], expect[i], dst)
            out.append(GetResult(st, hdr, tier))
        return out

    async def put(self, blocks: Sequence[tuple[BlockHeader, Any]]) -> list[PutResult]:
        out: list[PutResult] = []
        limit = max(self.max_frame - _HEADER_ROOM, 1)
        batch: list[tuple[BlockHeader, memoryview]] = []
        size = 0
        for hdr, payload in blocks:
            mv = memoryview(payload).cast("B")
            if batch and (size + mv.nbytes > limit or len(batch) >= P.MAX_BLOCKS):
                out += await self._put_batch(batch)
                batch, size = [], 0
            batch.append((hdr, mv))
            size += mv.nbytes
        if batch:
            out += await self._put_batch(batch)
        return out

    async def _put_batch(self, batch: list[tuple[BlockHeader, memoryview]]) -> list[PutResult]:
        for hdr, mv in batch:
            if mv.nbytes != hdr.payload_len:
                raise ValueError(
                    f"block {hdr.key}: payload is {mv.nbytes} bytes, header says {hdr.payload_len}"
                )
        reply = await self._call(
            {"op": "PUT", "hdrs": [h.encode() for h, _ in batch]}, [mv for _, mv in batch]
        )
        self.bytes_out += sum(mv.nbytes for _, mv in batch)
        return _put_results(reply.get("res"), len(batch))

    async def delete(self, keys: Sequence[BlockKey]) -> list[bool]:
        reply = await self._call({"op": "DELETE", "keys": [k.raw for k in keys]})
        return _bools(reply.get("res"), len(keys))

    async def stats(self) -> dict[str, Any]:
        reply = await self._call({"op": "STATS"})
        return reply.get("stats") or {}

    # ---------------------------------------------------------- descriptor (RDMA-shaped) path

    def _one_sided(self, req: dict[str, Any], rdma: bool) -> dict[str, Any]:
        if rdma:
            if self.slab is None:
                raise TransportError("one-sided descriptors asked for on a connection without RDMA")
            req["rdma"] = True
        return req

    def _check_desc(self, raw: Any, rdma: bool) -> RemoteDescriptor | None:
        """Parse a descriptor; with ``rdma`` it must lie in the node's registered slab."""
        try:
            desc = RemoteDescriptor.from_wire(raw) if raw is not None else None
        except TransportError as exc:
            raise P.bad(str(exc)) from exc
        if rdma and desc is not None and not self.slab.contains(desc):  # its key is a window's
            raise P.bad(f"descriptor {raw!r} is outside the node's registered slab")
        return desc

    async def lease(self, keys: Sequence[BlockKey], ttl_s: float | None, rdma: bool = False) -> list[tuple]:
        """``[(status, header, tier, RemoteDescriptor | None)]`` per key; leases live on this
        connection until RELEASE or the connection ends. With ``rdma`` the descriptors point
        into the node's slab, and a HIT without one is a block to GET inline (nothing held)."""
        req = self._one_sided({"op": "LEASE", "keys": [k.raw for k in keys]}, rdma)
        if ttl_s is not None:
            req["ttl"] = ttl_s
        reply = await self._call(req)
        res = reply.get("res")
        if not isinstance(res, list) or len(res) != len(keys):
            raise P.bad("LEASE reply has the wrong number of results")
        out = []
        for item in res:
            if not isinstance(item, list) or len(item) != 4:
                raise P.bad("LEASE result must be [status, header, tier, descriptor]")
            st, hdr, tier = P.get_result_from_wire(item[:3])
            out.append((st, hdr, tier, self._check_desc(item[3], rdma)))
        return out

    async def release(self, handles: Sequence[int]) -> list[bool]:
        reply = await self._call({"op": "RELEASE", "handles": list(handles)})
        return _bools(reply.get("res"), len(handles))

    async def reserve(
        self, headers: Sequence[BlockHeader], rdma: bool = False
    ) -> list[tuple[Status | None, RemoteDescriptor | None]]:
        """Per header ``(None, descriptor)`` for a reserved slot or ``(status, None)``; with
        ``rdma``, ``(None, None)`` is a block to PUT inline (its slot is not in the slab)."""
        req = self._one_sided({"op": "RESERVE", "hdrs": [h.encode() for h in headers]}, rdma)
        reply = await self._call(req)
        res = reply.get("res")
        if not isinstance(res, list) or len(res) != len(headers):
            raise P.bad("RESERVE reply has the wrong number of results")
        out = []
        for item in res:
            if not isinstance(item, list) or len(item) != 2:
                raise P.bad("RESERVE result must be [status, descriptor]")
            desc = self._check_desc(item[1], rdma)
            out.append((P.status_from_wire(item[0]) if item[0] is not None else None, desc))
        return out

    async def commit(self, handles: Sequence[int]) -> list[PutResult]:
        reply = await self._call({"op": "COMMIT", "handles": list(handles)})
        return _put_results(reply.get("res"), len(handles))

    def transport(self) -> TcpTransport:
        """A TCP transport sharing this connection (for descriptors from lease/reserve)."""
        return TcpTransport(self.ch)


def check_payload(hdr: BlockHeader, key: BlockKey, exp: Expect | None, payload: memoryview) -> Status:
    """What a reader must conclude about ``payload`` received for ``key``: HIT, or MISMATCH
    (another block: collision or stale entry), or CORRUPT (checksum)."""
    if not hdr.matches(key, exp.parent if exp else None, exp.token_bytes if exp else None):
        return Status.MISMATCH
    if checksum(payload) != hdr.checksum:
        return Status.CORRUPT
    return Status.HIT


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


def _bools(res: Any, n: int) -> list[bool]:
    if not isinstance(res, list) or len(res) != n:
        raise P.bad("reply has the wrong number of results")
    return [r is True for r in res]


def _put_results(res: Any, n: int) -> list[PutResult]:
    if not isinstance(res, list) or len(res) != n:
        raise P.bad("PUT reply has the wrong number of results")
    out = []
    for item in res:
        if not isinstance(item, list) or len(item) != 3:
            raise P.bad("PUT result must be [status, tier, durable]")
        out.append(
            PutResult(
                P.status_from_wire(item[0]), item[1] if isinstance(item[1], str) else None, item[2] is True
            )
        )
    return out


__all__ = ["Conn", "FrameError", "NodeRefused", "byte_view", "check_payload"]
