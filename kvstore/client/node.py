"""The async client of one storage node: what tools and the cluster client use.

Contract: no method raises for a node problem. A timeout, reset, refused connection or a
node error becomes a miss (reads: ``Status.MISS``/``TIMEOUT``/``ERROR`` per key, code 0 for
a lookup, ``False`` for DELETE) or a dropped write (``Status.ERROR``/``TIMEOUT``), counted in
``counters``. A node that fails is marked down and skipped until a background probe
reconnects (kvstore/client/pool.py: the connections and what a failure means). Every call
has a deadline (``deadline_s``, default ``op_timeout_s``). Caller bugs (a buffer list of the
wrong length, a payload that does not match its header) raise ValueError/TypeError at once.

A read fills caller buffers (bytearray, numpy arrays, contiguous CPU/pinned torch tensors):
the socket ``recv_into``s the bytes, then the payload is checked against its header (key,
expected parent/tokens, xxh3 checksum); a bad block is a miss.

A :class:`NodeClient` holds a pool of up to ``pool_size`` connections to one node; it is bound
to one event loop and safe for concurrent tasks on it. Several nodes are the cluster's
(kvstore/client/cluster.py: placement, replicas, health), reached through the facade.

One lookup, one read path and one write path: :meth:`NodeClient.lookup`,
:meth:`NodeClient.read` (kvstore/client/read.py; ``get_into`` there is a function over it) and
:meth:`NodeClient.put`. Reads and writes take the descriptor path (kvstore/client/leased.py:
LEASE, one-sided READ, RELEASE; RESERVE, one-sided WRITE, COMMIT) when this client's
connections to the node negotiated RDMA and every buffer of the call is registered
(``register``), else the inline TCP GET / PUT (bytes in the reply / request frame).
``descriptors = "always"`` takes the descriptor path on every connection, moving the bytes
over TCP where there is no queue pair: the same sequence, so it can be checked on a host
without a device (the tests do; the one-sided RDMA READ and WRITE themselves need a verbs
device and were not run here). ``transport`` (``auto | tcp | rdma``,
:mod:`kvstore.client.rdma`) decides whether a device is opened at all; ``transport = "rdma"``
on a host without a device raises TransportError at construction.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from kvstore import protocol as P
from kvstore.block import BlockHeader
from kvstore.client.conn import Conn, byte_view
from kvstore.client.leased import DescriptorPath
from kvstore.client.pool import NodeConnections
from kvstore.client.read import BlockRead, ReadBuffers, ReadExpects, ReadKeys, filling
from kvstore.keys import BlockKey, KeyBatch, Namespace
from kvstore.lookups import LookupResult
from kvstore.results import Expect, GetResult, GetResults, PutResult, Status

log = logging.getLogger("kvstore.client.node")
T = TypeVar("T")
_STRIPE_MIN = 1 << 20  # bytes per stripe below which a batch is not split over connections


class NodeClient(NodeConnections):
    """Batched ops against one node, over its pool (kvstore/client/pool.py: the connections,
    the failure contract, ``rdma`` and ``late``). See the module docstring."""

    _claimed: int = 0  # connections the GET/PUT calls in flight were split over (_striped)

    @functools.cached_property
    def _leased(self) -> DescriptorPath:
        """The descriptor (RDMA-shaped) path over this pool, made on first use."""
        return DescriptorPath(self.addr, self.rdma, self.counters, self._run)

    async def tenant_namespace(self, base: Namespace, deadline_s: float | None = None) -> Namespace | None:
        """``base`` salted for this client's tenant, as the node salts it; None when the node
        cannot be reached. See :func:`tenant_namespace` for several nodes."""
        return await tenant_namespace([self], base, deadline_s)

    async def lookup(
        self, keys: KeyBatch | Sequence[BlockKey], deadline_s: float | None = None
    ) -> LookupResult:
        """The one lookup: per key the best tier this node holds it in for this tenant, one
        code byte (kvstore.lookups; 0 where absent, and for every key when the node fails),
        in EXISTS requests of at most what the node takes."""
        batch = KeyBatch.of(keys)
        if not len(batch):
            return LookupResult.empty(batch)
        self.counters["exists_keys"] += len(batch)  # what a cluster lookup costs each node
        r = await self._run("EXISTS", lambda c: _packed(batch, c.exists_keys, c.exists), deadline_s)
        return LookupResult.empty(batch) if isinstance(r, Status) else LookupResult.of(batch, r)

    def read(
        self, keys: ReadKeys, bufs: ReadBuffers, expect: ReadExpects = None, deadline_s: float | None = None
    ) -> BlockRead:
        """The one read (kvstore/client/read.py): fills ``bufs`` (nothing lent) by the
        descriptor path or the inline GET, as the module docstring says; the same results
        either way, as one :class:`~kvstore.results.GetResults` (a sequence of GetResult, one
        per key). HIT only when a block arrived whole and verified."""
        return filling(self._fill, keys, bufs, expect, deadline_s)

    async def _fill(
        self,
        keys: Sequence[BlockKey],
        bufs: Sequence[Any],
        exp: list[Expect | None],
        deadline_s: float | None,
    ) -> GetResults:
        views = [byte_view(b) for b in bufs]
        if self.cfg.descriptors == "always" or (self.one_sided and self.rdma.covers(views)):
            return self._count_gets(await self._leased.get(keys, views, exp, deadline_s), len(keys))
        parts = [
            self._count_gets(r, j - i)
            for (i, j), r in await self._striped(
                "GET",
                [v.nbytes for v in views],
                lambda c, i, j: c.get(keys[i:j], views[i:j], exp[i:j]),
                deadline_s,
            )
        ]
        return GetResults.join(parts) if parts else GetResults.failed(Status.MISS, 0)

    async def _striped(
        self,
        op: str,
        sizes: list[int],
        fn: Callable[[Conn, int, int], Awaitable[T]],
        deadline_s: float | None,
    ) -> list[tuple[tuple[int, int], T | Status]]:
        """``fn(conn, i, j)`` for each stripe ``[i, j)`` of a batch, on its own pooled connection,
        all at once: a batch of at least ``streams`` × ``_STRIPE_MIN`` bytes is cut into
        ``streams`` runs of about equal bytes (so the node's and this client's copies run on
        several cores), at most as many as the pool has connections not claimed by other
        GET/PUT calls in flight; a smaller batch is one run. Per stripe its range and ``fn``'s result or
        the Status of its failure (a stripe that fails does not fail the others)."""
        # stripes only over connections no other call has claimed: calls in flight together
        # (a cluster's chunked writes) keep one connection each, as before, rather than
        # queueing their stripes behind each other's past their deadlines
        free = self.cfg.pool_size - self._claimed
        runs = _stripes(sizes, max(1, min(self.cfg.streams, free)))
        self._claimed += len(runs)
        try:
            if len(runs) == 1:
                return [(runs[0], await self._run(op, lambda c: fn(c, *runs[0]), deadline_s))]
            got = await asyncio.gather(*(self._run(op, lambda c, r=r: fn(c, *r), deadline_s) for r in runs))
            return list(zip(runs, got))
        finally:
            self._claimed -= len(runs)

    def register(self, buf: Any) -> None:
        """Register a staging buffer (writable, contiguous; numpy, bytearray, pinned tensor)
        once, so reads and ``put`` through it can move its bytes one-sidedly; a no-op over
        TCP. Calls whose buffers are not all registered take the inline path."""
        self.rdma.register(buf)

    def _count_gets(self, r: Sequence[GetResult] | Status, n: int) -> GetResults:
        """``r`` (a read's results, or the Status of its failure for ``n`` keys) as one
        GetResults, counted: hits, misses, corrupt, bytes in."""
        if isinstance(r, Status):
            self.counters["misses"] += n
            return GetResults.failed(r, n)
        res = GetResults.of(r)
        hits = res.count_of(Status.HIT)
        for name, k in (
            ("hits", hits),
            ("misses", len(res) - hits),
            ("corrupt", res.count_of(Status.CORRUPT)),
        ):
            if k:
                self.counters[name] += k
        self.counters["bytes_in"] += res.hit_bytes
        return res

    async def put(
        self, blocks: Sequence[tuple[BlockHeader, Any]], deadline_s: float | None = None
    ) -> list[PutResult]:
        """Store blocks (header, payload bytes-like). A failure drops the writes (counted). The
        descriptor path or the inline PUT, as the module docstring says."""
        return await self._write(blocks, deadline_s, self.cfg.descriptors == "always")

    async def _write(self, blocks, deadline_s: float | None, descriptors: bool) -> list[PutResult]:
        if not blocks:
            return []
        one_sided = self.one_sided and self.rdma.covers([memoryview(p).cast("B") for _, p in blocks])
        if descriptors or one_sided:
            return self._count_puts(await self._leased.put(blocks, deadline_s), blocks)
        out: list[PutResult] = []
        for (i, j), r in await self._striped(
            "PUT", [h.payload_len for h, _ in blocks], lambda c, i, j: c.put(blocks[i:j]), deadline_s
        ):
            out += self._count_puts(r, blocks[i:j])
        return out

    def _count_puts(
        self, r: list[PutResult] | Status, blocks: Sequence[tuple[BlockHeader, Any]]
    ) -> list[PutResult]:
        if isinstance(r, Status):
            self.counters["dropped_writes"] += len(blocks)
            return [PutResult(r)] * len(blocks)
        statuses = [p.status for p in r]
        stored = sum(map(statuses.count, (Status.STORED, Status.EXISTS, Status.HIT)))
        dropped = statuses.count(Status.ERROR)  # a pair this client failed to move, or the node to store
        for name, n in (
            ("stored", stored),
            ("dropped_writes", dropped),
            ("refused_writes", len(r) - stored - dropped),
        ):
            if n:
                self.counters[name] += n
        self.counters["bytes_out"] += sum(h.payload_len for h, _ in blocks)
        return r

    async def delete(
        self, keys: KeyBatch | Sequence[BlockKey], deadline_s: float | None = None
    ) -> list[bool]:
        """Per key: True where it was stored (for this tenant) and is now gone (False for every
        key when the node fails)."""
        batch = KeyBatch.of(keys)
        if not len(batch):
            return []
        r = await self._run("DELETE", lambda c: _packed(batch, P.MAX_BATCH, c.delete), deadline_s)
        return [False] * len(batch) if isinstance(r, Status) else list(map(bool, r))

    async def stats(self, deadline_s: float | None = None) -> dict[str, Any] | None:
        r = await self._run("STATS", lambda c: c.stats(), deadline_s)
        return None if isinstance(r, Status) else r


async def _packed(keys: KeyBatch, n: int, fn: Callable[[KeyBatch], Awaitable[bytes]]) -> bytes:
    """``fn`` over ``keys`` in parts of at most ``n``, its per-key bytes joined."""
    if len(keys) <= n:
        return await fn(keys)
    return b"".join([await fn(keys[i : i + n]) for i in range(0, len(keys), n)])


def _stripes(sizes: Sequence[int], streams: int) -> list[tuple[int, int]]:
    """``[i, j)`` runs of ``sizes``, at most ``streams`` of them, cut where the running byte
    count passes each ``1/streams`` of the total; one run below ``streams * _STRIPE_MIN``."""
    total = sum(sizes)
    n = min(streams, len(sizes), max(1, total // _STRIPE_MIN))
    if n <= 1:
        return [(0, len(sizes))]
    out, start, acc, k = [], 0, 0, 1
    for idx, s in enumerate(sizes):
        acc += s
        if k < n and acc * n >= k * total and idx + 1 < len(sizes):
            out.append((start, idx + 1))
            start, k = idx + 1, k + 1
    out.append((start, len(sizes)))
    return out


async def tenant_namespace(
    nodes: Sequence[NodeClient], base: Namespace, deadline_s: float | None = None
) -> Namespace | None:
    """``base`` salted for the clients' tenant as the nodes salt it (all nodes of a cluster
    share the salt secret, so they agree; one that does not is logged and outvoted by the
    first answer). None when no node answers. Without auth the salt is "" and ``base`` comes
    back as it is."""
    salts = await asyncio.gather(*(n.salt(deadline_s) for n in nodes))
    known = [s for s in salts if s is not None]
    if not known:
        return None
    if len(set(known)) > 1:
        log.warning(
            "event=salt_mismatch nodes=%d note='nodes hold different auth.salt_secret_file'", len(known)
        )
    return base.with_tenant(known[0]) if known[0] else base
