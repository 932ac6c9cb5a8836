"""The loader's staging: host buffers a batch of blocks is read into before its copy into pages.

A :class:`StagingSlot` holds one batch: ``blocks`` contiguous block buffers back to back in one
tensor, so a batch is one allocation (touched once, registered with the store once) and its
per-block views are made once, not per load. :class:`StagingPool` owns the slots: ``take``
gives a free slot (a fresh one, counted, when every slot is in use by loads in flight), ``give``
takes it back once no copy reads it any more: the slots made up front are kept (they are the
ones registered with the store), a fresh one is freed, so the memory held between loads stays
what the configuration says, whatever the concurrency once was. Both run on the engine's event loop.
"""

from __future__ import annotations

import logging
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


class StagingPool:
    """The loader's slots; ``slots`` allocated up front (enough for the batches one load has
    in flight), more only while concurrent loads need them (``fresh`` counts those)."""

    def __init__(self, slots: int, blocks: int, block_bytes: int, shape, dtype, pin: bool) -> None:
        self._new: Callable[[], StagingSlot] = lambda: StagingSlot(blocks, block_bytes, shape, dtype, pin)
        self._free = [self._new() for _ in range(slots)]
        self._kept = {id(slot) for slot in self._free}
        self.fresh = 0

    def register(self, register: Callable[[Any], Any]) -> None:
        """Offer every slot's memory to the store (``register``: the store's, one call per slot)."""
        for slot in self._free:
            register(slot.data.numpy())

    @property
    def idle(self) -> int:
        """Slots free now (not lent to a read or a copy)."""
        return len(self._free)

    def take(self) -> StagingSlot:
        if self._free:
            return self._free.pop()
        self.fresh += 1
        log.debug("event=staging_slot_added fresh=%d", self.fresh)
        return self._new()

    def give(self, slot: StagingSlot) -> None:
        if id(slot) in self._kept:
            self._free.append(slot)
        # else: a slot added for a concurrent load; dropping the last reference frees it
