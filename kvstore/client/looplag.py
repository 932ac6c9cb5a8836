"""How long the client's own event loop was blocked: a small monitor the cluster client owns.

Contract: :class:`LoopLag` runs one task on the loop it is started on that sleeps
``interval_s`` and records by how much each wake-up came late (the time the loop could not run
anything: a blocking call in the engine, the process not scheduled on a busy host). ``blocked(t0,
t1)`` is the total lateness recorded by wake-ups in ``(t0, t1]`` (monotonic seconds), so a node
call that took ``t1 - t0`` kept the node busy for at most ``t1 - t0 - blocked(t0, t1)``: health
discounts it (kvstore/client/health.py). At most ``window_s`` of history is kept (a bounded
deque). ``close()`` stops the task; before ``start()`` or after ``close()`` nothing is blocked.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque


class LoopLag:
    def __init__(self, interval_s: float = 0.01, window_s: float = 10.0) -> None:
        if not 0 < interval_s < window_s:
            raise ValueError(f"loop lag: need 0 < interval_s < window_s, got {interval_s}, {window_s}")
        self.interval_s = interval_s
        self.window_s = window_s
        self._at: deque[float] = deque()  # wake-up times, ascending
        self._late: deque[float] = deque()  # how late each of those wake-ups was
        self._task: asyncio.Task | None = None
        self._due: float | None = None  # when the monitor's current sleep should end
        self.worst_s = 0.0  # the largest lateness seen (for logs and benchmarks)

    def start(self) -> None:
        """Start measuring on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        step = self.interval_s
        while True:
            t0 = time.monotonic()
            self._due = t0 + step
            await asyncio.sleep(step)
            now = time.monotonic()
            late = max(0.0, now - self._due)
            if late > 0.001:  # below a millisecond is the timer's own noise
                self._at.append(now)
                self._late.append(late)
                self.worst_s = max(self.worst_s, late)
            while self._at and now - self._at[0] > self.window_s:
                self._at.popleft()
                self._late.popleft()

    def blocked(self, t0: float, t1: float | None = None) -> float:
        """Seconds the loop was blocked during ``(t0, t1]`` (``t1``: now), as far as known."""
        now = time.monotonic()
        t1 = now if t1 is None else t1
        at = self._at
        # the monitor's own wake-up overdue now: the loop is only just running again (a call
        # whose answer was noticed late runs before the monitor's timer callback)
        total = max(0.0, now - self._due) if self._due is not None and self._task is not None else 0.0
        if at and at[-1] > t0:
            lo = bisect.bisect_right(at, t0)
            hi = bisect.bisect_right(at, t1)
            total += sum(self._late[i] for i in range(lo, hi))
        return min(total, max(t1 - t0, 0.0))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._due = None
        self._at.clear()
        self._late.clear()
