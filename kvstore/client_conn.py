"""One client connection to a node's data port, and the wire side of each op.

:class:`Conn` owns a :class:`rdma.tcp.SocketChannel` after a successful HELLO and runs one
request at a time. Methods raise ConnectionError/FrameError/ProtocolError (connection now
unusable: the caller closes it) or :class:`NodeRefused` (the node answered with an error that
closed the connection, e.g. a refused token); per-key failures are results, not exceptions.
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
from rdma.transport import RemoteDescriptor, TransportError

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
    ) -> Conn:
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
                }
            )
            reply = await ch.recv_header(P.MAX_HEADER, P.MAX_HEADER)
            if not reply.get("ok"):
                raise NodeRefused(str(reply.get("code")), str(reply.get("err")))
        except BaseException:
            ch.close()
            raise
        return cls(ch, reply)

    def close(self) -> None:
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

    async def lease(self, keys: Sequence[BlockKey], ttl_s: float | None) -> list[tuple]:
        """``[(status, header, tier, RemoteDescriptor | None)]`` per key; leases live on this
        connection until RELEASE or the connection ends."""
        req: dict[str, Any] = {"op": "LEASE", "keys": [k.raw for k in keys]}
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
            try:
                desc = RemoteDescriptor.from_wire(item[3]) if item[3] is not None else None
            except TransportError as exc:
                raise P.bad(str(exc)) from exc
            out.append((st, hdr, tier, desc))
        return out

    async def release(self, handles: Sequence[int]) -> list[bool]:
        reply = await self._call({"op": "RELEASE", "handles": list(handles)})
        return _bools(reply.get("res"), len(handles))

    async def reserve(
        self, headers: Sequence[BlockHeader]
    ) -> list[tuple[Status | None, RemoteDescriptor | None]]:
        reply = await self._call({"op": "RESERVE", "hdrs": [h.encode() for h in headers]})
        res = reply.get("res")
        if not isinstance(res, list) or len(res) != len(headers):
            raise P.bad("RESERVE reply has the wrong number of results")
        out = []
        for item in res:
            if not isinstance(item, list) or len(item) != 2:
                raise P.bad("RESERVE result must be [status, descriptor]")
            try:
                desc = RemoteDescriptor.from_wire(item[1]) if item[1] is not None else None
            except TransportError as exc:
                raise P.bad(str(exc)) from exc
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
