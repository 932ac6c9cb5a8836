"""The loader's staging: host buffers a batch of blocks is read into before its copy into pages.

A :class:`StagingSlot` holds one batch: ``blocks`` contiguous block buffers back to back in one
tensor, so a batch is one allocation (touched once, registered with the store once) and its
per-block views are made once, not per load. :class:`StagingPool` owns the slots: ``take``
gives a free slot (a fresh one, counted, when every slot is in use by loads in flight, up to
a bound on slots lent at once: past it a load waits, within its deadline, for one to come
back), ``give`` takes it back once no copy reads it any more: the slots made up front are kept
(they are the ones registered with the store), a fresh one is freed, so the memory held
between loads stays what the configuration says, whatever the concurrency once was, and the
memory held during loads is bounded by ``load_staging_bytes``. Both run on the engine's event
loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("tierkv.connector")


class StagingSlot:
    """``blocks`` buffers of ``block_bytes`` in one tensor (``data``, uint8, pinned when asked,
    zero-filled so no read pays its page faults). ``rows[i]``: block ``i``'s bytes (a numpy
    view, what the store fills); ``block(i)``: the same bytes as a ``shape`` tensor of
    ``dtype`` (what the copy into pages reads); ``first(n)``: the first ``n`` at once."""

    def __init__(self, blocks: int, block_bytes: int, shape: tuple[int, ...], dtype, pin: bool) -> None:
        self.data = torch.zeros((blocks, block_bytes), dtype=torch.uint8, pin_memory=pin)
        self.rows = list(self.data.numpy())
        self._typed = self.data.view(dtype).view(blocks, *shape)

    def block(self, i: int) -> torch.Tensor:
        return self._typed[i]

    def first(self, n: int) -> torch.Tensor:
        """Blocks ``0 .. n - 1`` as one ``[n, *shape]`` tensor (one copy moves them all)."""
        return self._typed[:n]


class StagingFull(TimeoutError):
    """No staging slot came free within the wait: every slot the bound allows is lent."""


class StagingPool:
    """The loader's slots; ``slots`` allocated up front (enough for the batches one load has
    in flight), more only while concurrent loads need them (``fresh`` counts those), never
    more than ``most`` at once (at least ``slots``): past that a load waits for one to be
    given back. Every slot is given back once its read and copy ended, so a wait ends."""

    def __init__(self, slots: int, most: int, blocks: int, block_bytes: int, shape, dtype, pin: bool) -> None:
        self._new: Callable[[], StagingSlot] = lambda: StagingSlot(blocks, block_bytes, shape, dtype, pin)
        self._free = [self._new() for _ in range(slots)]
        self._kept = {id(slot) for slot in self._free}
        self.most = max(most, slots)
        self._lent = 0
        self._waiting: deque[asyncio.Future] = deque()
        self.fresh = 0

    def register(self, register: Callable[[Any], Any]) -> None:
        """Offer every slot's memory to the store (``register``: the store's, one call per slot)."""
        for slot in self._free:
            register(slot.data.numpy())

    @property
    def idle(self) -> int:
        """Slots free now (not lent to a read or a copy)."""
        return len(self._free)

    @property
    def lent(self) -> int:
        """Slots lent now (to reads and copies)."""
        return self._lent

    async def take(self, timeout: float) -> StagingSlot:
        """A free slot; a fresh one when none is free and fewer than ``most`` are lent; else
        the first one given back within ``timeout`` seconds (StagingFull otherwise)."""
        if not self._waiting:  # those already waiting go first
            if self._free:
                self._lent += 1
                return self._free.pop()
            if self._lent < self.most:
                self._lent += 1
                self.fresh += 1
                log.debug("event=staging_slot_added fresh=%d", self.fresh)
                return self._new()
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiting.append(waiter)
        full = StagingFull(f"no staging slot free within {timeout} s ({self.most} lent)")
        timer = loop.call_later(timeout, lambda: waiter.done() or waiter.set_exception(full))
        try:
            return await waiter  # not wait_for: it may swallow a cancel that meets the result
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.give(waiter.result())  # handed a slot just as the wait was cancelled
            raise
        finally:
            timer.cancel()

    def give(self, slot: StagingSlot) -> None:
        """Take ``slot`` back: to the first load still waiting (it stays lent), else into the
        free list (an up-front one) or freed (one added for a concurrent load)."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self._lent -= 1
        if id(slot) in self._kept:
            self._free.append(slot)
        # else: a slot added for a concurrent load; dropping the last reference frees it
