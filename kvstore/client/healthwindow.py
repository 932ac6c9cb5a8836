"""One node's recent figures, for comparing nodes over the same window (kvstore/client/health.py).

Contract: a :class:`Window` keeps the samples of the last ``window_s`` seconds (latencies of
small calls, GET bandwidths, hedged-away reads), at most ``MAX_SAMPLES`` of each (bounded).
:func:`weight` is a node's read preference from its window and its peers'; :func:`is_outlier`
says whether a node's window marks it as an outlier against its peers' windows
of the same moment: it needs at least ``MIN_SAMPLES`` samples of a kind in the node's window
and two peers with as many, so a noisy single sample never decides, and peers slowed by the
same busy host raise the bar with them.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

MAX_SAMPLES = 256
MIN_SAMPLES = 3


_TICK_S = 0.1  # summaries are recomputed at most this often unless a sample was added


class _Series:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._cached: tuple[int, int, int, float | None] | None = None  # (adds, tick, n, median)
        self._adds = 0

    def add(self, value: float) -> None:
        self._items.append((time.monotonic(), value))
        self._adds += 1

    def _summary(self) -> tuple[int, float | None]:
        """(samples in the window, their median or None below ``MIN_SAMPLES``), cached: every
        call of the data path asks, so this must not sort on each."""
        now = time.monotonic()
        tick = int(now / _TICK_S)
        c = self._cached
        if c is not None and c[0] == self._adds and c[1] == tick:
            return c[2], c[3]
        cut = now - self.window_s
        items = self._items
        while items and items[0][0] < cut:
            items.popleft()
        n = len(items)
        med = statistics.median([v for _, v in items]) if n >= MIN_SAMPLES else None
        self._cached = (self._adds, tick, n, med)
        return n, med

    def count(self) -> int:
        return self._summary()[0]

    def median(self) -> float | None:
        return self._summary()[1]


class Window:
    def __init__(self, window_s: float) -> None:
        self.latency = _Series(window_s)
        self.bandwidth = _Series(window_s)
        self.late = _Series(window_s)

    def add_latency(self, seconds: float) -> None:
        self.latency.add(seconds)

    def add_bandwidth(self, bytes_per_s: float) -> None:
        self.bandwidth.add(bytes_per_s)

    def add_late(self) -> None:
        self.late.add(1.0)

    def lates(self) -> int:
        return self.late.count()

    def median_latency(self) -> float | None:
        return self.latency.median()

    def median_bandwidth(self) -> float | None:
        return self.bandwidth.median()

    def summary(self) -> str:
        lat, bw = self.median_latency(), self.median_bandwidth()
        return (
            f"lat_ms={'-' if lat is None else round(lat * 1e3, 1)},"
            f"bw_mb_s={'-' if bw is None else round(bw / 1e6, 1)},lates={self.lates()}"
        )


def is_outlier(me: Window, peers: list[Window], cfg: Any) -> bool:
    """``me`` against ``peers`` (the other healthy nodes' windows), as the module docstring says;
    ``cfg``: ``outlier_factor``, ``hedge_floor_s``, ``late_eject_count``."""
    f = cfg.outlier_factor
    lat = me.median_latency()
    if lat is not None and lat > cfg.hedge_floor_s:
        lats = [x for x in (p.median_latency() for p in peers) if x is not None]
        if len(lats) >= 2 and lat > f * statistics.median(lats):
            return True
    bw = me.median_bandwidth()
    if bw is not None:
        bws = [x for x in (p.median_bandwidth() for p in peers) if x is not None]
        if len(bws) >= 2 and bw * f < statistics.median(bws):
            return True
    lates = me.lates()
    if lates >= cfg.late_eject_count and len(peers) >= 1:
        return lates >= f * statistics.median([p.lates() for p in peers])
    return False


def weight(me: Window, peers: list[Window]) -> float:
    """In (0, 1]: 1 for a node as fast as its peers, lower the more it was late (hedged away)
    or slower than their median latency or bandwidth in the window (reads prefer the heavier
    owner: kvstore/client/reads.py)."""
    x = 1.0 / (1.0 + me.lates())
    bw = me.median_bandwidth()
    if bw is not None:
        theirs = [b for b in (p.median_bandwidth() for p in peers) if b is not None]
        if theirs:
            x *= min(1.0, bw / statistics.median(theirs))
    lat = me.median_latency()
    if lat is not None:
        theirs = [t for t in (p.median_latency() for p in peers) if t is not None]
        if theirs:
            x *= min(1.0, statistics.median(theirs) / lat)
    return x
