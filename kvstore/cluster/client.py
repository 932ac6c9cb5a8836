"""The replicated cluster client: many storage nodes as one store.

Contract (the same as :class:`kvstore.client.StoreClient`, so the connector can use either):
``exists``, ``get_into``, ``put``, ``delete`` take a deadline and never raise for a node or
membership problem; a failure is a miss (``None`` / a non-HIT status), a dropped write or
``False``, counted in ``counters``. Caller bugs (buffer count) raise ValueError at once.

- Placement: weighted rendezvous over the *healthy* members (kvstore/cluster/placement.py);
  a key's owners are its first ``replicas`` nodes, on distinct nodes and zones.
- Lookups: one batched EXISTS per node, all nodes in parallel; a key is present when any of
  its first ``replicas + lookahead`` nodes has it (``lookahead`` finds blocks whose owner
  changed when a node joined). :meth:`lookup_prefix` is the longest prefix over replicas.
- Reads: each key goes to its first candidate; a key that misses there (or whose node fails)
  goes to the next in a following round, while the deadline lasts. A round that can still
  fall back waits at most ``hedge`` of the time left, so one dead or slow node costs at most
  part of one deadline.
- Read repair: a block found past its owners (after a join) is copied to the owners that
  missed it, in the background, so hits survive further joins.
- Writes: to all owners in parallel (the connector sends them behind the request); an owner
  that fails is replaced by the next node in rendezvous order while time remains.
- Health: a node whose call fails or misses its deadline is marked down (the node client
  does that) and skipped; it is used again only after it reconnects *and* answers a probe
  within ``probe_deadline_s``, so a node slower than the deadline stays out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.block import BlockHeader
from kvstore.client import ClientConfig, NodeClient
from kvstore.cluster.health import Health
from kvstore.cluster.membership import Membership, StaticMembership
from kvstore.cluster.placement import Node, rank
from kvstore.cluster.repair import Repairer
from kvstore.keys import BlockKey
from kvstore.results import Expect, GetResult, PutResult, Status

log = logging.getLogger("kvstore.cluster")
_TIER_ORDER = {"hbm": 0, "dram": 1, "disk": 2}
_RANK_CACHE_MAX = 1 << 17


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 2
    lookahead: int = 1  # nodes past the owners that lookups and reads also ask
    hedge: float = 0.5  # share of the time left one read round may take when a fallback exists
    probe_interval_s: float = 0.5
    probe_deadline_s: float = 0.25  # a down node must answer a probe this fast to be used again
    read_repair: bool = True  # copy a block read from a non-owner to the owners that missed it
    repair_max_blocks: int = 256  # repairs in flight at most; more are skipped (counted)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if not 0 < self.hedge <= 1:
            raise ValueError(f"hedge must be in (0, 1], got {self.hedge}")
        for name in ("probe_interval_s", "probe_deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class ClusterClient:
    """Bound to the event loop of its first call. See the module docstring."""

    def __init__(
        self,
        membership: Membership,
        client_cfg: ClientConfig | None = None,
        cfg: ClusterConfig | None = None,
    ) -> None:
        self.membership = membership
        self.client_cfg = client_cfg or ClientConfig()
        self.cfg = cfg or ClusterConfig()
        self.nodes: dict[str, NodeClient] = {}
        self._weights: dict[str, Node] = {}
        self.health = Health(self.nodes, self.cfg.probe_interval_s, self.cfg.probe_deadline_s)
        self._seen = -1
        self._view: list[Node] = []
        self._view_key: tuple = ()
        self._ranks: dict[bytes, tuple[str, ...]] = {}
        self._own_counters: Counter[str] = Counter()
        self._started = False
        self._closed = False
        self.repairer = Repairer(self.nodes, self.healthy, self.cfg.repair_max_blocks)

    @classmethod
    def static(cls, addrs: Sequence[str], client_cfg=None, cfg=None) -> ClusterClient:
        """A fixed list of ``host:port`` addresses (``kvstore://a,b,c``)."""
        return cls(StaticMembership(list(addrs)), client_cfg, cfg)

    @classmethod
    def etcd(cls, url: str, client_cfg=None, cfg=None) -> ClusterClient:
        """Members from etcd (``etcd://host:port[,host:port]/CLUSTER``), watched."""
        from kvstore.cluster.etcd_membership import EtcdMembership

        return cls(EtcdMembership(url), client_cfg, cfg)

    # ---------------------------------------------------------------- membership and health

    async def start(self, wait_s: float = 2.0) -> None:
        """Load the first membership view, waiting up to ``wait_s`` for etcd (never raises).
        Called by the first operation with that operation's deadline."""
        if not self._started:
            self._started = True
            await self.membership.start(wait_s)

    def _sync(self) -> None:
        if self.membership.version == self._seen:
            return
        self._seen = self.membership.version
        current = {m.addr: m for m in self.membership.members}
        for addr in list(self.nodes):
            if addr not in current:
                node = self.nodes.pop(addr)
                self.health.forget(addr)
                self._weights.pop(addr, None)
                asyncio.get_running_loop().create_task(node.close())
                log.info("event=member_left node=%s", addr)
        for addr, m in current.items():
            if addr not in self.nodes:
                self.nodes[addr] = NodeClient(addr, self.client_cfg)
                log.info("event=member_joined node=%s zone=%s", addr, m.zone)
            self._weights[addr] = m.node

    def healthy(self, addr: str) -> bool:
        return self.health.healthy(addr)

    async def _healthy_view(self, deadline_s: float | None = None) -> list[Node]:
        if not self._started:
            await self.start(min(2.0, deadline_s or self.client_cfg.op_timeout_s))
        self._sync()
        view = [n for a, n in sorted(self._weights.items()) if self.healthy(a)]
        key = tuple(view)
        if key != self._view_key:
            self._view_key, self._view, self._ranks = key, view, {}
        return self._view

    def _rank(self, key: BlockKey) -> tuple[str, ...]:
        ids = self._ranks.get(key.raw)
        if ids is None:
            if len(self._ranks) >= _RANK_CACHE_MAX:
                self._ranks.clear()
            ids = tuple(n.id for n in rank(key.raw, self._view, self.cfg.replicas))
            self._ranks[key.raw] = ids
        return ids

    async def _fan(self, groups: dict[str, list[int]], call: Callable[[NodeClient, list[int]], Awaitable]):
        addrs = list(groups)
        results = await asyncio.gather(*(call(self.nodes[a], groups[a]) for a in addrs))
        for a in addrs:
            self.health.after_call(a)
        return zip(addrs, results)

    # ---------------------------------------------------------------- lookups

    def _lookup_groups(self, keys: Sequence[BlockKey], view: list[Node]) -> dict[str, list[int]]:
        width = self.cfg.replicas + self.cfg.lookahead
        if width >= len(view):  # every node is a candidate for every key: no ranking needed
            everything = list(range(len(keys)))
            return {n.id: everything for n in view}
        groups: dict[str, list[int]] = {n.id: [] for n in view}
        for i, k in enumerate(keys):
            for a in self._rank(k)[:width]:
                groups[a].append(i)
        return {a: idx for a, idx in groups.items() if idx}

    async def exists(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> list[str | None]:
        """Per key: the best tier any of its candidate nodes holds it in (``None``: nowhere)."""
        out: list[str | None] = [None] * len(keys)
        view = await self._healthy_view(deadline_s)
        if not keys or not view:
            return out
        groups = self._lookup_groups(keys, view)
        for _addr, tiers in await self._fan(
            groups,
            lambda n, idx: n.exists(keys if len(idx) == len(keys) else [keys[i] for i in idx], deadline_s),
        ):
            for i, t in zip(groups[_addr], tiers):
                if t is not None and (out[i] is None or _TIER_ORDER.get(t, 9) < _TIER_ORDER.get(out[i], 9)):
                    out[i] = t
        return out

    async def lookup_prefix(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> int:
        """How many leading ``keys`` are stored somewhere (the longest prefix over replicas)."""
        tiers = await self.exists(keys, deadline_s)
        n = 0
        while n < len(tiers) and tiers[n] is not None:
            n += 1
        return n

    # ---------------------------------------------------------------- reads

    async def get_into(
        self,
        keys: Sequence[BlockKey],
        bufs: Sequence[Any],
        expect: Sequence[Expect | None] | None = None,
        deadline_s: float | None = None,
    ) -> list[GetResult]:
        """Fill ``bufs[i]`` with block ``keys[i]`` from the first candidate that has it whole
        and verified; see the module docstring for rounds and hedging."""
        if len(bufs) != len(keys) or (expect is not None and len(expect) != len(keys)):
            raise ValueError(f"get_into: {len(keys)} keys but {len(bufs)} buffers / expectations")
        exp = list(expect) if expect is not None else [None] * len(keys)
        out = [GetResult(Status.MISS)] * len(keys)
        view = await self._healthy_view(deadline_s)
        if not keys or not view:
            return out
        width = self.cfg.replicas + self.cfg.lookahead
        cands = [self._rank(k)[:width] for k in keys]
        pos = [0] * len(keys)
        missed: dict[int, list[str]] = {}  # owners that answered MISS, per key
        pending = list(range(len(keys)))
        end = time.monotonic() + (deadline_s or self.client_cfg.op_timeout_s)
        first = True
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                break
            groups: dict[str, list[int]] = {}
            for i in pending:
                while pos[i] < len(cands[i]) and not self.healthy(cands[i][pos[i]]):
                    pos[i] += 1  # went down since: skip without spending time on it
                if pos[i] < len(cands[i]):
                    groups.setdefault(cands[i][pos[i]], []).append(i)
            if not groups:
                break
            fallback = any(pos[i] + 1 < len(cands[i]) for i in pending)
            budget = left * self.cfg.hedge if fallback else left
            if not first:
                self._own_counters["read_fallback_rounds"] += 1
            first = False
            pending = []
            for addr, res in await self._fan(
                groups,
                lambda n, idx, b=budget: n.get_into(
                    [keys[i] for i in idx], [bufs[i] for i in idx], [exp[i] for i in idx], b
                ),
            ):
                for i, r in zip(groups[addr], res):
                    out[i] = r
                    pos[i] += 1
                    owner = addr in cands[i][: self.cfg.replicas]
                    if r.status is Status.MISS and owner:
                        missed.setdefault(i, []).append(addr)
                    elif r.status is Status.HIT and i in missed and not owner and self.cfg.read_repair:
                        self.repairer.offer(missed[i], r.header, bufs[i])
                    if r.status is not Status.HIT and r.status is not Status.BUF_TOO_SMALL:
                        pending.append(i)
        return out

    # ---------------------------------------------------------------- writes

    async def put(
        self, blocks: Sequence[tuple[BlockHeader, Any]], deadline_s: float | None = None
    ) -> list[PutResult]:
        """Store each block on its ``replicas`` owners (the next healthy nodes stand in for any
        that fail). A block's result is its best replica's (STORED/EXISTS when any took it)."""
        out = [PutResult(Status.ERROR)] * len(blocks)
        view = await self._healthy_view(deadline_s)
        if not blocks or not view:
            self._own_counters["dropped_writes"] += len(blocks)
            return out
        order = [self._rank(h.key) for h, _ in blocks]
        need = [min(self.cfg.replicas, len(view))] * len(blocks)
        pos = [0] * len(blocks)
        end = time.monotonic() + (deadline_s or self.client_cfg.op_timeout_s)
        first = True
        while True:
            left = end - time.monotonic()
            groups: dict[str, list[int]] = {}
            for i in range(len(blocks)):
                while need[i] > 0 and pos[i] < len(order[i]):
                    a = order[i][pos[i]]
                    pos[i] += 1
                    if self.healthy(a):
                        groups.setdefault(a, []).append(i)
                        need[i] -= 1
            if not groups or left <= 0:
                break
            if not first:
                self._own_counters["writes_redirected"] += sum(len(v) for v in groups.values())
            first = False
            for addr, res in await self._fan(
                groups, lambda n, idx, t=left: n.put([blocks[i] for i in idx], t)
            ):
                for i, r in zip(groups[addr], res):
                    if r.status.ok:
                        if not out[i].status.ok or (r.durable and not out[i].durable):
                            out[i] = r
                    else:
                        if not out[i].status.ok:
                            out[i] = r
                        if r.status in (Status.ERROR, Status.TIMEOUT, Status.NO_SPACE):
                            need[i] += 1  # try the next node in rendezvous order
        short = sum(1 for r in out if not r.status.ok)
        self._own_counters["dropped_writes"] += short
        return out

    async def delete(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> list[bool]:
        """Delete from every candidate node; True where any copy was deleted."""
        out = [False] * len(keys)
        view = await self._healthy_view(deadline_s)
        if not keys or not view:
            return out
        groups = self._lookup_groups(keys, view)
        for addr, res in await self._fan(groups, lambda n, idx: n.delete([keys[i] for i in idx], deadline_s)):
            for i, ok in zip(groups[addr], res):
                out[i] = out[i] or ok
        return out

    # ---------------------------------------------------------------- the rest

    @property
    def counters(self) -> Counter[str]:
        total: Counter[str] = Counter(self._own_counters) + self.health.counters + self.repairer.counters
        for n in self.nodes.values():
            total.update(n.counters)
        return total

    def live_addrs(self) -> list[str]:
        """Members currently used (healthy), sorted."""
        self._sync()
        return sorted(a for a in self.nodes if self.healthy(a))

    async def close(self) -> None:
        """Stop probing and watching; close every node client. Later calls are misses."""
        self._closed = True
        self.health.close()
        self.repairer.close()
        await self.membership.close()
        await asyncio.gather(*(n.close() for n in self.nodes.values()))
        self._weights.clear()
        self._ranks.clear()
        self._view, self._view_key = [], ()
        self._seen = self.membership.version
