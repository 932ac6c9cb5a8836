"""The replicated cluster client: many storage nodes as one store.

Contract: a :class:`~kvstore.client.api.StoreClient` (what ``kvstore.client.open`` returns for
``kvstore://`` and ``etcd://``): ``lookup``, ``read``, ``put``, ``delete`` take a deadline and
never raise for a node or membership problem; a failure is a miss (code 0 / a non-HIT status),
a dropped write or ``False``, counted in ``counters``. Caller bugs (buffer count) raise
ValueError at once.
Every call is bounded by its caller's deadline and by nothing shorter: a connection's set-up
is bounded by the call's deadline and ``ClusterConfig.connect_timeout_s``, never by the
node client's shorter ``connect_timeout_s`` (a late HELLO must not mark a node down).

- ``await start()``: the first membership view, then ``pool_size`` connections to every
  member opened and HELLO'd, so no request pays for connection set-up (members that join
  later are warmed up in the background).
- Placement: weighted rendezvous over the *healthy* members (kvstore/client/placement.py);
  a key's owners are its first ``replicas`` nodes, on distinct nodes and zones.
- Lookups (kvstore/client/lookup.py): each key goes to its owners only (its first
  ``replicas`` healthy nodes; batched EXISTS, all in parallel); the keys no owner holds then go
  to the next ``lookahead`` nodes in their rendezvous order, which find blocks whose owner
  changed when a node joined. A key is present when any of its first ``replicas + lookahead``
  nodes has it; its tier is the best its owners hold (a lookahead node's for a block no owner
  holds); ``hit_blocks`` is the longest prefix over replicas. Each key's rendezvous
  order is cached per healthy view (a bounded LRU), so repeated prompts skip the hashing.
- Transfers: node clients share one :class:`~kvstore.client.rdma.ClientRdma` (one device
  probe, at most one device opened, buffers registered once with ``register``); reads and
  writes take the descriptor path to nodes that negotiated RDMA (kvstore/client/node.py).
- Reads: kvstore/client/reads.py. Writes: kvstore/client/writes.py (``put``'s report tells
  exactly what was stored, under-replicated and dropped). Both are objects this client owns,
  given it as their :class:`~kvstore.client.route.Route` (node clients, healthy view,
  rendezvous order, connection set-up, timed fan-out) and its counters.
- Health: kvstore/client/health.py; a node marked down is skipped until it is readmitted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import numpy as np

from kvstore.block import BlockHeader
from kvstore.client.api import PutReport
from kvstore.client.config import ClientConfig, ClusterConfig
from kvstore.client.health import SLOW, Health
from kvstore.client.lookup import Lookups
from kvstore.client.membership import Membership, StaticMembership
from kvstore.client.node import NodeClient, tenant_namespace
from kvstore.client.placement import Node, RankCache
from kvstore.client.rdma import ClientRdma
from kvstore.client.read import BlockRead, ReadBuffers, ReadExpects, ReadKeys, filling
from kvstore.client.readrepair import Repairer
from kvstore.client.reads import ClusterReads
from kvstore.client.writes import ClusterWrites
from kvstore.keys import BlockKey, KeyBatch, Namespace
from kvstore.lookups import LookupResult
from kvstore.results import Status

log = logging.getLogger("kvstore.client")
_RANK_CACHE_MAX = 1 << 17  # keys whose rendezvous order is kept (16 prompts of 128K tokens)
_WARM_KEYS = KeyBatch(bytes(16))  # EXISTS of this key opens and HELLOs a connection, nothing more

__all__ = ["ClusterClient", "ClusterConfig", "PutReport"]


class ClusterClient:
    """Bound to the event loop of its first call. See the module docstring. TransportError at
    construction when ``transport`` is ``rdma`` and this host has no RDMA device."""

    in_process = False

    def __init__(
        self,
        membership: Membership,
        client_cfg: ClientConfig | None = None,
        cfg: ClusterConfig | None = None,
    ) -> None:
        self.membership = membership
        self.client_cfg = client_cfg or ClientConfig()
        self.cfg = cfg or ClusterConfig()
        # the call's deadline bounds a connection's set-up; the node client's own (short)
        # connect timeout would mark a node down for a late HELLO under a long deadline
        self._node_cfg = dataclasses.replace(self.client_cfg, connect_timeout_s=self.cfg.connect_timeout_s)
        c = self.client_cfg
        self.rdma = ClientRdma(c.transport, c.rdma_device, c.rdma_gid_index)  # one device for all nodes
        self.nodes: dict[str, NodeClient] = {}
        self._weights: dict[str, Node] = {}
        self.health = Health(self.nodes, self.cfg)
        self._seen = -1
        self._view: list[Node] = []
        self._view_key: tuple = ()
        self._rank_cache = RankCache(_RANK_CACHE_MAX)
        self._own_counters: Counter[str] = Counter()
        self._started = False
        self._closed = False
        self._warming: set[asyncio.Task] = set()
        self._stragglers: set[asyncio.Future] = set()  # lookups' late node calls, left to finish
        self._warm_joiners = False  # set by start(connect=True)
        self._warmed: set[str] = set()  # members whose connections were opened once
        self.repairer = Repairer(self.nodes, self.healthy, self.cfg.repair_max_blocks)
        self._reads = ClusterReads(
            self, self.health, self.repairer, self.cfg, self.client_cfg, self._own_counters
        )
        self._writes = ClusterWrites(self, self.cfg, self.client_cfg, self._own_counters)
        self._lookups = Lookups(
            self,
            self._rank_cache,
            self.cfg,
            self.client_cfg.op_timeout_s,
            self._own_counters,
            self._stragglers,
        )

    @classmethod
    def static(cls, addrs: Sequence[str], client_cfg=None, cfg=None) -> ClusterClient:
        """A fixed list of ``host:port`` addresses (``kvstore://a,b,c``)."""
        return cls(StaticMembership(list(addrs)), client_cfg, cfg)

    @classmethod
    def etcd(cls, url: str, client_cfg=None, cfg=None) -> ClusterClient:
        """Members from etcd (``etcd://host:port[,host:port]/CLUSTER``), watched."""
        from kvstore.client.etcd_membership import EtcdMembership

        return cls(EtcdMembership(url), client_cfg, cfg)

    # ---------------------------------------------------------------- membership and health

    def register(self, buf: Any) -> None:
        """Register a staging buffer once for every node (see NodeClient.register)."""
        self.rdma.register(buf)

    async def start(self, wait_s: float = 2.0, connect: bool = True) -> None:
        """Load the first membership view (waiting up to ``wait_s`` for etcd), then, with
        ``connect``, open and HELLO ``pool_size`` connections to every member within
        ``wait_s``. Never raises: a member that cannot be reached is marked down and probed.
        Call it at engine start; the first operation calls it (without ``connect``) when
        nobody did."""
        if not self._started:
            self._started = True
            await self.membership.start(wait_s)
        self._sync()
        if connect and not self._closed:
            self._warm_joiners = True
            await self._warm(list(self.nodes), wait_s)

    async def _warm(self, addrs: list[str], deadline_s: float) -> None:
        """Fill each node client's pool: ``pool_size`` concurrent EXISTS of one key."""

        async def one(addr: str) -> None:
            node = self.nodes.get(addr)
            if node is not None:
                n = self.client_cfg.pool_size
                await asyncio.gather(*(node.lookup(_WARM_KEYS, deadline_s) for _ in range(n)))
                self.health.after_call(addr)
                if node.up:
                    self._warmed.add(addr)

        await asyncio.gather(*(one(a) for a in addrs))
        self._own_counters["connections_warmed"] += len(addrs) * self.client_cfg.pool_size

    def _sync(self) -> None:
        if self.membership.version == self._seen:
            return
        self._seen = self.membership.version
        current = {m.addr: m for m in self.membership.members}
        for addr in list(self.nodes):
            if addr not in current:
                node = self.nodes.pop(addr)
                self.health.forget(addr)
                self._warmed.discard(addr)
                self._weights.pop(addr, None)
                asyncio.get_running_loop().create_task(node.close())
                log.info("event=member_left node=%s", addr)
        for addr, m in current.items():
            if addr not in self.nodes:
                # a call past its deadline is lateness for health to judge, not a failure
                self.nodes[addr] = NodeClient(addr, self._node_cfg, self.rdma, self.health.timed_out)
                log.info("event=member_joined node=%s zone=%s", addr, m.zone)
                if self._warm_joiners and not self._closed:  # joined after start(): warm it up now
                    t = asyncio.get_running_loop().create_task(self._warm([addr], self.cfg.connect_timeout_s))
                    self._warming.add(t)
                    t.add_done_callback(self._warming.discard)
            self._weights[addr] = m.node

    async def connect(self, addrs: Iterable[str], deadline_s: float) -> None:
        """Open and HELLO the connections of those ``addrs`` never reached (Route)."""
        cold = [a for a in addrs if a not in self._warmed]
        if cold:
            await self._warm(cold, deadline_s)

    def healthy(self, addr: str) -> bool:
        return self.health.healthy(addr)

    async def healthy_view(self, deadline_s: float | None = None) -> list[Node]:
        if not self._started:
            await self.start(min(2.0, deadline_s or self.client_cfg.op_timeout_s), connect=False)
        self._sync()
        self.health.start()  # the loop-lag monitor, on this client's loop
        view = [n for a, n in sorted(self._weights.items()) if self.healthy(a)]
        key = tuple(view)
        if key != self._view_key:
            self._view_key, self._view = key, view
            self._rank_cache.reset(view, self.cfg.replicas)  # placement changed
        return self._view

    def standby(self) -> list[Node]:
        """Members out only for being slow, connection up (Route): a slow copy beats none."""
        return [
            n
            for a, n in sorted(self._weights.items())
            if self.health.why_out(a) in SLOW and a in self.nodes and self.nodes[a].up
        ]

    def ranks(self, keys: KeyBatch) -> list[tuple[str, ...]]:
        """Per key, the healthy view's addresses in its rendezvous order (owners first),
        cached; the whole batch in one probe."""
        return self._rank_cache.orders_of(keys)

    async def timed(self, addr: str, op: str, aw: Awaitable):
        """Await one node call and feed its time (and GET payload bytes) to health; a call that
        went past its deadline was reported by the node client already (Health.timed_out)."""
        node = self.nodes.get(addr)
        timeouts = node.counters["timeouts"] if node is not None else 0
        t0 = time.monotonic()
        res = await aw
        if node is not None and node.counters["timeouts"] != timeouts:
            return res
        nbytes = sum(r.header.payload_len for r in res if r.status is Status.HIT) if op == "get" else 0
        self.health.observe(addr, time.monotonic() - t0, nbytes, op)
        return res

    async def fan(
        self, groups: dict[str, list[int]], call: Callable[[NodeClient, list[int]], Awaitable], op: str = ""
    ):
        addrs = list(groups)
        results = await asyncio.gather(*(self.timed(a, op, call(self.nodes[a], groups[a])) for a in addrs))
        return zip(addrs, results)

    # ---------------------------------------------------------------- lookups

    async def lookup(
        self, keys: KeyBatch | Sequence[BlockKey], deadline_s: float | None = None
    ) -> LookupResult:
        """The one lookup: per key the best tier its owners hold it in; for a key no owner
        holds, the best of the next ``lookahead`` nodes (code 0: nowhere); as a
        :class:`~kvstore.lookups.LookupResult` (its ``hit_blocks``: the held prefix), to hand
        back to a load or save of the same keys. kvstore/client/lookup.py."""
        batch = KeyBatch.of(keys)
        return LookupResult.of(batch, await self._lookups.codes(batch, deadline_s))

    async def delete(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> list[bool]:
        """Delete from every candidate node; True where any copy was deleted."""
        batch = KeyBatch.of(keys)
        done = np.zeros(len(batch), dtype=np.uint8)
        view = await self.healthy_view(deadline_s)
        if not len(batch) or not view:
            return [False] * len(batch)
        hi = self.cfg.replicas + self.cfg.lookahead
        groups = self._lookups.plan(batch, 0, hi, view)
        for addr, res in await self.fan(
            groups, lambda n, idx: n.delete(batch.take(idx), deadline_s), "delete"
        ):
            done[groups[addr]] |= np.asarray(res, dtype=np.uint8)
        return done.astype(bool).tolist()

    # ---------------------------------------------------------------- reads and writes

    def read(
        self, keys: ReadKeys, bufs: ReadBuffers, expect: ReadExpects = None, deadline_s: float | None = None
    ) -> BlockRead:
        """The one read (kvstore/client/read.py): each buffer filled from the first candidate
        node that has its block whole and verified, nothing lent (kvstore/client/reads.py)."""
        return filling(self._reads.fill, keys, bufs, expect, deadline_s)

    async def put(
        self, blocks: Sequence[tuple[BlockHeader, Any]], deadline_s: float | None = None
    ) -> PutReport:
        """Store ``blocks`` on their owners and say what happened (kvstore/client/writes.py);
        the report is also the sequence of each block's best replica result."""
        return await self._writes.put(blocks, deadline_s)

    async def stats(self, deadline_s: float | None = None) -> dict[str, dict[str, Any] | None]:
        """Per member (down ones too): its STATS document, None when it did not answer."""
        self._sync()
        addrs = sorted(self.nodes)
        got = await asyncio.gather(*(self.nodes[a].stats(deadline_s) for a in addrs))
        return dict(zip(addrs, got))

    # ---------------------------------------------------------------- the rest

    async def tenant_namespace(self, base: Namespace, deadline_s: float | None = None) -> Namespace | None:
        """``base`` salted as the members salt this client's tenant (the salt each hands out at
        HELLO; members share the salt secret); None when no member answers."""
        await self.healthy_view(deadline_s)  # the first membership view, when nobody loaded it
        return await tenant_namespace(list(self.nodes.values()), base, deadline_s)

    @property
    def counters(self) -> Counter[str]:
        """The cluster's counters and the sum of the node clients'. Writes: ``stored`` and
        ``node_write_failures`` count block writes per node (a failed call, a refused block);
        ``blocks_stored_nowhere`` / ``blocks_under_replicated`` / ``writes_redirected`` count
        blocks of ``put`` calls."""
        total: Counter[str] = Counter()
        for n in self.nodes.values():
            total.update(n.counters)
        total["node_write_failures"] = total.pop("dropped_writes", 0) + total.pop("refused_writes", 0)
        total.update(self._own_counters)
        total.update(self.health.counters)
        total.update(self.repairer.counters)
        return total

    def time_out(self) -> dict[str, float]:
        """Per member: seconds it spent out of the healthy view since this client started."""
        self._sync()
        return self.health.time_out()

    def live_addrs(self) -> list[str]:
        """Members currently used (healthy), sorted."""
        self._sync()
        return sorted(a for a in self.nodes if self.healthy(a))

    async def close(self) -> None:
        """Stop probing and watching; close every node client. Later calls are misses."""
        self._closed = True
        for t in (*self._warming, *self._stragglers):
            t.cancel()
        self.health.close()
        self.repairer.close()
        await self.membership.close()
        await asyncio.gather(*(n.close() for n in self.nodes.values()))
        self.rdma.close()
        self._weights.clear()
        self._rank_cache.reset((), self.cfg.replicas)
        self._lookups.hints.clear()
        self._view, self._view_key = [], ()
        self._seen = self.membership.version
