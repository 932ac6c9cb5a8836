"""The orphan pass: a cluster member evicts its blocks whose parent is stored nowhere.

Rendezvous placement spreads a chain's blocks over nodes that evict independently, so a node
can keep a child whose parent another node dropped. No hit prefix reaches such a block again
(a lookup stops at the missing parent): it is an *orphan*, bytes wasted until evicted, and a
node's own order cannot see it (its parent never was on this node). docs/cluster.md "Orphans".

Contract: :class:`OrphanPass` runs inside a daemon that is a cluster member (static
``cluster.peers`` or etcd), every ``orphans.interval_s`` and when asked (:meth:`sweep`, the
admin route ``POST /v1/orphans/pass``: a request joins the pass under way, and one cut off
stops a pass nobody else waits for; one background pass at a time on the node, shared with the
repair: kvstore/member/passes.py). A pass reads the parent of each block the node holds (its header's ``parent``; a chain's first block names its namespace and
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
changes, or that is closed, before its drops end drops nothing more (``passes_cut_short``). A
periodic pass waits until the view has been unchanged ``repair.settle_s`` (right after a join or leave a
parent may still sit on a former owner). The orphans of another node's blocks dropped in the
same pass go in that node's next pass: each pass removes one node-hop of an orphaned chain,
so what a pass bounds is what forms between two passes (bench/trace.py measures it).

Work is bounded: one EXISTS in flight, ``orphans.batch_keys`` parents per call, every call
under ``orphans.deadline_s``; every stage (reading the parents, finding the remote ones,
ranking them, finding the lost ones and their chains, dropping them) does at most
``orphans.slice_blocks`` keys' work between two rests of the loop (:attr:`OrphanPass.progress`
says where it is), and works on columns of packed keys: headers read in numpy passes over one
buffer, presence from the tiers' key tables, sorts off the loop; no Python per block but the
gathering of its header. Failures are counted, never raised. Peers are reached as peer
sessions (tenant ``*``, as for the repair). Progress: ``tierkv_orphans_*`` on the daemon's
registry, with the orphans' payload bytes per tier and namespace (``kvstore stats``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvstore.client.membership import Membership
from kvstore.client.node import NodeClient
from kvstore.client.placement import Node, rank_positions
from kvstore.config import OrphansSection
from kvstore.member.base import MemberPass
from kvstore.member.passes import KEY_COLUMN, PassRunner, Slices, member_of, packed, ranges
from kvstore.node import orphans as node_orphans
from kvstore.node.store import NodeStore


class OrphanPass(MemberPass):
    """Bound to the daemon's event loop (see :class:`~kvstore.member.base.MemberPass`).
    ``replicas``: the copies clients keep of each block; ``settle_s``: how long the view must
    stay unchanged before a periodic pass (the repair's ``repair.settle_s``)."""

    KIND = "orphans"
    TITLE = "Orphan pass"
    EVENT = "orphan"
    METRICS = (
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
    log = logging.getLogger("kvstore.member.orphans")

    def __init__(
        self,
        node: NodeStore,
        self_addr: str,
        membership: Membership,
        cfg: OrphansSection,
        replicas: int,
        token: str = "",
        *,
        settle_s: float,
        runner: PassRunner | None = None,
    ) -> None:
        super().__init__(
            node, self_addr, membership, token=token, pool_size=1, deadline_s=cfg.deadline_s, runner=runner
        )
        self.cfg = cfg
        self.replicas = replicas
        self.settle_s = settle_s
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

    async def start(self) -> None:
        await self.membership.start(self.cfg.deadline_s)  # an admin request sees the view
        await super().start()

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
            await self._run_kept()

    # ------------------------------------------------------------ one pass

    async def sweep(self, gone: Callable[[], bool] | None = None) -> dict[str, int]:
        """One pass over this node's blocks, or the one under way joined; its counts. ``gone``:
        polled while waiting, true once the caller went away (an admin request cut off): it
        withdraws (PassWithdrawn), and a pass nobody else waits for stops (kvstore/member/passes.py)."""
        if self.KIND in self.runner.running:
            self.counters["requests_joined"] += 1
        return await self.runner.run(self.KIND, self._one_pass, gone=gone)

    async def _one_pass(self) -> dict[str, int]:
        try:
            return await self._sweep()
        except asyncio.CancelledError:
            self.counters["passes_cancelled"] += 1  # every caller went away, or closing
            raise
        finally:
            self.progress = ("idle", 0)

    async def _steps(self, stage: str, items: Sequence):
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
        departed = self._note_departures([m.node for m in self.membership.members])
        t0 = time.monotonic()
        got = await self._view_and_keys()
        if got is None:
            return {}
        view, keys = got
        done: Counter[str] = Counter()
        # every stage works on columns of packed keys (numpy), never block by block in Python
        kids, pars = await self._parents(keys)  # the blocks with a parent, and that parent
        done["blocks_checked"] = len(keys)
        uniq = await asyncio.to_thread(np.unique, pars)  # each parent once, sorted off the loop
        remote = [p async for p in self._unstored("remote", uniq)]
        remote = np.concatenate(remote) if remote else uniq[:0]
        absent = remote[~await self._present_elsewhere(remote, view, departed, done)]
        lost = []
        async for r in self._steps("lost", range(len(kids))):
            at = np.flatnonzero(member_of(absent, pars[r.start : r.stop])) + r.start
            if len(at):  # absent elsewhere; and here, unless written here since
                lost.append(at[~await node_orphans.stored(self.node, packed(pars[at]))])
        lost = np.concatenate(lost) if lost else np.zeros(0, np.int64)
        if len(lost):  # a parent written again since its batch was asked saves its chain
            again = await asyncio.to_thread(np.unique, pars[lost])
            back = await self._present_elsewhere(again, view, departed, done)
            back |= await node_orphans.stored(self.node, packed(again))
            saved = member_of(again[back], pars[lost])
            done["orphans_parent_back"] = int(saved.sum())
            lost = lost[~saved]
        doomed = packed(await self._with_descendants(lost, kids, pars)).raws()
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
        if doomed:
            self._log_pass(done)
        return self._finished(done, t0)

    async def _parents(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The keys of ``keys`` (a sorted snapshot) whose stored header names a parent, and
        those parents (two key columns): a chain's first block names its namespace instead,
        and is never an orphan; a block gone or unreadable meanwhile is left out."""
        kids, pars = [], []
        async for r in self._steps("parents", range(len(keys))):
            part = keys[r.start : r.stop]
            ns, parent, known = await node_orphans.parents(self.node, packed(part))
            has = known & (parent != ns).any(axis=1)
            kids.append(part[has])
            pars.append(parent[has].view(KEY_COLUMN).reshape(-1))
        if not kids:
            return keys[:0], keys[:0]
        return np.concatenate(kids), np.concatenate(pars)

    async def _unstored(self, stage: str, keys: np.ndarray):
        """``keys`` (a key column) this node does not hold, a slice at a time."""
        async for part in self._steps(stage, keys):
            yield part[~await node_orphans.stored(self.node, packed(part))]

    async def _present_elsewhere(
        self, parents: np.ndarray, view: list[Node], departed: list[Node], done: Counter[str]
    ) -> np.ndarray:
        """Per key of ``parents`` (a key column), whether some node other than this one holds
        it among the ranks a client's lookup asks (the owners and the ``orphans.lookahead``
        nodes after them), or it cannot be told: a node that does not answer, or one that left
        the view lately and would rank among them (``departed``: it may be only unreachable,
        with the parent) -- present, so nothing is dropped on a node's silence."""
        width = self.replicas + self.cfg.lookahead
        present = np.zeros(len(parents), bool)
        ask: dict[str, list[np.ndarray]] = defaultdict(list)  # node -> positions in parents
        gone = {n.id for n in departed}
        async for r in self._steps("rank", range(len(parents))):
            keys = packed(parents[r.start : r.stop])
            ids, rows = rank_positions(keys, view, self.replicas)
            on_gone = np.zeros(len(keys), bool)
            if gone:
                wide_ids, wide = rank_positions(keys, view + departed, self.replicas)
                on_gone = np.isin(wide[:, :width], [j for j, a in enumerate(wide_ids) if a in gone]).any(
                    axis=1
                )
                present[r.start : r.stop] |= on_gone
                done["parents_on_departed"] += int(on_gone.sum())
            for j, addr in enumerate(ids):
                asked = (rows[:, :width] == j).any(axis=1) & ~on_gone
                if addr != self.self_addr and asked.any():
                    ask[addr].append(np.flatnonzero(asked) + r.start)
        for addr, parts in ask.items():
            at = np.concatenate(parts)
            for lo in range(0, len(at), self.cfg.batch_keys):
                sel = at[lo : lo + self.cfg.batch_keys]
                peer = self.peers.get(addr)
                failed = _failures(peer)
                tiers = (await peer.lookup(packed(parents[sel]), self.cfg.deadline_s)).tiers
                if not peer.up or _failures(peer) != failed or len(tiers) != len(sel):
                    done["owners_unreachable"] += 1
                    present[sel] = True
                    continue
                present[sel] |= np.frombuffer(tiers, np.uint8) != 0
                await asyncio.sleep(0)  # serving traffic runs between batches
        return present

    async def _with_descendants(self, lost: np.ndarray, kids: np.ndarray, pars: np.ndarray) -> np.ndarray:
        """The keys of ``kids`` at positions ``lost`` and every key of ``kids`` below one of
        them (their chains on this node; ``pars`` names each one's parent), in bounded steps:
        a slice of the keys found so far looks its children up at a time."""
        if not len(lost):
            return kids[:0]
        self.progress = ("chains", 0)
        by_parent = await asyncio.to_thread(np.argsort, pars)  # sorted off the loop
        sorted_pars = pars[by_parent]
        seen = np.zeros(len(kids), bool)
        seen[lost] = True
        found = [kids[lost]]
        todo = [kids[lost]]
        n, done = min(self.cfg.slice_blocks, self.cfg.batch_keys), 0
        slices = Slices(self.counters)
        while todo:
            chunk = todo.pop()
            for lo in range(0, len(chunk), n):
                frontier = chunk[lo : lo + n]
                at = by_parent[
                    ranges(*(np.searchsorted(sorted_pars, frontier, s) for s in ("left", "right")))
                ]
                at = at[~seen[at]]
                seen[at] = True
                if len(at):
                    found.append(kids[at])
                    todo.append(kids[at])
                done += len(frontier)
                self.progress = ("chains", done)
                await slices.end()
        return np.concatenate(found)

    # ------------------------------------------------------------ progress

    def extra_metrics(self) -> Iterator[Metric]:
        """``tierkv_orphans_found_bytes_total{tier, namespace}`` and the last pass's
        ``tierkv_orphans_last_pass_bytes{tier, namespace}``."""
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
        for (tier, ns), nbytes in sorted(self.found_bytes.items()):
            total.add_metric([tier, ns], nbytes)
            last.add_metric([tier, ns], self.last_bytes.get((tier, ns), 0))
        yield total
        yield last


def _failures(peer: NodeClient) -> int:
    """The calls ``peer`` failed or skipped so far (an EXISTS that failed answers "absent")."""
    c = peer.counters
    return c["timeouts"] + c["errors"] + c["skipped"]
