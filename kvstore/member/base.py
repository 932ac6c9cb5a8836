"""What every background pass of a member node shares: :class:`MemberPass`.

Contract: a pass (the repair, the orphan pass) is bound to the daemon's event loop and to the
node it works on (a :class:`~kvstore.node.store.NodeStore`). :meth:`MemberPass.start` starts
its periodic loop (the subclass's ``_run``), which runs a pass through the node's
:class:`~kvstore.member.passes.PassRunner` (one background pass at a time on the node, shared
by every pass) and survives any failure of one (``passes_failed``, logged, never raised);
:meth:`MemberPass.close` stops the loop and a pass under way (at its next await), then closes
the peer sessions and the membership (the caller closes the passes before the node: a pass
under way leases the node's memory). A pass that finds this node outside the view, or the view
shorter than two members, does nothing (``passes_skipped``). Totals since start and the last
finished pass: :meth:`stats` (JSON-able) and ``tierkv_<KIND>_<name>_total`` counters on the
daemon's registry (:meth:`register_metrics`), plus what the subclass adds
(:meth:`extra_metrics`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, Metric

from kvstore.client.membership import Membership
from kvstore.client.placement import Node
from kvstore.member.passes import PassRunner, stop_task
from kvstore.member.peer_sessions import PeerSessions
from kvstore.node.listing import KeyOrder
from kvstore.node.store import NodeStore


class MemberPass:
    """``node``: the daemon's node; ``self_addr``: this node's member address; ``token``: the
    operator token ("" without auth); ``pool_size`` connections per peer, each call under
    ``deadline_s``; ``runner``: the node's (one background pass at a time)."""

    KIND: ClassVar[str]  # its name in the runner and its metrics' prefix (tierkv_<KIND>_...)
    TITLE: ClassVar[str]  # its metrics' help text starts with it
    EVENT: ClassVar[str]  # its log events' prefix (event=<EVENT>_pass ...)
    METRICS: ClassVar[tuple[str, ...]]  # the counters exported as tierkv_<KIND>_<name>_total
    log: ClassVar[logging.Logger]

    def __init__(
        self,
        node: NodeStore,
        self_addr: str,
        membership: Membership,
        *,
        token: str,
        pool_size: int,
        deadline_s: float,
        runner: PassRunner | None,
    ) -> None:
        self.node = node
        self.runner = runner or PassRunner()
        self.self_addr = self_addr
        self.membership = membership
        self.peers = PeerSessions(token, pool_size=pool_size, deadline_s=deadline_s)
        self.counters: Counter[str] = Counter()
        self.last_pass: dict[str, Any] = {}
        self._keys = KeyOrder()  # the node's keys in one sorted snapshot per pass
        self._task: asyncio.Task | None = None
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        self._closed = True
        await stop_task(self._task)
        await self.runner.cancel(self.KIND)  # a pass under way stops at its next await
        await self.peers.close()
        await self.membership.close()

    async def _run(self) -> None:
        raise NotImplementedError

    async def _one_pass(self) -> dict[str, int]:
        raise NotImplementedError

    async def _run_kept(self) -> None:
        """One pass (or the one of this kind under way, joined) that goes on if others stop
        waiting for it: the periodic loop's. A failure is counted and logged, never raised."""
        try:
            await self.runner.run(self.KIND, self._one_pass, keep=True)
        except Exception as exc:  # a pass must never take the daemon down
            self.counters["passes_failed"] += 1
            self.log.exception("event=%s_pass_failed error=%r", self.EVENT, exc)

    # ------------------------------------------------------------ one pass

    async def _view_and_keys(self) -> tuple[list[Node], np.ndarray] | None:
        """The members to place blocks over now (sessions to the others dropped) and one
        sorted snapshot of this node's keys (sorted off the loop, walked by cursor: the order
        every pass takes, the simulation's, bench/trace_sim.py); None when this pass must skip
        (this node outside the view, or fewer than two members)."""
        view = [m.node for m in self.membership.members]
        ids = {n.id for n in view}
        await self.peers.forget_except(ids)
        if self.self_addr not in ids or len(view) < 2:
            self.counters["passes_skipped"] += 1
            return None
        return view, await self._keys.build(self.node.tiers)

    def _finished(self, done: Counter[str], began: float, **extra: int) -> dict[str, int]:
        """Add a finished pass's counts to the totals and keep them, with ``extra``, as the last
        pass. ``began``: its ``time.monotonic()`` at start. Returns the counts."""
        self.counters.update(done)
        self.counters["passes"] += 1
        self.last_pass = {
            "seconds": round(time.monotonic() - began, 3),
            "finished": time.time(),
            **done,
            **extra,
        }
        return dict(done)

    def _log_pass(self, done: Counter[str]) -> None:
        self.log.info("event=%s_pass %s", self.EVENT, " ".join(f"{k}={v}" for k, v in sorted(done.items())))

    # ------------------------------------------------------------ progress

    def stats(self) -> dict[str, Any]:
        """Totals since start and the last finished pass (JSON-able)."""
        return {"totals": dict(self.counters), "last_pass": dict(self.last_pass)}

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Export the totals as ``tierkv_<KIND>_<name>_total`` counters (and
        :meth:`extra_metrics`) on ``registry``: the daemon's, so they show on /metrics, in
        ``/v1/stats`` and in ``kvstore stats``."""
        registry.register(_PassCollector(self))

    def extra_metrics(self) -> Iterator[Metric]:
        """The families a pass exports beyond its counters (none here)."""
        return iter(())


class _PassCollector:
    def __init__(self, p: MemberPass) -> None:
        self.p = p

    def collect(self) -> Iterator[Metric]:
        p = self.p
        for name in p.METRICS:
            fam = CounterMetricFamily(f"tierkv_{p.KIND}_{name}", f"{p.TITLE}: {name.replace('_', ' ')}")
            fam.add_metric([], p.counters[name])
            yield fam
        yield from p.extra_metrics()
