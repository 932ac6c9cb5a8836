"""Which nodes the cluster client uses, judged on the data path: a busy node is a slower one,
not a broken one.

Contract:
- Estimates: every call the client makes is timed (:meth:`Health.observe`), less the time the
  client's own event loop was blocked meanwhile (:class:`~kvstore.client.looplag.LoopLag`: a
  late answer while the client could not run is not the node's fault; a call during which the
  loop was blocked for more than half its time is no sample). An EWMA of each node's latency
  (small calls: EXISTS) and bandwidth (GET payload bytes per second) gives :meth:`expected`;
  reads hedge past it (kvstore/client/reads.py). The samples of the last ``health_window_s``
  are kept per node (:class:`~kvstore.client.healthwindow.Window`; bandwidth only from reads
  of at least ``bandwidth_min_bytes``) to compare nodes over one window.
- The floor: no ejection health decides, whatever its reason (``outlier``, ``late``,
  ``unresponsive``, ``down``), leaves fewer than :meth:`view_floor` nodes in the view:
  ``max(replicas, majority of the members)``. An ejection refused for it is counted
  (``kept_for_floor_<why>``; slowness also as ``slow_kept_for_floor``) and the node stays in
  the view, weighted down where it is late or silent: lookups and reads still ask it, after
  its co-owner, so the blocks only it holds are found the moment it answers again (a node
  whose connection is refused or reset is skipped while its client is down, and is back in
  the view as soon as it reconnects). :meth:`Health.eject` itself is the unconditional
  primitive (an operator's or a test's decision).
- Slowness lowers a node's :meth:`weight` (reads go to the heavier owner first); it ejects the
  node only when the node is an outlier against its peers' figures of the same window (median
  latency over ``outlier_factor`` times theirs and over ``hedge_floor_s``; median bandwidth
  under theirs over ``outlier_factor``; or at least ``late_eject_count`` hedged-away reads and
  ``outlier_factor`` times their median count), floor permitting.
- Silence is judged twice: a node client marked down (refused, reset, closed:
  kvstore/client/node.py) is ``down``. A call past its deadline (a lookup, a read, a write)
  alone is not a failure (:meth:`Health.timed_out`: a latency or lateness sample): the node is
  weighted down at once (``quiet``: weight ``QUIET_WEIGHT``, counted
  ``weighted_down_unresponsive``; reads go to its co-owner first) and asked again with one
  small STATS under ``confirm_timeout_s`` (extended by the client's loop lag meanwhile); only
  when that gets no answer is it ejected (``unresponsive``), floor permitting. Any answer
  lifts the weight. A late GET or PUT is also lateness the window judges (``late``, floor
  permitting); a lookup's missed deadline is only a latency sample: lookups that time out
  together when a node stalls for a moment never make an outlier of it at once.
- Readmission with backoff: an ejected node stays out ``eject_base_s``; after a failure
  (``down``, ``unresponsive``) that doubles per further failure within ``flap_window_s`` (at
  most ``eject_max_s``); an ejection for slowness never doubles it (on a busy host every node
  is slow now and then: a doubling back-off kept nodes out for longer each time). Then, once its node client
  reconnected, a probe (``probe_rounds`` EXISTS of ``probe_keys`` keys, about 70 KiB each, so
  it cannot fit in a token bucket's burst) goes to it and, at the same time, to a healthy peer:
  it is readmitted when its probe, less loop lag, took at most ``max(probe_deadline_s,
  probe_factor x the peer's)`` with no error (sized to what the cluster does now, so a busy
  host readmits a node as fast as an idle one; a node moving bytes many times slower than its
  peers stays out). With no healthy peer, any probe that finishes within ``outlier_factor x
  probe_deadline_s`` readmits it.
- A slow replica beats none: when a node is ejected for a failure (or kept for the floor
  after one), every node out only for being slow whose connection is up is readmitted at
  once (``readmitted_on_failure``).
- What the data path waited for, per node (:attr:`Health.missed`, keyed ``(address, kind)``):
  ``hedged`` reads it lost to their hedge, ``read``/``write`` calls past their deadline, and
  ``lookup``/``call`` calls past their deadline while it was in the view (a probe of an ejected
  node is no wait of the data path). What a test asserts instead of a request's elapsed time:
  a partitioned node costs its first request one missed deadline, then nothing.
- Every ejection and readmission is logged (``event=cluster_node_out|cluster_node_up`` with
  ``why``) and counted (``ejected_<why>``, ``readmitted_<why>``, ``marked_down``,
  ``marked_up``); :meth:`time_out` gives each node's seconds out of the view.
Loop-bound, like the node clients. ``close()`` stops probes and the loop-lag monitor.
One file (~400 lines) on purpose: the estimates, the floor, the two judgements of silence
and readmission decide together whether a node is in the view; the sample window and the
probe live apart (healthwindow.py, healthprobe.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvstore.client.healthprobe import Prober
from kvstore.client.healthwindow import Window, is_outlier
from kvstore.client.healthwindow import weight as window_weight
from kvstore.client.looplag import LoopLag
from kvstore.client.node import NodeClient

log = logging.getLogger("kvstore.client")
_ALPHA = 0.2  # EWMA weight of a new sample
SLOW = frozenset({"outlier", "late"})  # ejections for slowness (not failures)
QUIET_WEIGHT = 0.01  # the weight of a node that answered nothing for a confirm deadline


@dataclass
class Estimate:
    latency_s: float | None = None  # EWMA of small-call times
    bytes_per_s: float | None = None  # EWMA of GET payload bandwidth
    samples: int = 0


class Health:
    def __init__(self, nodes: dict[str, NodeClient], cfg: Any) -> None:
        """``cfg``: the :class:`kvstore.client.config.ClusterConfig`."""
        self.nodes = nodes  # shared with the cluster client, which adds and removes members
        self.cfg = cfg
        self.counters: Counter[str] = Counter()
        self.missed: Counter[tuple[str, str]] = Counter()  # (address, kind): module doc
        self.estimates: dict[str, Estimate] = {}
        self.windows: dict[str, Window] = {}
        self.lag = LoopLag(cfg.loop_lag_interval_s, max(10.0, cfg.health_window_s))
        self._suspect: dict[str, str] = {}  # address -> why it is out
        self._out_since: dict[str, float] = {}
        self._out_total: Counter[str] = Counter()
        self._out_until: dict[str, float] = {}
        self._ejections: dict[str, list[float]] = {}
        self._probes: dict[str, asyncio.Task] = {}
        self._confirms: dict[str, asyncio.Task] = {}
        self._quiet: dict[str, float] = {}  # address -> when it first answered nothing (weighted down)
        self.prober = Prober(self, cfg)
        self._closed = False

    def start(self) -> None:
        """Start the loop-lag monitor on the running loop (idempotent)."""
        if not self._closed:
            self.lag.start()

    def healthy(self, addr: str) -> bool:
        node = self.nodes.get(addr)
        return node is not None and node.up and addr not in self._suspect

    def why_out(self, addr: str) -> str | None:
        return self._suspect.get(addr)

    def forget(self, addr: str) -> None:
        """The member left."""
        self._readmit(addr, None)
        for d in (
            self.estimates,
            self.windows,
            self._ejections,
            self._out_until,
            self._out_total,
            self._quiet,
        ):
            d.pop(addr, None)
        for tasks in (self._probes, self._confirms):
            t = tasks.pop(addr, None)
            if t is not None:
                t.cancel()

    def time_out(self) -> dict[str, float]:
        """Per member: seconds it spent out of the view so far (ejected or its client down)."""
        now = time.monotonic()
        out = dict(self._out_total)
        for a, t in self._out_since.items():
            out[a] = out.get(a, 0.0) + now - t
        return {a: round(out.get(a, 0.0), 3) for a in self.nodes}

    # ------------------------------------------------------------ estimates and weight

    def discounted(self, seconds: float) -> float:
        """``seconds`` of a call that just ended, less the loop lag meanwhile."""
        now = time.monotonic()
        blocked = self.lag.blocked(now - seconds, now)
        if blocked > 0:
            self.counters["loop_lag_discounted"] += 1
        return max(seconds - blocked, 1e-6)

    def _blocked_most(self, seconds: float) -> bool:
        """Whether the client's loop was blocked for most of a call that just ended (its time
        then says nothing about the node)."""
        now = time.monotonic()
        return self.lag.blocked(now - seconds, now) > seconds / 2

    def observe(self, addr: str, seconds: float, nbytes: int = 0, op: str = "exists") -> None:
        """A call to ``addr`` took ``seconds`` (moving ``nbytes`` of payload); then the usual
        after-call check. An outlier in its window is ejected when the floor allows."""
        node = self.nodes.get(addr)
        if node is None or not node.up:
            self.after_call(addr)
            return
        if self._blocked_most(seconds):
            self.counters["samples_skipped_loop_lag"] += 1
            self.after_call(addr)
            return
        if self._quiet.pop(addr, None) is not None:
            self.counters["quiet_answered"] += 1  # it answers again: its weight is its window's
        s = self.discounted(seconds)
        e = self.estimates.setdefault(addr, Estimate())
        w = self.windows.setdefault(addr, Window(self.cfg.health_window_s))
        if op == "get" and nbytes:
            lat = e.latency_s or 0.0
            bw = nbytes / max(s - lat, s / 2, 1e-6)
            e.bytes_per_s = bw if e.bytes_per_s is None else (1 - _ALPHA) * e.bytes_per_s + _ALPHA * bw
            if nbytes >= self.cfg.bandwidth_min_bytes:  # a small read's bandwidth is noise
                w.add_bandwidth(bw)
        elif op == "exists":
            e.latency_s = s if e.latency_s is None else (1 - _ALPHA) * e.latency_s + _ALPHA * s
            w.add_latency(s)
        e.samples += 1
        self._judge(addr, "outlier")

    def late(self, addr: str, seconds: float) -> None:
        """A read of ``addr`` lost to its hedge after ``seconds``: lateness, not a failure."""
        self.missed[addr, "hedged"] += 1
        if self.discounted(seconds) < self.cfg.hedge_floor_s:
            self.counters["late_reads_discounted"] += 1  # the client's loop was the late one
            return
        self.counters["late_reads"] += 1
        self.windows.setdefault(addr, Window(self.cfg.health_window_s)).add_late()
        self._judge(addr, "late")

    def timed_out(self, addr: str, op: str, seconds: float) -> None:
        """A call ``op`` to ``addr`` missed its deadline after ``seconds`` (its node client
        stays up: this is lateness, not a failure). An EXISTS or STATS is a latency sample of
        the window (a lower bound of the node's); a GET or PUT, whose time grows with its bytes,
        counts as late like a hedged-away read and is judged as lateness by the window (floor
        permitting); a small call's is judged only by the confirm. The node is weighted down at
        once; then one small call confirms it still answers at all: an answer lifts the weight,
        none ejects it (``unresponsive``), floor permitting."""
        kind = "lookup" if op == "EXISTS" else "write" if op == "PUT" else "read" if op == "GET" else "call"
        self.counters[f"{kind}_timeouts"] += 1
        if kind in ("read", "write") or self.healthy(addr):  # probes only look up and STATS
            self.missed[addr, kind] += 1
        if self._closed or not self.healthy(addr):
            return
        if self._blocked_most(seconds):
            self.counters[f"{kind}_timeouts_loop_lag"] += 1  # the client was late, not the node
            return
        # silence first weighs the node down (reads go to its co-owner first). A late GET or
        # PUT is judged as lateness by the window (a node that moves bytes too slowly loses its
        # writes to the next rank); a small call that got no answer is silence, which only the
        # confirm judges: a burst of lookups timing out together (a node stalled for a moment)
        # would otherwise make an outlier of it at once
        if addr not in self._quiet:
            self._quiet[addr] = time.monotonic()
            self.counters["weighted_down_unresponsive"] += 1
        w = self.windows.setdefault(addr, Window(self.cfg.health_window_s))
        if op in ("GET", "PUT"):
            w.add_late()
            self._judge(addr, "late")
            if not self.healthy(addr):
                return
        else:
            w.add_latency(self.discounted(seconds))
        t = self._confirms.get(addr)
        if t is None or t.done():
            self._confirms[addr] = asyncio.get_running_loop().create_task(self._confirm(addr))

    async def _confirm(self, addr: str) -> None:
        """Ask a node (weighted down) past a deadline for one small answer: an answer lifts its
        weight; none ejects it, floor permitting (module doc)."""
        node = self.nodes.get(addr)
        if node is None:
            return
        if await self.prober.answers(node, self.cfg.confirm_timeout_s):
            self.counters["timeouts_forgiven"] += 1
            self._quiet.pop(addr, None)
        elif (
            self.nodes.get(addr) is node
            and self.healthy(addr)
            and not self.eject_within_floor(addr, "unresponsive")
        ):
            log.info("event=cluster_node_quiet node=%s weight=%s kept_for_floor=1", addr, QUIET_WEIGHT)

    def weight(self, addr: str) -> float:
        """In (0, 1]: 1 for a node as fast as its peers, lower the more it was late or slower
        than they are in the current window (:func:`~kvstore.client.healthwindow.weight`);
        at most ``QUIET_WEIGHT`` while it answers nothing (module doc)."""
        w = self.windows.get(addr)
        x = 1.0 if w is None else window_weight(w, self._peers(addr))
        return min(x, QUIET_WEIGHT) if addr in self._quiet else x

    def quiet(self, addr: str) -> bool:
        """Whether ``addr`` is weighted down for answering nothing (still in the view)."""
        return addr in self._quiet

    def expected(self, addr: str, nbytes: int = 0) -> float | None:
        """The node's expected time for a call moving ``nbytes`` (None before estimates)."""
        e = self.estimates.get(addr)
        if e is None or e.latency_s is None:
            return None
        return e.latency_s + (nbytes / e.bytes_per_s if e.bytes_per_s else 0.0)

    def _peers(self, addr: str) -> list[Window]:
        return [w for a, w in self.windows.items() if a != addr and self.healthy(a)]

    def _judge(self, addr: str, why: str) -> None:
        """Eject ``addr`` for slowness only when it is an outlier in this window and the view
        keeps its floor."""
        w = self.windows.get(addr)
        if w is None or addr in self._suspect or not is_outlier(w, self._peers(addr), self.cfg):
            self.after_call(addr)
            return
        if not self._room_for_one_more_out():
            self.counters["slow_kept_for_floor"] += 1
        self.eject_within_floor(addr, why)

    def view_floor(self) -> int:
        """The fewest healthy nodes a slowness ejection may leave."""
        return min(len(self.nodes), max(self.cfg.replicas, len(self.nodes) // 2 + 1))

    def _room_for_one_more_out(self) -> bool:
        return sum(1 for a in self.nodes if self.healthy(a)) - 1 >= self.view_floor()

    def eject_within_floor(self, addr: str, why: str) -> bool:
        """Eject ``addr`` unless that leaves the view under :meth:`view_floor` (then it stays,
        counted ``kept_for_floor_<why>``); whether it was ejected. A node whose client is
        down does not count as in the view: it is no room for another ejection."""
        if addr in self._suspect or self._closed or addr not in self.nodes:
            return False
        node = self.nodes[addr]
        in_view = sum(1 for a in self.nodes if self.healthy(a))
        after = in_view - (1 if node.up else 0)  # a down node is out of the view already
        if after < self.view_floor():
            self.counters[f"kept_for_floor_{why}"] += 1
            if why not in SLOW:
                self._readmit_slow()  # a failure with the view at its floor: slow beats none
            return False
        self.eject(addr, why)
        return True

    # ------------------------------------------------------------ ejection and readmission

    def after_call(self, addr: str) -> None:
        """Call after each call to ``addr``: a node that went down is ejected."""
        node = self.nodes.get(addr)
        if node is None or node.up or addr in self._suspect or self._closed:
            return
        self.eject_within_floor(addr, "down")

    def eject(self, addr: str, why: str) -> None:
        """Take ``addr`` out of the view now (no floor: the caller decided; health's own
        decisions go through :meth:`eject_within_floor`)."""
        if addr in self._suspect or self._closed or addr not in self.nodes:
            return
        now = time.monotonic()
        out_s = self.cfg.eject_base_s
        if why not in SLOW:  # failures back off; slowness never doubles (module doc)
            recent = [t for t in self._ejections.get(addr, []) if now - t < self.cfg.flap_window_s]
            recent.append(now)
            self._ejections[addr] = recent
            out_s = min(self.cfg.eject_max_s, self.cfg.eject_base_s * 2 ** (len(recent) - 1))
        self._out_until[addr] = now + out_s
        self._suspect[addr] = why
        self._quiet.pop(addr, None)
        self._out_since.setdefault(addr, now)
        self.counters["marked_down"] += 1
        self.counters[f"ejected_{why}"] += 1
        e, w = self.estimates.get(addr), self.windows.get(addr)
        log.info(
            "event=cluster_node_out node=%s why=%s out_s=%.1f latency_s=%s bytes_per_s=%s window=%s",
            addr,
            why,
            out_s,
            e and e.latency_s,
            e and e.bytes_per_s,
            w and w.summary(),
        )
        if addr not in self._probes or self._probes[addr].done():
            self._probes[addr] = asyncio.get_running_loop().create_task(self._probe(addr))
        if why not in SLOW:
            self._readmit_slow()

    def _readmit(self, addr: str, why: str | None) -> None:
        """Back in the view (``why``: the reason logged and counted; None: the member left)."""
        was = self._suspect.pop(addr, None)
        since = self._out_since.pop(addr, None)
        if since is not None:
            self._out_total[addr] += time.monotonic() - since
        if was is None or why is None:
            return
        # start afresh: old samples described the slow node
        self.estimates.pop(addr, None)
        self.windows.pop(addr, None)
        self.counters["marked_up"] += 1
        self.counters[f"readmitted_{why}"] += 1
        log.info("event=cluster_node_up node=%s why=%s was_out_for=%s", addr, why, was)

    def _readmit_slow(self) -> None:
        """A node failed: take back the nodes that are out only for being slow."""
        for addr, why in list(self._suspect.items()):
            node = self.nodes.get(addr)
            if why in SLOW and node is not None and node.up:
                t = self._probes.pop(addr, None)
                if t is not None:
                    t.cancel()
                self._readmit(addr, "on_failure")

    async def _probe(self, addr: str) -> None:
        while not self._closed and addr in self.nodes and addr in self._suspect:
            await asyncio.sleep(
                max(self.cfg.probe_interval_s, self._out_until.get(addr, 0) - time.monotonic())
            )
            node = self.nodes.get(addr)
            if node is None or not node.up:
                continue  # the node client reconnects by itself first
            if await self.prober.probe_ok(addr):
                if addr in self._suspect:
                    self._readmit(addr, "probe")
                return
            self.counters["probes_failed"] += 1

    def close(self) -> None:
        self._closed = True
        for t in (*self._probes.values(), *self._confirms.values()):
            t.cancel()
        self._probes.clear()
        self._confirms.clear()
        self.lag.close()
