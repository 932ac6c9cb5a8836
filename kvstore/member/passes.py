"""One background pass at a time per node: the repair and the orphan pass share a
:class:`PassRunner` (kvstore/daemon/member.py makes one per node).

Contract: :meth:`PassRunner.run` runs a pass of a kind (``"repair"``, ``"orphans"``) or joins
the one of that kind already running (its result is every caller's), and passes of any kind
run one after the other, never together, so a node's background work is one pass's slices
however many operators ask (issue 34: ten concurrent ``POST /v1/orphans/pass`` ran ten passes,
8x another tenant's GET p99). A caller that stops waiting -- cancelled, or its ``gone()``
turns true (an admin request whose client went away) -- withdraws; a pass nobody waits for
any more is cancelled, unless a caller that keeps it (the node's own periodic loop,
``keep=True``) joined it: a request cut off never leaves a pass running past it. Loop-bound.

:class:`Slices` ends each slice of a pass with a rest; :func:`packed`, :func:`member_of` and
:func:`ranges` let a pass's stages work on columns of raw keys (numpy), not key by key.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from kvstore.keys import KEY_BYTES, KeyBatch

T = TypeVar("T")
_POLL_S = 0.1  # how often a waiter with ``gone`` looks whether its caller went away


class PassWithdrawn(Exception):
    """The caller's ``gone()`` turned true before the pass ended: it no longer waits."""


@dataclass(eq=False)
class _Running(Generic[T]):
    task: asyncio.Task
    waiters: int = 0
    kept: bool = False  # a caller that keeps the pass going joined it


@dataclass(eq=False)
class PassRunner:
    running: dict[str, _Running] = field(default_factory=dict)
    _turn: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def run(
        self,
        kind: str,
        start: Callable[[], Awaitable[T]],
        keep: bool = False,
        gone: Callable[[], bool] | None = None,
    ) -> T:
        """The result of the pass of ``kind``: the one running, or ``start()`` once no pass of
        any kind runs. ``keep``: the pass goes on if this caller stops waiting. ``gone``:
        polled while waiting; when it turns true the caller withdraws (PassWithdrawn)."""
        r = self.running.get(kind)
        if r is None:
            r = _Running(asyncio.get_running_loop().create_task(self._one_at_a_time(kind, start)))
            self.running[kind] = r
        r.waiters += 1
        r.kept |= keep
        withdrawn = True
        try:
            while True:
                done, _ = await asyncio.wait({r.task}, timeout=_POLL_S if gone is not None else None)
                if done:
                    withdrawn = False
                    return r.task.result()
                if gone is not None and gone():
                    raise PassWithdrawn(kind)
        finally:
            r.waiters -= 1
            if withdrawn and r.waiters == 0 and not r.kept and not r.task.done():
                r.task.cancel()  # nobody waits for it any more: it stops at its next await

    async def cancel(self, kind: str) -> None:
        """Stop the pass of ``kind`` if one runs (its owner is closing), and wait for it."""
        r = self.running.get(kind)
        if r is not None:
            await stop_task(r.task)  # its callers see what it raised; the closing owner does not

    async def _one_at_a_time(self, kind: str, start: Callable[[], Awaitable[T]]) -> T:
        try:
            async with self._turn:
                return await start()
        finally:
            if self.running.get(kind) is not None and self.running[kind].task is asyncio.current_task():
                del self.running[kind]


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (None: nothing to stop) and wait for it to end; what it raised on its
    way out is its own (a member's loops and passes at close)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


class Slices:
    """The end of each slice of a pass: counted (``counters["slices"]``), then a rest on the
    loop as long as the slice ran by ``clock``, so a pass holds at most half of the loop's time
    however many blocks it walks. On a host where the node's process must wait for a core, a
    CPU-bound pass would also make every request wait for the scheduler; resting keeps the loop
    answering (bench/passes.py: another client's GET p99 1.3x during passes, against 2.3x
    yielding without a rest). ``clock``: wall time (a slice that is all CPU: the orphan pass's)
    or ``time.thread_time`` (the loop thread's CPU, for a slice that waits on peers and on its
    own pacing, the repair's: those waits are not rested again)."""

    def __init__(self, counters: Counter[str], clock: Callable[[], float] = time.perf_counter) -> None:
        self.counters = counters
        self.clock = clock
        self._began = clock()

    async def end(self) -> None:
        ran = self.clock() - self._began
        self.counters["slices"] += 1
        await asyncio.sleep(ran)  # serving traffic runs between slices (sleep(0) at least)
        self._began = self.clock()


KEY_COLUMN = f"S{KEY_BYTES}"  # a column of raw keys (numpy's order is the bytes' order)


def packed(column: np.ndarray) -> KeyBatch:
    """The keys of a key column (a slice of a sorted key snapshot, kvstore/node/listing.py
    ``KeyOrder``, or any ``KEY_COLUMN`` array) as one KeyBatch, trailing zero bytes included
    (numpy's ``S16`` items would drop them one by one)."""
    return KeyBatch(np.ascontiguousarray(column).tobytes())


def member_of(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Per key of the column ``keys``, whether the sorted column ``sorted_keys`` holds it
    (a bool array; binary searches in numpy)."""
    if not len(sorted_keys):
        return np.zeros(len(keys), bool)
    at = np.searchsorted(sorted_keys, keys).clip(max=len(sorted_keys) - 1)
    return sorted_keys[at] == keys


def ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The positions ``lo[i]..hi[i]-1`` of every ``i``, one after the other (numpy, no loop)."""
    counts = hi - lo
    starts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
    return starts + np.arange(int(counts.sum()))
