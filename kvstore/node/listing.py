"""Paging through a node's blocks by key, and the slices a long admin request runs in.

A listing pages by a stable cursor: the last key a page *looked at*, never a count of blocks.
A block that vanishes while a page is read (a delete, an eviction) only makes that page
shorter; the cursor still moves past it, and only a page that reached the end of the key
order answers "no next page". So a listing holds every block stored for its whole duration.

The key order is a sorted snapshot (:class:`KeyOrder`) rebuilt for the first page of every
listing (and when it is older than ``max_age_s``) and otherwise shared, so a page costs a
binary search instead of a pass over every key. It is only ever replaced by a newer one: the
snapshot a page reads was taken after its listing started, and holds every block stored since.

Same threading rules as the node: the tiers are read on the event loop; the sort runs on a
thread (numpy releases the interpreter lock while it sorts), and Python work over many keys
yields to the loop every :data:`SLICE_S` (:class:`LoopSlices`) so the data port keeps serving.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

import numpy as np

from kvstore.keys import KEY_BYTES

# Longest run of Python work a long admin request does on the event loop between yields.
SLICE_S = 0.001
_KEY_DTYPE = f"S{KEY_BYTES}"
_JOIN_CHUNK = 4096


class LoopSlices:
    """Cooperative time slices for a long request on the event loop: ``await tick()`` in a
    loop body yields once ``slice_s`` has run since the last yield, so no request holds the
    loop for much more than one slice and the data port is answered in between."""

    def __init__(self, slice_s: float = SLICE_S) -> None:
        self.slice_s = slice_s
        self._since = time.perf_counter()

    async def tick(self) -> None:
        if time.perf_counter() - self._since >= self.slice_s:
            await asyncio.sleep(0)
            self._since = time.perf_counter()


def _sorted_distinct(parts: list[bytes]) -> np.ndarray:
    """The distinct keys of ``parts`` (runs of whole raw keys), in the bytes' order. Numpy
    work only (it sorts and compares without the interpreter lock), so the loop's thread
    never waits on this one; a key in DRAM and on disk is there once."""
    ordered = np.sort(np.frombuffer(b"".join(parts), dtype=_KEY_DTYPE))
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

    async def build(self, tiers: Sequence) -> np.ndarray:
        """A new snapshot of every tier's keys; it replaces the shared one unless a newer
        one was taken meanwhile."""
        taken = time.monotonic()
        slices = LoopSlices()
        parts: list[bytes] = []
        for tier in tiers:
            keys = list(tier.keys())  # one C-level copy: the tier may change at the next await
            for off in range(0, len(keys), _JOIN_CHUNK):
                parts.append(b"".join(keys[off : off + _JOIN_CHUNK]))
                await slices.tick()
        snap = await asyncio.to_thread(_sorted_distinct, parts)
        if taken > self._taken:
            self._keys, self._taken = snap, taken
        return snap

    async def current(self, tiers: Sequence, fresh: bool) -> np.ndarray:
        """The shared snapshot; a new one when ``fresh`` (a listing's first page), when
        there is none yet or when it is older than ``max_age_s``."""
        if fresh or time.monotonic() - self._taken > self.max_age_s:
            return await self.build(tiers)
        return self._keys


def window(keys: np.ndarray, after: bytes | None, n: int) -> tuple[list[bytes], bool]:
    """Up to ``n`` keys of the sorted snapshot ``keys`` after ``after`` (exclusive; None: from
    the start), and whether they reach the snapshot's end."""
    start = 0 if after is None else int(np.searchsorted(keys, np.bytes_(after), side="right"))
    part = keys[start : start + n]
    raw = part.tobytes()  # whole fixed-width keys, trailing zero bytes included
    out = [raw[o : o + KEY_BYTES] for o in range(0, len(raw), KEY_BYTES)]
    return out, start + len(part) >= len(keys)
