"""The connections of a node client: a pool to one node, and what a failure of it means.

:class:`NodeConnections` holds up to ``pool_size`` connections (:class:`~kvstore.client.conn.Conn`,
HELLO'd; an idle one the node closed meanwhile is dropped, not used) and runs each call of the
node client on one of them within its deadline (:meth:`NodeConnections._run`): the call's
result, or the :class:`~kvstore.results.Status` its failure answers. A node that fails
(refused, reset, closed; a call past its deadline too unless a ``late`` judge was given) is
marked down: its calls are then answered at once without asking it (a read: MISS, anything
else: ERROR -- never an answer about a key) until a background probe reconnects. The ops on
top are :class:`kvstore.client.node.NodeClient`'s; this module owns no op.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvstore import protocol as P
from kvstore.address import parse_host_port
from kvstore.client.config import ClientConfig
from kvstore.client.conn import Conn, NodeRefused
from kvstore.client.rdma import ClientRdma
from kvstore.results import Status
from rdma.framing import FrameError
from rdma.transport import TransportError

log = logging.getLogger("kvstore.client.node")
T = TypeVar("T")
# an offloaded receive waits for input in its worker this long at a time (each connection of
# the pool has a worker of its own), so a streamed batch costs one hand-off, not one per EAGAIN
_WORKER_WAIT_S = 0.2
_READ_OPS = frozenset({"GET", P.LeaseRequest.OP})  # a call skipped on a down node: a miss
_FAILURES = (OSError, ConnectionError, FrameError, TransportError, P.ProtocolError, NodeRefused, EOFError)


class NodeConnections:
    """The pool of one node client (see the module docstring). ``rdma``: a ClientRdma shared
    with the other node clients of a cluster client; by default its own. ``late``: who judges
    a call past its deadline, ``late(addr, op, seconds)`` (the cluster client's health:
    kvstore/client/health.py); the node then stays up, its connection closed. Without one, a
    deadline miss marks the node down like a failure."""

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
        self.up = True
        # whether the latest connection to the node negotiated RDMA (every connection offers
        # the same, so the next ones will too): reads and writes then take the descriptor path
        self.one_sided = False
        self.hello: dict[str, Any] | None = None
        self._idle: list[Conn] = []
        self._slots = asyncio.Semaphore(self.cfg.pool_size)
        self._probe: asyncio.Task | None = None
        self._closed = False
        # large payload copies run off the event loop (and in parallel across connections), so
        # a 64 MiB GET does not stall an engine's loop; a cancelled copy is stopped first
        self._copies = ThreadPoolExecutor(max_workers=self.cfg.pool_size, thread_name_prefix="kv-copy")

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
        :meth:`kvstore.client.node.NodeClient.tenant_namespace`, never with a salt the client made up."""
        if self.hello is None:
            got = await self._run("HELLO", _hello_only, deadline_s)
            if isinstance(got, Status) or self.hello is None:
                return None
        salt = self.hello.get("salt")
        return salt if isinstance(salt, str) else ""

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


async def _hello_only(conn: Conn) -> bool:
    return True  # opening the connection made the HELLO
