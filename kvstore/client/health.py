"""Which nodes the cluster client uses, judged on the data path.

Contract:
- Estimates: every call the client makes is timed (:meth:`Health.observe`): an EWMA of each
  node's latency (small calls: EXISTS) and of its bandwidth (GET payload bytes per second).
  :meth:`expected` is a node's expected time for a call moving ``nbytes``; reads hedge to
  another replica when a node passes it (kvstore/client/reads.py).
- Ejection: a node whose call failed or missed its deadline (its :class:`NodeClient` marked it
  down), or that is an outlier (latency over ``outlier_factor`` times the median of the other
  healthy nodes' and over ``hedge_floor_s``, or GET bandwidth under their median divided by
  ``outlier_factor``), becomes *suspect* and is skipped.
- Readmission with backoff: a suspect node stays out for ``eject_base_s``, doubled for each
  further ejection within ``flap_window_s`` (at most ``eject_max_s``); after that, a probe
  waits until its node client reconnected, then sends ``probe_rounds`` EXISTS of
  ``probe_keys`` keys each (about 70 KiB per round, so a probe cannot fit in the burst of a
  token-bucket link) and readmits the node only when all of them finish within
  ``probe_deadline_s``. So a node that accepts connections but moves bytes slowly (a congested
  or policed link, an overloaded host) stays out.
- Slowness is a preference, a failure a loss: when a node is ejected because it went down,
  every node that is out only for being slow (``outlier``, ``late``) and whose connection is
  up is readmitted at once (``readmitted_on_failure``), since a slow replica beats none (with
  replicas=2, the blocks a slow and a dead node shared would otherwise all miss). Outlier
  checks need two healthy peers, so a shrunken cluster does not eject it again at once.
Loop-bound, like the node clients.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvstore.client.node import NodeClient
from kvstore.keys import BlockKey

log = logging.getLogger("kvstore.client")
_ALPHA = 0.2  # EWMA weight of a new sample


@dataclass
class Estimate:
    latency_s: float | None = None  # EWMA of small-call times
    bytes_per_s: float | None = None  # EWMA of GET payload bandwidth
    samples: int = 0


class Health:
    def __init__(self, nodes: dict[str, NodeClient], cfg: Any) -> None:
        """``cfg``: the :class:`kvstore.client.cluster.ClusterConfig` (probe_*, eject_*, ...)."""
        self.nodes = nodes  # shared with the cluster client, which adds and removes members
        self.cfg = cfg
        self.counters: Counter[str] = Counter()
        self.estimates: dict[str, Estimate] = {}
        self._suspect: dict[str, str] = {}  # address -> why it is out
        self._out_until: dict[str, float] = {}
        self._ejections: dict[str, list[float]] = {}
        self._probes: dict[str, asyncio.Task] = {}
        self._probe_keys = [BlockKey(i.to_bytes(16, "big")) for i in range(1, cfg.probe_keys + 1)]
        self._closed = False

    def healthy(self, addr: str) -> bool:
        node = self.nodes.get(addr)
        return node is not None and node.up and addr not in self._suspect

    def forget(self, addr: str) -> None:
        """The member left."""
        self._suspect.pop(addr, None)
        self.estimates.pop(addr, None)
        self._ejections.pop(addr, None)
        self._out_until.pop(addr, None)
        t = self._probes.pop(addr, None)
        if t is not None:
            t.cancel()

    # ------------------------------------------------------------ estimates

    def observe(self, addr: str, seconds: float, nbytes: int = 0, op: str = "exists") -> None:
        """A call to ``addr`` took ``seconds`` (moving ``nbytes`` of payload); then the usual
        after-call check. An outlier is ejected."""
        e = self.estimates.setdefault(addr, Estimate())
        node = self.nodes.get(addr)
        if node is not None and node.up:
            if op == "get" and nbytes:
                lat = e.latency_s or 0.0
                bw = nbytes / max(seconds - lat, seconds / 2, 1e-6)
                e.bytes_per_s = bw if e.bytes_per_s is None else (1 - _ALPHA) * e.bytes_per_s + _ALPHA * bw
            elif op == "exists":
                e.latency_s = (
                    seconds if e.latency_s is None else (1 - _ALPHA) * e.latency_s + _ALPHA * seconds
                )
            e.samples += 1
            if self._outlier(addr):
                self.eject(addr, "outlier")
                return
        self.after_call(addr)

    def late(self, addr: str, seconds: float) -> None:
        """A read of ``addr`` lost to its hedge after ``seconds``: the node is ejected."""
        self.counters["late_reads"] += 1
        self.eject(addr, "late")

    def expected(self, addr: str, nbytes: int = 0) -> float | None:
        """The node's expected time for a call moving ``nbytes`` (None before estimates)."""
        e = self.estimates.get(addr)
        if e is None or e.latency_s is None:
            return None
        return e.latency_s + (nbytes / e.bytes_per_s if e.bytes_per_s else 0.0)

    def _outlier(self, addr: str) -> bool:
        """Latency over ``outlier_factor`` times the other healthy nodes' median (and over
        ``hedge_floor_s``), or GET bandwidth under their median over ``outlier_factor``."""
        me = self.estimates[addr]
        if me.samples < 3:
            return False
        peers = [e for a, e in self.estimates.items() if a != addr and self.healthy(a) and e.samples >= 3]
        lats = [e.latency_s for e in peers if e.latency_s is not None]
        limit = max(self.cfg.hedge_floor_s, self.cfg.outlier_factor * statistics.median(lats)) if lats else 0
        if me.latency_s is not None and len(lats) >= 2 and me.latency_s > limit:
            return True
        bws = [e.bytes_per_s for e in peers if e.bytes_per_s is not None]
        return (
            me.bytes_per_s is not None
            and len(bws) >= 2
            and me.bytes_per_s * self.cfg.outlier_factor < statistics.median(bws)
        )

    # ------------------------------------------------------------ ejection and readmission

    def after_call(self, addr: str) -> None:
        """Call after each call to ``addr``: a node that went down is ejected."""
        node = self.nodes.get(addr)
        if node is None or node.up or addr in self._suspect or self._closed:
            return
        self.eject(addr, "down")

    def eject(self, addr: str, why: str) -> None:
        if addr in self._suspect or self._closed or addr not in self.nodes:
            return
        now = time.monotonic()
        recent = [t for t in self._ejections.get(addr, []) if now - t < self.cfg.flap_window_s]
        recent.append(now)
        self._ejections[addr] = recent
        out_s = min(self.cfg.eject_max_s, self.cfg.eject_base_s * 2 ** (len(recent) - 1))
        self._out_until[addr] = now + out_s
        self._suspect[addr] = why
        self.counters["marked_down"] += 1
        self.counters[f"ejected_{why}"] += 1
        e = self.estimates.get(addr)
        log.info(
            "event=cluster_node_out node=%s why=%s out_s=%.1f latency_s=%s bytes_per_s=%s",
            addr,
            why,
            out_s,
            e and e.latency_s,
            e and e.bytes_per_s,
        )
        if addr not in self._probes or self._probes[addr].done():
            self._probes[addr] = asyncio.get_running_loop().create_task(self._probe(addr))
        if why == "down":
            self._readmit_slow()

    def _readmit_slow(self) -> None:
        """A node failed: take back the nodes that are out only for being slow."""
        for addr, why in list(self._suspect.items()):
            node = self.nodes.get(addr)
            if why in ("outlier", "late") and node is not None and node.up:
                del self._suspect[addr]
                self.estimates.pop(addr, None)
                t = self._probes.pop(addr, None)
                if t is not None:
                    t.cancel()
                self.counters["marked_up"] += 1
                self.counters["readmitted_on_failure"] += 1
                log.info("event=cluster_node_up node=%s why=another_node_failed", addr)

    async def _probe(self, addr: str) -> None:
        while not self._closed and addr in self.nodes:
            await asyncio.sleep(
                max(self.cfg.probe_interval_s, self._out_until.get(addr, 0) - time.monotonic())
            )
            node = self.nodes.get(addr)
            if node is None or not node.up:
                continue  # the node client reconnects by itself first
            if await self._probe_ok(node):
                self._suspect.pop(addr, None)
                self.estimates.pop(addr, None)  # start afresh: old samples described the slow node
                self.counters["marked_up"] += 1
                log.info("event=cluster_node_up node=%s", addr)
                return
            self.counters["probes_failed"] += 1

    async def _probe_ok(self, node: NodeClient) -> bool:
        end = time.monotonic() + self.cfg.probe_deadline_s
        for _ in range(self.cfg.probe_rounds):
            left = end - time.monotonic()
            if left <= 0:
                return False
            before = node.counters["timeouts"] + node.counters["errors"]
            await node.exists(self._probe_keys, left)
            if not node.up or node.counters["timeouts"] + node.counters["errors"] != before:
                return False
        return time.monotonic() <= end

    def close(self) -> None:
        self._closed = True
        for t in self._probes.values():
            t.cancel()
        self._probes.clear()
