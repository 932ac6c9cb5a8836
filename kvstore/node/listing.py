"""Paging through a node's blocks by key, and the slices a long admin request runs in.

A listing pages by a stable cursor: the last key a page *looked at*, never a count of blocks.
A block that vanishes while a page is read (a delete, an eviction) only makes that page
shorter; the cursor still moves past it, and only a page that reached the end of the key
order answers "no next page". So a listing holds every block stored for its whole duration.

The key order is a sorted snapshot (:class:`KeyOrder`) rebuilt for the first page of every
listing (and when it is older than ``max_age_s``) and otherwise shared, so a page costs a
binary search instead of a pass over every key. It is only ever replaced by a newer one: the
snapshot a page reads was taken after its listing started, and holds every block stored since.

Same threading rules as the node: the tiers are read on the event loop (a tier's keys in one
numpy copy of its probe table, ``key_pairs``: no Python per key); the sort runs on a thread
(numpy releases the interpreter lock while it sorts: no Python runs there, so the loop never
waits for that thread's lock), and Python work over many keys runs in slices of
:data:`SLICE_S` (:class:`LoopSlices`) with the data port's requests served in between.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator, Sequence

import numpy as np

from kvstore.keys import KEY_BYTES

# Longest run of Python work a long admin request does on the event loop before it lets the
# loop serve what is waiting: well under a data-port round trip on an idle host (~0.3 ms),
# so a request that lands behind a slice waits a fraction of what it costs alone.
SLICE_S = 0.0002
# A rest in which the loop ran nothing but the rest itself (two idle loop iterations) takes
# a few microseconds; one that took longer served something, so the loop may have more.
_BUSY_S = 0.00005
# The longest rest between two slices while the loop stays busy: long enough for the requests
# that arrived during a slice to get through the loop (read, answer, send: ~0.1 ms), short
# enough that a long request keeps at least a third of a loop that clients keep busy.
_MAX_REST_S = 0.0004
_KEY_DTYPE = f"S{KEY_BYTES}"
KEY_CHUNK = 256  # keys turned into Python bytes per step of a page (:func:`key_chunks`)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():  # the waiting request may have been cancelled meanwhile
        fut.set_result(None)


def after_io(loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """A future the loop resolves at its next turn, *after* that turn's I/O callbacks (a
    timer due now runs after the sockets' events of its turn); ``sleep(0)`` instead resumes
    its task ahead of a request that arrived meanwhile, which then waits a whole slice more
    at each step (read, decode, reply) of its way through the loop."""
    fut = loop.create_future()
    loop.call_at(loop.time(), _wake, fut)
    return fut


class LoopSlices:
    """Cooperative time slices for a long request on the event loop: ``await tick()`` in a
    loop body yields once ``slice_s`` has run since the last yield, and then rests until the
    loop had nothing else to run (at most ``max_rest_s``): every request that arrived during
    the slice, and every step it takes through the loop, runs before the next slice."""

    def __init__(self, slice_s: float = SLICE_S, max_rest_s: float = _MAX_REST_S) -> None:
        self.slice_s = slice_s
        self.max_rest_s = max_rest_s
        self.rests = 0  # times it yielded (tests count them: the loop was let in)
        self._since = time.perf_counter()

    async def tick(self) -> None:
        if time.perf_counter() - self._since >= self.slice_s:
            await self.rest()

    async def rest(self) -> None:
        """Let the loop serve what waits, until a turn of it ran nothing else."""
        loop = asyncio.get_running_loop()
        began = time.perf_counter()
        while True:
            t = time.perf_counter()
            await after_io(loop)
            now = time.perf_counter()
            if now - t < _BUSY_S or now - began >= self.max_rest_s:
                break
        self.rests += 1
        self._since = time.perf_counter()


def _sorted_distinct(parts: list[np.ndarray]) -> np.ndarray:
    """The distinct keys of ``parts`` (each tier's keys as ``(n, 2)`` uint64 rows, the key's
    bytes in memory order), in the bytes' order. Numpy work only (it sorts and compares
    without the interpreter lock), so the loop's thread never waits on this one; a key in
    DRAM and on disk is there once."""
    rows = np.concatenate(parts) if parts else np.empty((0, KEY_BYTES // 8), dtype=np.uint64)
    ordered = np.sort(np.ascontiguousarray(rows, dtype="<u8").view(_KEY_DTYPE).ravel())
    words = ordered.view(">u8").reshape(-1, KEY_BYTES // 8)
    distinct = np.ones(len(ordered), dtype=bool)
    np.any(words[1:] != words[:-1], axis=1, out=distinct[1:])
    return ordered[distinct]


class KeyOrder:
    """A sorted snapshot of the keys stored in ``tiers`` (see the module doc): a numpy array
    of fixed-width raw keys (the width of a key, so numpy's order is the bytes' order)."""

    def __init__(self, max_age_s: float = 30.0) -> None:
        self.max_age_s = max_age_s
        self._keys = np.empty(0, dtype=_KEY_DTYPE)
        self._taken = -math.inf  # monotonic time the snapshot's keys were read
        self._added: tuple[int, ...] | None = None  # the tiers' keys_added() when it was read
        self.builds = 0  # snapshots read (each sorts every key once)

    async def build(self, tiers: Sequence) -> np.ndarray:
        """A new snapshot of every tier's keys; it replaces the shared one unless a newer
        one was taken meanwhile."""
        taken = time.monotonic()
        self.builds += 1
        added = tuple(t.keys_added() for t in tiers)  # before the keys: a key added later
        # makes the next listing build again
        slices = LoopSlices()
        parts: list[np.ndarray] = []
        for tier in tiers:  # each tier's keys in one numpy copy (the tier may change at an await)
            parts.append(tier.key_pairs())
            await slices.tick()
        snap = await asyncio.to_thread(_sorted_distinct, parts)
        if taken > self._taken:
            self._keys, self._taken, self._added = snap, taken, added
        return snap

    async def current(self, tiers: Sequence, fresh: bool) -> np.ndarray:
        """The shared snapshot; a new one when ``fresh`` (a listing's first page) or when it
        is older than ``max_age_s``, unless no tier added a key since it was read (then it
        holds every stored key: a deleted one a page skips). An operator's filtered listings
        in a loop used to sort every key once each (~16 ms of a core per 100,000)."""
        stale = fresh or time.monotonic() - self._taken > self.max_age_s
        if stale and tuple(t.keys_added() for t in tiers) != self._added:
            return await self.build(tiers)
        return self._keys


def window(keys: np.ndarray, after: bytes | None, n: int) -> tuple[np.ndarray, bool]:
    """Up to ``n`` keys of the sorted snapshot ``keys`` after ``after`` (exclusive; None: from
    the start), as a slice of it, and whether they reach the snapshot's end."""
    start = 0 if after is None else int(np.searchsorted(keys, np.bytes_(after), side="right"))
    part = keys[start : start + n]
    return part, start + len(part) >= len(keys)


def key_list(part: np.ndarray) -> list[bytes]:
    """Raw keys of a (short) slice of a snapshot, trailing zero bytes included (numpy's
    ``S16`` items would drop them)."""
    raw = part.tobytes()
    return [raw[o : o + KEY_BYTES] for o in range(0, len(raw), KEY_BYTES)]


def key_chunks(part: np.ndarray, chunk: int = KEY_CHUNK) -> Iterator[list[bytes]]:
    """``part`` (a slice of a snapshot) as lists of raw keys, ``chunk`` at a time: a caller
    that ticks between chunks never turns a whole page into Python objects in one step."""
    for off in range(0, len(part), chunk):
        yield key_list(part[off : off + chunk])
