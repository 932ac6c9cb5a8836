"""The orphan pass: a cluster member evicts its blocks whose parent is stored nowhere.

Rendezvous placement spreads a chain's blocks over nodes that evict independently, so a node
can keep a child whose parent another node dropped. No hit prefix reaches such a block again
(a lookup stops at the missing parent): it is an *orphan*, bytes wasted until evicted, and a
node's own order cannot see it (its parent never was on this node). docs/cluster.md "Orphans".

Contract: :class:`OrphanPass` runs inside a daemon that is a cluster member (static
``cluster.peers`` or etcd), every ``orphans.interval_s`` and when asked (:meth:`sweep`, the
admin route ``POST /v1/orphans/pass``: a request joins the pass under way, and one cut off
stops a pass nobody else waits for; one background pass at a time on the node, shared with the
repair: kvstore/client/passes.py). A pass reads the parent of each
block the node holds (its header's ``parent``; a chain's first block names its namespace and
is never an orphan), asks the nodes a client's lookup would find each parent on (rendezvous
over the current members: its ``repair.replicas`` owners, as clients place it, and the
``orphans.lookahead`` nodes after them, where a write past a down owner lands) with one
batched EXISTS per node and batch, asks the parents found absent once more right before the
drop (one written again meanwhile saves its chain), and evicts (kvstore/node/orphans.py: no
tombstone; held and pinned blocks stay) every block whose parent is on none of them nor on
this node, and with it every block of this node below it in its chain. A parent whose node
does not answer counts as present (an unreachable node is not an empty one), and so does one
that would rank on a member that left the view within ``orphans.departed_s`` (a member stalled
past its etcd lease leaves the view, yet comes back with its blocks). A pass whose view
changes, or that is closed, before its drops end drops nothing more (``passes_cut_short``). A periodic pass
waits until the view has been unchanged ``repair.settle_s`` (right after a join or leave a
parent may still sit on a former owner). The orphans of another node's blocks dropped in the
same pass go in that node's next pass: each pass removes one node-hop of an orphaned chain,
so what a pass bounds is what forms between two passes (bench/trace.py measures it).

Work is bounded: one EXISTS in flight, ``orphans.batch_keys`` parents per call, every call
under ``orphans.deadline_s``, and every stage of a pass (listing the node's keys, reading
their parents, finding the remote ones, ranking them, finding the lost ones and their chains,
counting and dropping them) does at most ``orphans.slice_blocks`` keys' work between two yields
to the event loop (:attr:`OrphanPass.progress` says where it is), so serving traffic runs
between steps however many blocks the node holds. Failures are counted, never raised. Peers are reached as peer
sessions (tenant ``*``: every tenant's blocks are visible, as for the repair).
Progress: :meth:`stats` and ``tierkv_orphans_*`` on the daemon's registry, with the orphans'
payload bytes per tier and namespace (``kvstore stats`` shows them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from kvstore.client.membership import Membership
from kvstore.client.node import NodeClient
from kvstore.client.passes import PassRunner, Slices, key_list
from kvstore.client.peer_sessions import PeerSessions, batches, stop_task
from kvstore.client.placement import Node, rank_many
from kvstore.config import OrphansSection
from kvstore.keys import BlockKey
from kvstore.node import orphans as node_orphans
from kvstore.node.listing import KeyOrder

log = logging.getLogger("kvstore.client.orphans")
PASS_KIND = "orphans"  # its name in the node's PassRunner


class OrphanPass:
    """Bound to the daemon's event loop. ``node``: the daemon's NodeStore; ``self_addr``: this
    node's member address; ``replicas``: the copies clients keep of each block; ``token``:
    the operator token ("" without auth); ``settle_s``: how long the view must stay unchanged
    before a periodic pass (the repair's ``repair.settle_s``)."""

    def __init__(
        self,
        node: Any,
        self_addr: str,
        membership: Membership,
        cfg: OrphansSection,
        replicas: int,
        token: str = "",
        *,
        settle_s: float,
        runner: PassRunner | None = None,
    ) -> None:
        self.node = node
        self.runner = runner or PassRunner()  # the node's: one background pass at a time
        self.self_addr = self_addr
        self.membership = membership
        self.cfg = cfg
        self.replicas = replicas
        self.settle_s = settle_s
        self.peers = PeerSessions(token, pool_size=1, deadline_s=cfg.deadline_s)
        self.counters: Counter[str] = Counter()
        self.last_pass: dict[str, Any] = {}
        # (tier, namespace hex) -> payload bytes of orphans found: by the last pass, in all
        self.last_bytes: dict[tuple[str, str], int] = {}
        self.found_bytes: Counter[tuple[str, str]] = Counter()
        # (stage, keys done in it) of the pass under way; ("idle", 0) between passes
        self.progress: tuple[str, int] = ("idle", 0)
        # members that left the view (addr -> their node, monotonic time they were last seen):
        # a node that left may only be unreachable and come back with its blocks, so a parent
        # that ranks on one is never taken for absent (for ``orphans.departed_s``)
        self._departed: dict[str, tuple[Node, float]] = {}
        self._last_view: dict[str, Node] = {}
        self._keys = KeyOrder()
        self._task: asyncio.Task | None = None
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.membership.start(self.cfg.deadline_s)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        self._closed = True
        await stop_task(self._task)
        await self.runner.cancel(PASS_KIND)  # a pass under way stops at its next await
        await self.peers.close()
        await self.membership.close()

    async def _run(self) -> None:
        seen, changed_at = -1, time.monotonic()
        while not self._closed:
            await asyncio.sleep(self.cfg.interval_s)
            if self.membership.version != seen:  # the first view counts as a change
                seen, changed_at = self.membership.version, time.monotonic()
            if time.monotonic() - changed_at < self.settle_s:
                # right after a join or leave a parent may still sit on a former owner, and
                # the repair has not moved it yet: no pass until the view settled
                self.counters["passes_skipped_settling"] += 1
                continue
            try:
                await self.runner.run(PASS_KIND, self._one_pass, keep=True)
            except Exception as exc:  # a pass must never take the daemon down
                self.counters["passes_failed"] += 1
                log.exception("event=orphan_pass_failed error=%r", exc)

    # ------------------------------------------------------------ one pass

    async def sweep(self, gone: Callable[[], bool] | None = None) -> dict[str, int]:
        """One pass over this node's blocks, or the one under way joined; its counts. ``gone``:
        polled while waiting, true once the caller went away (an admin request cut off): it
        withdraws (PassWithdrawn), and a pass nobody else waits for stops (kvstore/client/passes.py)."""
        if PASS_KIND in self.runner.running:
            self.counters["requests_joined"] += 1
        return await self.runner.run(PASS_KIND, self._one_pass, gone=gone)

    async def _one_pass(self) -> dict[str, int]:
        try:
            return await self._sweep()
        except asyncio.CancelledError:
            self.counters["passes_cancelled"] += 1  # every caller went away, or closing
            raise
        finally:
            self.progress = ("idle", 0)

    async def _steps(self, stage: str, items: list):
        """``items`` in slices of ``orphans.slice_blocks`` (at most ``batch_keys``), a yield to
        the event loop after each (``progress`` names the stage and the items done)."""
        n = min(self.cfg.slice_blocks, self.cfg.batch_keys)
        slices = Slices(self.counters)
        for i in range(0, len(items), n):
            self.progress = (stage, i)
            yield items[i : i + n]
            await slices.end()  # serving traffic runs between steps
        self.progress = (stage, len(items))

    def _note_departures(self, view: list[Node]) -> list[Node]:
        """Remember the members of the last view missing from ``view``; forget those back in it
        or gone longer than ``orphans.departed_s``. The departed nodes still remembered."""
        now = time.monotonic()
        ids = {n.id for n in view}
        for addr, node in self._last_view.items():
            if addr not in ids:
                self._departed.setdefault(addr, (node, now))
        self._last_view = {n.id: n for n in view}
        for addr, (_, since) in list(self._departed.items()):
            if addr in ids or now - since > self.cfg.departed_s:
                del self._departed[addr]
        return [node for node, _ in self._departed.values()]

    def _cut_short(self, version: int) -> bool:
        """True when the view this pass ranked over changed, or the pass is being closed: a
        parent's nodes may be others now, so nothing more is dropped in this pass."""
        return self._closed or self.membership.version != version

    async def _sweep(self) -> dict[str, int]:
        version = self.membership.version
        view = [m.node for m in self.membership.members]
        ids = {n.id for n in view}
        departed = self._note_departures(view)
        await self.peers.forget_except(ids)
        done: Counter[str] = Counter()
        t0 = time.monotonic()
        if self.self_addr not in ids or len(view) < 2:
            self.counters["passes_skipped"] += 1
            return dict(done)
        # one order every pass (the simulation's, bench/trace_sim.py): a sorted snapshot of
        # the keys, sorted off the loop; walked by cursor, a slice of slice_blocks at a time
        keys = await self._keys.build(self.node.tiers)
        parent_of: dict[bytes, bytes] = {}
        async for batch in self._steps("parents", range(len(keys))):
            ks = key_list(keys[batch.start : batch.stop])
            for k, (ns, p) in zip(ks, await node_orphans.parents(self.node, ks)):
                if p is not None and p != ns:  # a chain's first block names its namespace
                    parent_of[k] = p
        done["blocks_checked"] = len(keys)
        remote_set: set[bytes] = set()
        async for batch in self._steps("remote", list(parent_of.values())):
            remote_set.update(p for p in batch if not node_orphans.stored(self.node, p))
        present = await self._present_elsewhere(sorted(remote_set), view, departed, done)
        lost: list[bytes] = []
        async for batch in self._steps("lost", list(parent_of.items())):
            lost.extend(k for k, p in batch if p not in present and not node_orphans.stored(self.node, p))
        if lost:  # a parent written again since its batch was asked saves its chain
            again = sorted({parent_of[k] for k in lost})
            back = await self._present_elsewhere(again, view, departed, done)
            back.update(p for p in again if node_orphans.stored(self.node, p))
            done["orphans_parent_back"] = sum(1 for k in lost if parent_of[k] in back)
            lost = [k for k in lost if parent_of[k] not in back]
        doomed = await self._with_descendants(lost, parent_of)
        found: Counter[tuple[str, str]] = Counter()
        c: Counter[str] = Counter()
        async for batch in self._steps("drop", doomed):
            if self._cut_short(version):  # checked before every drop, after every await
                done["passes_cut_short"] += 1
                break
            found.update(node_orphans.orphan_bytes(self.node, batch))
            c.update(await node_orphans.drop(self.node, batch))
        done["orphans_found"] = len(doomed)
        done["orphans_dropped"] = c["dropped"]
        done["orphans_held"] = c["held"]
        done["orphan_bytes_found"] = sum(found.values())
        self.last_bytes = dict(found)
        self.found_bytes.update(found)
        self.counters.update(done)
        self.counters["passes"] += 1
        self.last_pass = {"seconds": round(time.monotonic() - t0, 3), "finished": time.time(), **done}
        if doomed:
            log.info("event=orphan_pass %s", " ".join(f"{k}={v}" for k, v in sorted(done.items())))
        return dict(done)

    async def _present_elsewhere(
        self, parents: list[bytes], view: list[Node], departed: list[Node], done: Counter[str]
    ) -> set[bytes]:
        """The ``parents`` some node other than this one holds among the ranks a client's
        lookup asks (the owners and the ``orphans.lookahead`` nodes after them), or that
        cannot be told: a node that does not answer, or one that left the view lately and
        would rank among them (``departed``: it may be only unreachable, with the parent) --
        present, so nothing is dropped on a node's silence."""
        ask: dict[str, list[bytes]] = defaultdict(list)
        width = self.replicas + self.cfg.lookahead
        present: set[bytes] = set()
        gone = {n.id for n in departed}
        async for batch in self._steps("rank", parents):
            orders = rank_many(batch, view, self.replicas)
            with_gone = rank_many(batch, view + departed, self.replicas) if departed else orders
            for p, order, wide in zip(batch, orders, with_gone):
                if gone and not gone.isdisjoint(wide[:width]):
                    present.add(p)
                    done["parents_on_departed"] += 1
                    continue
                for a in order[:width]:
                    if a != self.self_addr:
                        ask[a].append(p)
        for addr, ps in ask.items():
            for batch in batches(ps, self.cfg.batch_keys):
                peer = self.peers.get(addr)
                failed = _failures(peer)
                tiers = await peer.exists([BlockKey(p) for p in batch], self.cfg.deadline_s)
                if not peer.up or _failures(peer) != failed or len(tiers) != len(batch):
                    done["owners_unreachable"] += 1
                    present.update(batch)
                    continue
                present.update(p for p, t in zip(batch, tiers) if t is not None)
                await asyncio.sleep(0)  # serving traffic runs between batches
        return present

    async def _with_descendants(self, lost: list[bytes], parent_of: dict[bytes, bytes]) -> list[bytes]:
        """``lost`` and every key of ``parent_of`` below one of them (their chains on this
        node), in bounded steps."""
        if not lost:
            return []
        children: dict[bytes, list[bytes]] = defaultdict(list)
        async for batch in self._steps("chains", list(parent_of.items())):
            for k, p in batch:
                children[p].append(k)
        out, seen, todo = [], set(lost), list(lost)
        n = min(self.cfg.slice_blocks, self.cfg.batch_keys)
        slices = Slices(self.counters)
        while todo:
            k = todo.pop()
            out.append(k)
            for c in children.get(k, ()):
                if c not in seen:
                    seen.add(c)
                    todo.append(c)
            if len(out) % n == 0:
                self.progress = ("chains", len(out))
                await slices.end()
        return out

    # ------------------------------------------------------------ progress

    def stats(self) -> dict[str, Any]:
        """Totals since start and the last finished pass (JSON-able)."""
        return {"totals": dict(self.counters), "last_pass": dict(self.last_pass)}

    def register_metrics(self, registry: Any) -> None:
        """``tierkv_orphans_<name>_total`` counters, ``tierkv_orphans_found_bytes_total{tier,
        namespace}`` and the last pass's ``tierkv_orphans_last_pass_bytes{tier, namespace}`` on
        ``registry`` (the daemon's: /metrics; the counters also in ``/v1/stats`` and
        ``kvstore stats``)."""
        registry.register(_OrphanCollector(self))


def _failures(peer: NodeClient) -> int:
    """The calls ``peer`` failed or skipped so far (an EXISTS that failed answers "absent")."""
    c = peer.counters
    return c["timeouts"] + c["errors"] + c["skipped"]


class _OrphanCollector:
    NAMES = (
        "passes",
        "blocks_checked",
        "orphans_found",
        "orphans_dropped",
        "orphans_held",
        "owners_unreachable",
        "orphans_parent_back",
        "passes_skipped_settling",
        "passes_cut_short",
        "parents_on_departed",
        "passes_cancelled",
        "requests_joined",
        "slices",
    )

    def __init__(self, op: OrphanPass) -> None:
        self.op = op

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name in self.NAMES:
            fam = CounterMetricFamily(f"tierkv_orphans_{name}", f"Orphan pass: {name.replace('_', ' ')}")
            fam.add_metric([], self.op.counters[name])
            yield fam
        total = CounterMetricFamily(
            "tierkv_orphans_found_bytes",
            "Payload bytes of the blocks orphan passes found with no parent in the cluster, per "
            "tier and namespace (evicted unless held)",
            labels=["tier", "namespace"],
        )
        last = GaugeMetricFamily(
            "tierkv_orphans_last_pass_bytes",
            "Payload bytes of orphans the last pass found, per tier and namespace",
            labels=["tier", "namespace"],
        )
        for (tier, ns), nbytes in sorted(self.op.found_bytes.items()):
            total.add_metric([tier, ns], nbytes)
            last.add_metric([tier, ns], self.op.last_bytes.get((tier, ns), 0))
        yield total
        yield last
