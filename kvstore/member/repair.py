"""Node-side anti-entropy repair: after a join, a replacement or a permanent leave, every
block gets its ``replicas`` copies back (docs/cluster.md says why node-side).

Contract: :class:`Repair` runs inside a daemon that is a cluster member. Each pass walks the
node's own blocks in batches; per block it computes the owners (rendezvous over the current
members, as clients place it), asks every other owner with one batched EXISTS per owner, and
pushes the block to the reachable owners that lack it. An owner that deleted the block
while this node was away answers the push with DELETED (its tombstone is newer than the copy:
kvstore/node/tombstones.py); this node then drops that copy (``copies_dropped_deleted_elsewhere``;
an eviction, never a tombstone of its own), so an eviction sticks across a node's absence. No
other answer drops anything: an owner that fails, times out, stalls or is marked down has
deleted nothing (``push_failures``; the next pass tries again). Exactly one holder pushes a block:
the first owner (in rendezvous order) that holds it, or, when no owner holds it, every
non-owner that does (a write redirected past a failed owner). Unreachable owners are skipped
in this pass (their node client probes them). A pass runs after each membership change
(``settle_s`` later) and at least every ``interval_s`` (a static member that came back empty
is found by the next pass).

It never starves serving: a sorted snapshot of the keys (sorted off the loop) walked by cursor,
``batch_keys`` per slice and a yield after each; one pass at a time on the node, shared with
the orphan pass (kvstore/member/passes.py); one batch in flight, pushed payload bytes at most
``max_bytes_per_s`` (a token bucket), and every peer call under ``deadline_s``. Failures are
counted, never raised. Peers are reached as *peer sessions* (``tenant="*"``: with the
operator token when auth is on), which see every tenant's blocks for EXISTS and PUT.
Lifecycle, totals and metrics: :class:`~kvstore.member.base.MemberPass`; ``tierkv_repair_*``
counters and the ``tierkv_repair_under_replicated`` gauge on the daemon's registry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from kvstore.block import BlockHeader
from kvstore.client.membership import Membership
from kvstore.client.placement import Node, rank_many
from kvstore.config import RepairSection
from kvstore.keys import BlockKey, KeyBatch
from kvstore.member.base import MemberPass
from kvstore.member.passes import PassRunner, Slices, packed
from kvstore.member.peer_sessions import batches
from kvstore.node import orphans as node_orphans
from kvstore.node.store import NodeStore
from kvstore.results import Status


class Repair(MemberPass):
    """Bound to the daemon's event loop (see :class:`~kvstore.member.base.MemberPass`)."""

    KIND = "repair"
    TITLE = "Anti-entropy repair"
    EVENT = "repair"
    METRICS = (
        "passes",
        "blocks_checked",
        "copies_missing",
        "copies_pushed",
        "bytes_pushed",
        "push_failures",
        "owners_unreachable",
        "copies_dropped_deleted_elsewhere",
        "copies_kept_written_since",
        "slices",
    )
    log = logging.getLogger("kvstore.member.repair")

    def __init__(
        self,
        node: NodeStore,
        self_addr: str,
        membership: Membership,
        cfg: RepairSection,
        token: str = "",
        runner: PassRunner | None = None,
    ) -> None:
        super().__init__(
            node, self_addr, membership, token=token, pool_size=2, deadline_s=cfg.deadline_s, runner=runner
        )
        self.cfg = cfg
        self._bucket = 0.0
        self._bucket_t = time.monotonic()

    async def _run(self) -> None:
        await self.membership.start(self.cfg.deadline_s)
        seen = -1
        while not self._closed:
            if self.membership.version != seen:
                seen = self.membership.version
                await asyncio.sleep(self.cfg.settle_s)  # let a burst of joins/leaves settle
                seen = self.membership.version
            await self._run_kept()
            await self.membership.wait_changed(seen, self.cfg.interval_s)

    # ------------------------------------------------------------ one pass

    async def _one_pass(self) -> dict[str, int]:
        return await self.sweep()

    async def sweep(self) -> dict[str, int]:
        """One full pass over this node's blocks; returns this pass's counts."""
        t0 = time.monotonic()
        got = await self._view_and_keys()
        if got is None:
            return {}
        view, keys = got
        done: Counter[str] = Counter()  # a slice of batch_keys per EXISTS round, a rest after each
        slices = Slices(self.counters, time.thread_time)  # rests its CPU, not its waits
        for at in range(0, len(keys), self.cfg.batch_keys):
            if self._closed:
                break
            done.update(await self._repair_batch(packed(keys[at : at + self.cfg.batch_keys]).raws(), view))
            await slices.end()  # serving traffic runs between batches
        # what is still short of replicas once this pass is done: found missing, and neither
        # restored, nor deleted elsewhere, nor gone from here meanwhile (the gauge)
        left = done["copies_missing"] - done["copies_pushed"] - done["copies_dropped_deleted_elsewhere"]
        left -= done["copies_vanished"]
        if done["copies_missing"]:
            self._log_pass(done)
        return self._finished(done, t0, under_replicated=max(0, left))

    async def _repair_batch(self, batch: list[bytes], view: list[Node]) -> Counter[str]:
        c: Counter[str] = Counter(blocks_checked=len(batch))
        r = self.cfg.replicas
        owners = {
            k: order[:r] for k, order in zip(batch, rank_many(batch, view, r))
        }  # numpy, no per-key sort
        ask: dict[str, list[bytes]] = {}
        for k, os_ in owners.items():
            for a in os_:
                if a != self.self_addr:
                    ask.setdefault(a, []).append(k)
        answers = await asyncio.gather(
            *(self.peers.get(a).lookup(KeyBatch(b"".join(ks)), self.cfg.deadline_s) for a, ks in ask.items())
        )
        held: dict[tuple[str, bytes], bool | None] = {}
        for (a, ks), found in zip(ask.items(), answers):
            up = self.peers.get(a).up
            for k, t in zip(ks, found.tiers):
                held[(a, k)] = t != 0 if up else None  # None: unknown (unreachable)
        pushes: dict[str, list[bytes]] = {}
        for k, os_ in owners.items():
            holders = [a for a in os_ if a == self.self_addr or held.get((a, k))]
            first = holders[0] if holders else None
            if first is not None and first != self.self_addr:
                continue  # an owner ranked before us holds it: that one pushes
            for a in os_:
                if a != self.self_addr and held.get((a, k)) is False:
                    pushes.setdefault(a, []).append(k)
                    c["copies_missing"] += 1
                elif a != self.self_addr and held.get((a, k)) is None:
                    c["owners_unreachable"] += 1
        for addr, ks in pushes.items():
            c.update(await self._push(addr, ks))
        return c

    async def _push(self, addr: str, keys: list[bytes]) -> Counter[str]:
        """Copy ``keys`` out of this node (a lease, released at once) and PUT them to ``addr``."""
        c: Counter[str] = Counter()
        leases = await self.node.leaser.lease([BlockKey(k) for k in keys], self.cfg.deadline_s)
        try:
            blocks = [(x.header, bytes(x.view)) for x in leases if x is not None]
        finally:
            self.node.state.release([x for x in leases if x is not None])
        c["copies_vanished"] += len(keys) - len(blocks)  # evicted or deleted since the walk
        for part in batches(blocks, 16):
            nbytes = sum(h.payload_len for h, _ in part)
            await self._pace(nbytes)
            res = await self.peers.get(addr).put(part, self.cfg.deadline_s)
            ok = sum(1 for r in res if r.status.ok)
            # Only the owner's explicit answer that it deleted the key after this copy was
            # written drops the copy; a failure, a timeout or a peer marked down says nothing
            # about the key, however it is spelled (issue 33: silence is never a delete).
            dead = [h for (h, _), r in zip(part, res) if r.status is Status.DELETED]
            if dead:
                c.update(await self._drop_deleted(addr, dead))
            c["copies_pushed"] += ok
            c["push_failures"] += len(res) - ok - len(dead)
            c["bytes_pushed"] += sum(h.payload_len for (h, _), r in zip(part, res) if r.status.ok)
        return c

    async def _drop_deleted(self, addr: str, pushed: list[BlockHeader]) -> Counter[str]:
        """Drop this node's copies of ``pushed`` (headers an owner answered DELETED) that are
        still the copies pushed (a client's write since then is newer than that delete).
        An eviction, not a delete: the repair writes no tombstone (the owner holds it)."""
        c: Counter[str] = Counter()
        keys = [h.key.raw for h in pushed]
        now = await node_orphans.created(self.node, keys)
        same = [k for k, h, t in zip(keys, pushed, now) if t is not None and t <= h.created]
        c["copies_kept_written_since"] += len(keys) - len(same)
        if same:
            gone = (await node_orphans.drop(self.node, same, reason="deleted_elsewhere"))["dropped"]
            c["copies_dropped_deleted_elsewhere"] += gone
            self.log.info("event=repair_drop_deleted peer=%s blocks=%d", addr, gone)
        return c

    async def _pace(self, nbytes: int) -> None:
        """Token bucket: wait until ``nbytes`` fit under ``max_bytes_per_s`` (burst: 1 s)."""
        rate = float(self.cfg.max_bytes_per_s)
        now = time.monotonic()
        self._bucket = min(rate, self._bucket + (now - self._bucket_t) * rate)
        self._bucket_t = now
        self._bucket -= nbytes
        if self._bucket < 0:
            await asyncio.sleep(-self._bucket / rate)

    # ------------------------------------------------------------ progress

    def extra_metrics(self) -> Iterator[Metric]:
        # copies still missing when the last pass ended (found missing and not restored by it):
        # 0 as soon as the pass that restores them ends, not one interval later (issue 33)
        g = GaugeMetricFamily(
            "tierkv_repair_under_replicated", "Copies still missing when the last finished repair pass ended"
        )
        g.add_metric([], self.last_pass.get("under_replicated", 0))
        yield g
