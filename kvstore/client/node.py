"""The async client of storage nodes: what engines (through the connector) and tools use.

Contract: no method raises for a node problem. A timeout, reset, refused connection or a
node error becomes a miss (reads: ``Status.MISS``/``TIMEOUT``/``ERROR`` per key, ``None`` for
EXISTS, ``False`` for DELETE) or a dropped write (``Status.ERROR``/``TIMEOUT``), counted in
``counters``. A node that fails (refused, reset, closed; a call past its deadline too, unless
a ``late`` judge was given: :class:`NodeClient`) is marked down and skipped (instant misses
for reads, ``Status.ERROR`` for writes: never an answer about a key) until a background
probe reconnects. Every call has a deadline (``deadline_s``, default
``op_timeout_s``).
Caller bugs (a buffer list of the wrong length, a payload that does not match its header)
raise ValueError/TypeError at once.

GET writes straight into caller buffers (bytearray, numpy arrays, contiguous CPU/pinned torch
tensors): the socket ``recv_into``s the bytes, then the payload is checked against its header
(key, expected parent/tokens, xxh3 checksum); a bad block is a miss.

A :class:`NodeClient` holds a pool of up to ``pool_size`` connections to one node; it is bound
to one event loop and safe for concurrent tasks on it. Several nodes are the cluster's
(kvstore/client/cluster.py: placement, replicas, health), reached through the facade.

One read path and one write path: :meth:`NodeClient.get_into` and :meth:`NodeClient.put`.
Each takes the descriptor path (kvstore/client/leased.py: LEASE, one-sided READ, RELEASE;
RESERVE, one-sided WRITE, COMMIT) when this client's connections to the node negotiated RDMA
and every buffer of the call is registered (``register``), else the inline TCP GET / PUT
(bytes in the reply / request frame). ``descriptors = "always"`` takes the descriptor path on
every connection, moving the bytes over TCP where there is no queue pair: the same sequence,
so it can be checked on a host without a device (the tests do; the one-sided RDMA READ and
WRITE themselves need a verbs device and were not run here). ``transport`` (``auto | tcp | rdma``,
:mod:`kvstore.client.rdma`) decides whether a device is opened at all; ``transport = "rdma"``
on a host without a device raises TransportError at construction.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore import protocol as P
from kvstore.address import parse_host_port
from kvstore.block import BlockHeader
from kvstore.client.conn import Conn, NodeRefused, byte_view
from kvstore.client.leased import DescriptorPath
from kvstore.client.rdma import ClientRdma
from kvstore.client.read import BlockRead, check_read, filling
from kvstore.keys import BlockKey, KeyBatch, Namespace
from kvstore.lookups import tier_names
from kvstore.results import Expect, GetResult, GetResults, PutResult, Status
from rdma.framing import FrameError
from rdma.transport import TransportError

log = logging.getLogger("kvstore.client.node")
T = TypeVar("T")
_STRIPE_MIN = 1 << 20  # bytes per stripe below which a batch is not split over connections
# an offloaded receive waits for input in its worker this long at a time (each connection of
# the pool has a worker of its own), so a streamed batch costs one hand-off, not one per EAGAIN
_WORKER_WAIT_S = 0.2
_READ_OPS = frozenset({"GET", P.LeaseRequest.OP})  # a call skipped on a down node: a miss
_FAILURES = (OSError, ConnectionError, FrameError, TransportError, P.ProtocolError, NodeRefused, EOFError)


@dataclass(frozen=True)
class ClientConfig:
    """How a client reaches nodes. ``namespaces`` are the namespaces this client reads and
    writes (without tenant salt: the node applies the salt of the token's tenant).
    ``transport``: ``auto`` (RDMA when this host and the node have a verbs device, else TCP),
    ``tcp`` or ``rdma`` (docs/rdma.md); ``rdma_device``/``rdma_gid_index`` as the node's
    ``server.rdma_*`` keys. ``descriptors``: ``auto`` (the descriptor path where bytes can move
    one-sidedly) or ``always`` (also over TCP; see the module docstring). ``streams``: the
    connections one large inline GET or PUT batch is split over, at most ``pool_size``;
    ``pipeline``: the GET/PUT frames one connection has on the wire ahead of the reply being
    read (docs/configuration.md)."""

    token: str = ""
    tenant: str | None = None
    namespaces: tuple[Namespace, ...] = ()
    pool_size: int = 4
    connect_timeout_s: float = 1.0
    op_timeout_s: float = 5.0
    probe_interval_s: float = 0.5
    transport: str = "auto"
    rdma_device: str = ""
    rdma_gid_index: int = 0
    descriptors: str = "auto"
    streams: int = 4
    pipeline: int = 4

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "tcp", "rdma"):
            raise ValueError(f"transport: expected auto, tcp or rdma, got {self.transport!r}")
        if self.descriptors not in ("auto", "always"):
            raise ValueError(f"descriptors: expected auto or always, got {self.descriptors!r}")
        if self.pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {self.pool_size}")
        if self.streams < 1:
            raise ValueError(f"streams must be >= 1, got {self.streams}")
        if not 1 <= self.pipeline <= 64:
            raise ValueError(f"pipeline must be 1..64, got {self.pipeline}")
        for name in ("connect_timeout_s", "op_timeout_s", "probe_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class NodeClient:
    """Batched ops against one node. See the module docstring for the failure contract.
    ``rdma``: a ClientRdma shared with the other NodeClients of a ClusterClient; by default its own.
    ``late``: who judges a call past its deadline, ``late(addr, op, seconds)`` (the cluster
    client's health: kvstore/client/health.py); the node then stays up, its connection closed.
    Without one, a deadline miss marks the node down like a failure."""

    def __init__(
        self,
        addr: str,
        cfg: ClientConfig | None = None,
        rdma: ClientRdma | None = None,
        late: Callable[[str, str, float], None] | None = None,
    ) -> None:
        self.addr = addr
        self._late = late
        self.host, self.port = parse_host_port(addr, "node address")
        self.cfg = cfg or ClientConfig()
        c = self.cfg
        self._own_rdma = rdma is None
        self.rdma = rdma or ClientRdma(c.transport, c.rdma_device, c.rdma_gid_index)
        self.counters: Counter[str] = Counter()
        self._leased = DescriptorPath(addr, self.rdma, self.counters, self._run)
        self.up = True
        # whether the latest connection to the node negotiated RDMA (every connection offers
        # the same, so the next ones will too): reads and writes then take the descriptor path
        self.one_sided = False
        self.hello: dict[str, Any] | None = None
        self._idle: list[Conn] = []
        self._slots = asyncio.Semaphore(self.cfg.pool_size)
        self._claimed = 0  # connections the GET/PUT calls in flight were split over (_striped)
        self._probe: asyncio.Task | None = None
        self._closed = False
        # large payload copies run off the event loop (and in parallel across connections), so
        # a 64 MiB GET does not stall an engine's loop; a cancelled copy is stopped first
        self._copies = ThreadPoolExecutor(max_workers=self.cfg.pool_size, thread_name_prefix="kv-copy")

    # ---------------------------------------------------------- connections

    async def _open(self) -> Conn:
        c = self.cfg
        qp = self.rdma.offer()  # None over TCP
        try:
            conn = await asyncio.wait_for(
                Conn.open(
                    self.host,
                    self.port,
                    c.token,
                    c.tenant,
                    c.namespaces,
                    self._copies,
                    qp.info if qp is not None else None,
                    _WORKER_WAIT_S,
                    c.pipeline,
                ),
                c.connect_timeout_s,
            )
        except BaseException:
            if qp is not None:
                qp.destroy()
            raise
        try:
            self.rdma.attach(conn, qp, self.addr)
        except BaseException:
            conn.close()
            raise
        self.hello = conn.hello
        self.one_sided = conn.verbs is not None
        return conn

    def _pooled(self) -> Conn | None:
        """An idle connection that can still carry a request: one the node closed meanwhile
        (its idle timeout, a restart) is dropped here rather than failing the next request."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.ch.peer_closed():
                return conn
            conn.close()
            self.counters["stale_connections"] += 1
        return None

    async def _with_conn(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        async with self._slots:
            conn = self._pooled() or await self._open()
            try:
                result = await fn(conn)
            except BaseException:
                conn.close()  # it may be mid-frame
                raise
            if self._closed or conn.closed:
                conn.close()
            else:
                self._idle.append(conn)
            return result

    async def _run(self, op: str, fn: Callable[[Conn], Awaitable[T]], deadline_s: float | None) -> T | Status:
        """``fn`` on a pooled connection within the deadline, or the Status of its failure."""
        if not self.up or self._closed:
            self.counters["skipped"] += 1
            await asyncio.sleep(0)  # an instant answer still yields, so retry loops cannot starve the loop
            # nothing was asked: a read is a miss, anything else failed -- never an answer
            # about the key (a write refused as MISS once read as "deleted there": issue 33)
            return Status.MISS if op in _READ_OPS else Status.ERROR
        t0 = time.monotonic()
        try:
            # wait_for, not asyncio.timeout on this task: with the latter, 32 clients opening
            # their first connections at once missed their connect timeouts
            # (tests/daemon/test_daemon_stress.py, every run; never with wait_for)
            return await asyncio.wait_for(self._with_conn(fn), deadline_s or self.cfg.op_timeout_s)
        except TimeoutError:
            self.counters["timeouts"] += 1
            if self._late is None:
                self._mark_down(op, "deadline passed")
            else:  # a late answer is a busy node's, not a broken one's: health judges
                self._late(self.addr, op, time.monotonic() - t0)
            return Status.TIMEOUT
        except RuntimeError:
            if not self._closed:  # the copy executor refuses work only after close()
                raise
            return Status.ERROR
        except _FAILURES as exc:
            self.counters["errors"] += 1
            if isinstance(exc, NodeRefused) and exc.code == P.AUTH:
                self.counters["auth_refused"] += 1
            if isinstance(exc, NodeRefused) and exc.code not in P.FATAL_CODES and exc.code != P.INTERNAL:
                return Status.ERROR  # the node refused this request only (a client bug); it is up
            self._mark_down(op, f"{type(exc).__name__}: {exc}")
            return Status.ERROR

    def _mark_down(self, op: str, why: str) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        if self.up:
            log.warning("event=node_down node=%s op=%s reason=%r", self.addr, op, why)
            self.up = False
            self.counters["node_down"] += 1
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.cfg.probe_interval_s)
            try:
                conn = await self._open()
            except (TimeoutError, *_FAILURES):
                continue
            if self._closed:
                conn.close()
                return
            self._idle.append(conn)
            self.up = True
            log.info("event=node_up node=%s", self.addr)
            return

    async def salt(self, deadline_s: float | None = None) -> str | None:
        """The namespace salt this node hands this client's tenant at HELLO ("" without auth),
        connecting first when no HELLO was made yet; None when the node cannot be reached.
        Salts are secrets derived by the node (docs/security.md): keys must be computed in
        :meth:`tenant_namespace`, never with a salt the client made up."""
        if self.hello is None:
            got = await self._run("HELLO", _hello_only, deadline_s)
            if isinstance(got, Status) or self.hello is None:
                return None
        salt = self.hello.get("salt")
        return salt if isinstance(salt, str) else ""

    async def tenant_namespace(self, base: Namespace, deadline_s: float | None = None) -> Namespace | None:
        """``base`` salted for this client's tenant, as the node salts it; None when the node
        cannot be reached. See :func:`tenant_namespace` for several nodes."""
        return await tenant_namespace([self], base, deadline_s)

    async def close(self) -> None:
        """Close every connection and stop probing; later calls are instant misses."""
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        self._copies.shutdown(wait=False)
        if self._own_rdma:
            self.rdma.close()

    # ---------------------------------------------------------- ops

    async def exists(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> list[str | None]:
        """Per key: the highest tier holding it (visible to this tenant), or None."""
        return tier_names(await self.exists_codes(KeyBatch.of(keys), deadline_s))

    async def exists_codes(self, keys: KeyBatch, deadline_s: float | None = None) -> bytes:
        """:meth:`exists` of packed keys: one tier code byte per key (kvstore.lookups; 0 where
        absent, also for a node that fails), without a per-key object."""
        if not len(keys):
            return b""
        self.counters["exists_keys"] += len(keys)  # what a cluster lookup costs each node
        r = await self._run("EXISTS", lambda c: _packed(keys, c.exists_keys, c.exists), deadline_s)
        return bytes(len(keys)) if isinstance(r, Status) else r

    async def get_into(
        self,
        keys: Sequence[BlockKey],
        bufs: Sequence[Any],
        expect: Sequence[Expect | None] | None = None,
        deadline_s: float | None = None,
    ) -> GetResults:
        """Fill ``bufs[i]`` with block ``keys[i]``'s payload; HIT only when it arrived whole and
        verified. Bytes of a buffer whose result is not HIT are unspecified. The descriptor
        path or the inline GET, as the module docstring says; the same results either way,
        as one :class:`~kvstore.results.GetResults` (a sequence of GetResult, one per key)."""
        return await self._read(keys, bufs, expect, deadline_s, self.cfg.descriptors == "always")

    def read(
        self,
        keys: Sequence[BlockKey],
        bufs: Sequence[Any],
        expect: Sequence[Expect | None] | None = None,
        deadline_s: float | None = None,
    ) -> BlockRead:
        """The one read (kvstore/client/read.py): :meth:`get_into` into ``bufs``, nothing lent."""
        return filling(self.get_into, keys, bufs, expect, deadline_s)

    async def _read(self, keys, bufs, expect, deadline_s: float | None, descriptors: bool) -> GetResults:
        exp = check_read("get_into", keys, bufs, expect)
        views = [byte_view(b) for b in bufs]
        if descriptors or (self.one_sided and self.rdma.covers(views)):
            return self._count_gets(await self._leased.get_into(keys, views, exp, deadline_s), len(keys))
        parts = [
            self._count_gets(r, j - i)
            for (i, j), r in await self._striped(
                "GET",
                [v.nbytes for v in views],
                lambda c, i, j: c.get_into(keys[i:j], views[i:j], exp[i:j]),
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
        once, so ``get_into``/``put`` through it can move its bytes one-sidedly; a no-op over
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

    async def delete(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> list[bool]:
        """Per key: True where it was stored (for this tenant) and is now gone."""
        return list(map(bool, await self.delete_packed(KeyBatch.of(keys), deadline_s)))

    async def delete_packed(self, keys: KeyBatch, deadline_s: float | None = None) -> bytes:
        """:meth:`delete` of packed keys: per key 1 (deleted) or 0 (also for a node that fails)."""
        if not len(keys):
            return b""
        r = await self._run("DELETE", lambda c: _packed(keys, P.MAX_BATCH, c.delete), deadline_s)
        return bytes(len(keys)) if isinstance(r, Status) else r

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


async def _hello_only(conn: Conn) -> bool:
    return True  # opening the connection made the HELLO


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
