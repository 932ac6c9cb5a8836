"""The descriptor path of :class:`kvstore.client.node.NodeClient`: GET and PUT the RDMA way.

``get`` runs LEASE -> read -> RELEASE and ``put`` RESERVE -> write ->
COMMIT. The transport moving the bytes is chosen per call: one-sided RDMA READ/WRITE
(:func:`kvstore.client.rdma.move`) when the connection has a queue pair and every local buffer
is registered (``register``), else :class:`rdma.tcp.TcpTransport` (the node copies the leased or
reserved bytes over the connection). Both run the same sequence, so the TCP runs on every
machine test the logic the RDMA runs use. Same failure contract as the rest of the client: a
failed pair is a miss or a dropped write, counted, never an exception. Owned by NodeClient,
which gives it the node's address, its :class:`ClientRdma`, its counters and its ``run``
(a call on a pooled connection within a deadline, or the Status of its failure); NodeClient
counts the results.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvstore import protocol as P
from kvstore.block import BlockHeader, check_block, checksum
from kvstore.client import rdma as client_rdma
from kvstore.client.conn import Conn, byte_view
from kvstore.client.rdma import ClientRdma
from kvstore.client.read import check_read
from kvstore.keys import BlockKey
from kvstore.results import Expect, GetResult, PutResult, Status

# NodeClient._run: (op, fn on a pooled connection, deadline) -> fn's result or a failure's Status
Run = Callable[[str, Callable[[Conn], Awaitable[Any]], float | None], Awaitable[Any]]


class DescriptorPath:
    """The LEASE/RESERVE sequences for one node. ``run`` is NodeClient's: it runs a function
    on a pooled connection within a deadline and answers a Status for a failure."""

    def __init__(self, addr: str, rdma: ClientRdma, counters: Counter[str], run: Run) -> None:
        self.addr = addr
        self.rdma = rdma
        self.counters = counters
        self._run = run

    async def get(
        self,
        keys: Sequence[BlockKey],
        bufs: Sequence[Any],
        expect: Sequence[Expect | None] | None = None,
        deadline_s: float | None = None,
    ) -> list[GetResult] | Status:
        """GET the RDMA way: LEASE (descriptors), one-sided reads, RELEASE. With RDMA (the
        connection has a queue pair and every buffer is registered) the client pulls the bytes
        from the node's slab with RDMA READ, and blocks outside the slab come with GET inline;
        otherwise the node copies the leased bytes over TCP. Same results as :meth:`Conn.get`, or the
        Status of a failed call (the caller counts either)."""
        exp = check_read("read (descriptor path)", keys, bufs, expect)
        views = [byte_view(b) for b in bufs]

        async def go(conn: Conn) -> list[GetResult]:
            one_sided = conn.verbs is not None and self.rdma.covers(views)
            leased = await conn.lease(keys, None, rdma=one_sided)
            out = [
                GetResult(Status.MISS if st is Status.HIT else st, hdr, tier) for st, hdr, tier, _ in leased
            ]
            pairs, idx, inline = [], [], []
            for i, (st, hdr, tier, desc) in enumerate(leased):
                if st is not Status.HIT:
                    continue
                if hdr.payload_len > views[i].nbytes:
                    out[i] = GetResult(Status.BUF_TOO_SMALL, hdr, tier)
                elif desc is None:
                    inline.append(i)  # RDMA asked for, block not in the node's slab
                else:
                    pairs.append((views[i][: hdr.payload_len], desc))
                    idx.append(i)
            done = await self._transfer(conn, "read", pairs, one_sided)
            for i, ok, (dst, _) in zip(idx, done, pairs):
                st, hdr, tier, _ = leased[i]
                out[i] = GetResult(
                    check_block(hdr, keys[i], exp[i], checksum(dst)) if ok else Status.MISS, hdr, tier
                )
            handles = [d.handle for *_, d in leased if d is not None]
            if handles and not conn.closed:
                await conn.release(handles)
            if inline and not conn.closed:
                got = await conn.get(
                    [keys[i] for i in inline], [views[i] for i in inline], [exp[i] for i in inline]
                )
                for i, g in zip(inline, got):
                    out[i] = g
            return out

        return await self._run(P.LeaseRequest.OP, go, deadline_s)

    async def put(
        self, blocks: Sequence[tuple[BlockHeader, Any]], deadline_s: float | None = None
    ) -> list[PutResult] | Status:
        """PUT the RDMA way: RESERVE slots (descriptors), one-sided writes, COMMIT. With RDMA
        (a queue pair and every payload in a registered buffer) the client writes into the
        node's slab with RDMA WRITE, and blocks whose slot is not in the slab are PUT inline.
        A pair that fails is not committed: a dropped write (its slot ends at the lease TTL or
        with the connection). The Status of a failed call (the caller counts either)."""
        for hdr, p in blocks:
            if memoryview(p).nbytes != hdr.payload_len:
                raise ValueError(
                    f"block {hdr.key}: payload is {memoryview(p).nbytes} bytes, header says {hdr.payload_len}"
                )
        views = [memoryview(p).cast("B") for _, p in blocks]

        async def go(conn: Conn) -> list[PutResult]:
            one_sided = conn.verbs is not None and self.rdma.covers(views)
            reserved = await conn.reserve([h for h, _ in blocks], rdma=one_sided)
            out = [PutResult(st or Status.ERROR) for st, _ in reserved]
            idx = [i for i, (_, d) in enumerate(reserved) if d is not None]
            inline = [i for i, (st, d) in enumerate(reserved) if st is None and d is None]
            pairs = [(views[i], reserved[i][1]) for i in idx]
            done = await self._transfer(conn, "write", pairs, one_sided)
            ok = [(i, d) for i, (_, d), good in zip(idx, pairs, done) if good]
            if ok and not conn.closed:
                for (i, _), pr in zip(ok, await conn.commit([d.handle for _, d in ok])):
                    out[i] = pr
            if inline and not conn.closed:
                for i, pr in zip(inline, await conn.put([blocks[i] for i in inline])):
                    out[i] = pr
            return out

        return await self._run(P.ReserveRequest.OP, go, deadline_s)

    async def _transfer(self, conn: Conn, op: str, pairs: list, one_sided: bool) -> list[bool]:
        """Move ``pairs`` one-sidedly (verbs, with fall-back to TCP on failure) or over TCP."""
        if not pairs:
            return []
        if one_sided:
            return await client_rdma.move(conn, op, pairs, self.counters, self.addr)
        t = conn.transport()
        return await (t.read(pairs) if op == "read" else t.write(pairs))
