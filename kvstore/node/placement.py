"""The node's placement: where a new block lands and when a disk hit moves up.

A write lands in the highest memory tier it fits once room is made (moving blocks down,
kvstore.node.eviction), else in a private buffer bound for disk. A verified disk block read
for a reader moves into the top memory tier when that costs no I/O (only blocks the tier
below also holds are dropped for it) and ``node.promote_on_read`` allows it; never a key that
is deleted, being written, or already there. Same threading rules as the node.
"""

from __future__ import annotations

from kvstore.block import BlockHeader
from kvstore.node.eviction import Evictor
from kvstore.node.leases import Reservation
from kvstore.node.state import NodeState
from kvstore.node.tiers.base import Slot
from kvstore.node.tiers.index import header_namespace
from kvstore.node.tiers.stack import TierStack

# place_now's answer when room must be made first (an await: Placement.place decides)
ROOM_NEEDED = object()


class Placement:
    """Placement over ``tiers``, recording in ``state``, making room with ``evictor``;
    ``promote_on_read``: whether disk hits move up at all."""

    def __init__(self, tiers: TierStack, state: NodeState, evictor: Evictor, promote_on_read: bool) -> None:
        self._tiers = tiers
        self._state = state
        self._evictor = evictor
        self.promote_on_read = promote_on_read

    async def place(self, h: BlockHeader, lazy: bool = False, make_room: bool = True) -> Reservation | None:
        """Where a new block lands: the highest memory tier it fits once room is made (moving
        blocks down; without ``make_room``, only one with room free now), else a private
        buffer bound for disk; None when no tier can take it. The reservation is not yet
        recorded (the writer does that once the key is still free)."""
        leases = self._state.leases
        hb = h.encode()
        r = self.place_now(h, hb, lazy, make_room, leases.deadline(None))
        if r is not ROOM_NEEDED:
            return r  # type: ignore[return-value]
        size = 0 if lazy else h.payload_len  # private buffers only
        rid, expires = leases.next_id(), leases.deadline(None)
        for tier in self._tiers.memory:
            if not tier.fits(h.payload_len, len(hb)):
                continue
            if await self._evictor.make_room(tier, h.payload_len, len(hb), h.namespace.raw):
                slots = tier.reserve(hb, h.payload_len)
                if slots is not None:
                    return _in(tier, slots, rid, h, hb, size, expires)
        return self._private(h, hb, size, rid, expires)

    def place_now(
        self, h: BlockHeader, hb: bytes, lazy: bool, make_room: bool, expires: float
    ) -> Reservation | None | object:
        """:meth:`place` without waiting (``hb``: ``h`` encoded; ``expires``: the deadline of
        the reservation), or ``ROOM_NEEDED`` when the tier :meth:`place` would put it in has
        no room free now and ``make_room`` asks for it to be made (then only :meth:`place`
        decides, making room). The same answer as :meth:`place` whenever it gives one: the
        highest tier it fits takes it when it has room, as after a ``make_room`` that found
        room without evicting. A batch's blocks are placed this way in one pass, each an
        await only when room must be made for it."""
        size = 0 if lazy else h.payload_len
        plen, hlen = h.payload_len, len(hb)
        for tier in self._tiers.memory:
            if not tier.fits(plen, hlen):
                continue
            slots = tier.reserve(hb, plen)  # None exactly when can_alloc is False
            if slots is not None:
                return _in(tier, slots, self._state.leases.next_id(), h, hb, size, expires)
            if make_room:
                return ROOM_NEEDED
        return self._private(h, hb, size, self._state.leases.next_id(), expires)

    def _private(self, h: BlockHeader, hb: bytes, size: int, rid: int, expires: float) -> Reservation | None:
        """A private buffer bound for disk, or None when the disk cannot take it either."""
        disk = self._tiers.disk
        if disk is not None and disk.fits(h.payload_len, len(hb)):
            buf = bytearray(size)
            return Reservation(rid, h, hb, memoryview(buf), None, None, expires, scratch=buf)
        return None

    def promotion_slot(self, key: bytes, hdr: bytes, plen: int) -> Slot | None:
        """A reserved slot of the top memory tier for a disk block moving up, or None when it
        is there already, deleted, being written (its writer's commit needs the key free), or
        would take evicting anything not also below."""
        top, st = self._tiers.top, self._state
        if top is None or key in top or key in st.doomed or key in st.leases.reserved_keys:
            return None
        ns = header_namespace(hdr)
        if not top.fits(plen, len(hdr)) or not self._evictor.room_without_io(top, plen, len(hdr), ns):
            return None
        return top.reserve(hdr, plen)

    def promote(self, header: BlockHeader, payload) -> None:
        """Copy a verified disk block, read into ``payload``, into the top memory tier when that
        costs no I/O (and ``promote_on_read``); see :meth:`promotion_slot`."""
        if not self.promote_on_read:
            return
        slot = self.promotion_slot(header.key.raw, header.encode(), header.payload_len)
        if slot is not None:
            top = self._tiers.top
            top.fill(slot, memoryview(payload).cast("B")[: header.payload_len])  # type: ignore[union-attr]
            top.commit(header.key.raw, slot, len(slot[1]), header.payload_len)  # type: ignore[union-attr]
            self._state.counters["promotions"] += 1


def _in(tier, slots: Slot, rid: int, h: BlockHeader, hb: bytes, size: int, expires: float) -> Reservation:
    """The reservation of ``slots``, just reserved in memory tier ``tier``."""
    view = tier.slot_view(slots, h.payload_len)
    if view is not None:  # written in place (recv_into, RDMA WRITE)
        return Reservation(rid, h, hb, view, slots[0], tier.name, expires, slots=slots)
    # a GPU slot: the bytes land in host memory and are copied up at commit
    buf = bytearray(size)
    return Reservation(rid, h, hb, memoryview(buf), None, tier.name, expires, scratch=buf, slots=slots)
