"""Leases, reservations and holds: what keeps a block's bytes from moving under a reader or
writer.

A *hold* is a count on a key; a held key is never evicted, overwritten or freed. A *lease*
(a reader's) and a *reservation* (a writer's two-phase put) each carry a deadline, so a client
that vanishes cannot pin memory forever: :meth:`LeaseTable.expired` hands back what is overdue.

A lease or reservation whose bytes are moving (``moving``: a send from its slot or a receive
into it is under way) never expires: a transfer owns its slot until its bytes have left or
arrived. Whoever marks it moving bounds the transfer with its own deadline (the daemon closes
the connection at ``limits.transfer_timeout_s``) and unmarks it when the transfer has ended.
Expiry costs O(expired), not O(held): deadlines sit in a heap (each lease and reservation
once, at its creation); ended ones are skipped when they surface, and the heap is rebuilt from
the live ones when ended entries outnumber them. One tenant holding many leases therefore adds
nothing to another tenant's requests (docs/security.md).
Not thread-safe: one event loop owns a table.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from kvstore.block import BlockHeader
from kvstore.keys import BlockKey


@dataclass(eq=False)
class Lease:
    """A reader's claim on one block. ``view`` holds the payload (read-only; in the DRAM slot
    when ``offset`` is not None, else a private copy) until :meth:`NodeStore.release`.
    ``raw_header`` is the encoded header as the node stores it (a reply forwards these bytes
    as they are; ``header`` is the same, decoded)."""

    id: int
    key: BlockKey
    header: BlockHeader
    view: memoryview
    offset: int | None
    tier: str
    expires: float
    raw_header: bytes
    from_disk: bool = False  # its bytes were read from disk for it (a private copy or a promotion)
    owner: str | None = None  # whose share of leased disk bytes it counts in (LeaseTable.charge)


@dataclass(eq=False)
class PackedLease:
    """One reader's claim on the blocks of one batch, taken, marked in transfer and ended as
    one (one id, one deadline: :meth:`NodeState.release` ends it whole). The j-th block held
    is at position ``at[j]`` of the request; ``views[j]`` holds its payload (read-only, exactly
    its payload_len bytes), ``headers[j]`` is its encoded header as the node stores it,
    ``tiers[j]`` the tier it is read from. One hold per block held (``keys``)."""

    id: int
    expires: float
    keys: list[bytes] = field(default_factory=list)
    at: list[int] = field(default_factory=list)
    views: list[memoryview] = field(default_factory=list)
    headers: list[bytes] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    owner: None = None  # never charged: its disk reads are bounded per call instead
    read_bytes: int = 0  # bytes of its blocks read from disk for it (within that bound)


@dataclass(eq=False)
class Reservation:
    """A writer's slot for one block (two-phase put). Fill ``view`` (exactly payload_len bytes),
    then commit or abort. ``tier`` is the memory tier of the slot, or None for a private buffer
    that commit sends to disk. ``offset`` is the payload's place in the DRAM buffer when the
    view is that slot itself (RDMA WRITE can target it), else None."""

    id: int
    header: BlockHeader
    header_bytes: bytes
    view: memoryview
    offset: int | None
    tier: str | None
    expires: float
    scratch: bytearray | None = field(default=None, repr=False)
    slots: tuple[int, int] | None = None  # (payload, header) slot offsets in the tier


class LeaseTable:
    def __init__(self, default_ttl_s: float) -> None:
        self.default_ttl_s = default_ttl_s
        self._ids = itertools.count(1)
        self.holds: Counter[bytes] = Counter()
        self.leases: dict[int, Lease | PackedLease] = {}
        self.reservations: dict[int, Reservation] = {}
        self.reserved_keys: dict[bytes, int] = {}
        self.moving: Counter[int] = Counter()  # lease/reservation ids with a transfer under way
        self._due: list[tuple[float, int]] = []  # (expires, id) heap; ended ids are skipped
        self._overdue_moving: set[int] = set()  # came due while in transfer: due again at its end
        self.disk_bytes: Counter[str] = Counter()  # per owner: bytes of live from_disk leases
        # per key: the holds of copies under way (a demotion, a write-through), not a lease's:
        # each hold is a live lease's or one of these (NodeState.check)
        self.copying: Counter[bytes] = Counter()

    def next_id(self) -> int:
        return next(self._ids)

    def deadline(self, ttl_s: float | None) -> float:
        return time.monotonic() + (self.default_ttl_s if ttl_s is None else ttl_s)

    def hold(self, key: bytes) -> None:
        """Hold ``key`` for a copy under way (its slot stays put); a lease's hold is taken as
        the lease is recorded. Dropped by ``unhold(key, copy=True)``."""
        self.holds[key] += 1
        self.copying[key] += 1

    def unhold(self, key: bytes, copy: bool = False) -> bool:
        """Drop one hold (a copy's: :meth:`hold`); True when the key is no longer held."""
        if copy:
            c = self.copying[key] - 1
            if c <= 0:
                del self.copying[key]
            else:
                self.copying[key] = c
        n = self.holds[key] - 1
        if n <= 0:
            del self.holds[key]
            return True
        self.holds[key] = n
        return False

    def held(self, key: bytes) -> bool:
        return key in self.holds

    def add_lease(self, lease: Lease) -> None:
        self.leases[lease.id] = lease
        self.holds[lease.key.raw] += 1
        self._due_at(lease)

    def add_packed(self, lease: PackedLease) -> None:
        """Record a packed lease (its holds are taken as its blocks join it: :meth:`hold`)."""
        self.leases[lease.id] = lease
        self._due_at(lease)

    def pop_lease(self, lease_id: int) -> Lease | PackedLease | None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None and lease.owner is not None:
            n = self.disk_bytes[lease.owner] - lease.view.nbytes
            if n > 0:
                self.disk_bytes[lease.owner] = n
            else:
                del self.disk_bytes[lease.owner]
        return lease

    def charge(self, lease: Lease, owner: str) -> None:
        """Count a live ``from_disk`` lease's bytes in ``owner``'s share until it ends (O(1);
        the daemon bounds each tenant's share, limits.max_leased_disk_bytes_per_tenant)."""
        if lease.from_disk and lease.owner is None and self.live(lease):
            lease.owner = owner
            self.disk_bytes[owner] += lease.view.nbytes

    def add_reservation(self, r: Reservation) -> None:
        self.reservations[r.id] = r
        self.reserved_keys[r.header.key.raw] = r.id
        self._due_at(r)

    def _due_at(self, obj: Lease | PackedLease | Reservation) -> None:
        heapq.heappush(self._due, (obj.expires, obj.id))
        live = len(self.leases) + len(self.reservations)
        if len(self._due) > 2 * live + 1024:  # mostly ended entries: keep the heap O(live)
            self._due = [(x.expires, x.id) for t in (self.leases, self.reservations) for x in t.values()]
            heapq.heapify(self._due)

    def pop_reservation(self, r: Reservation) -> bool:
        """Forget ``r``; False when it was already committed, aborted or expired."""
        if self.reservations.pop(r.id, None) is None:
            return False
        self.reserved_keys.pop(r.header.key.raw, None)
        return True

    def live(self, obj: Lease | PackedLease | Reservation) -> bool:
        """Whether ``obj`` is still the table's: not released, aborted, committed or expired.
        A slot is only ever read or written under a live lease or reservation (the generation
        check of every transfer: a stale one never touches a slot that may be reused)."""
        table = self.reservations if isinstance(obj, Reservation) else self.leases
        return table.get(obj.id) is obj

    def start_moving(self, obj: Lease | PackedLease | Reservation) -> bool:
        """Mark ``obj`` in transfer when it is live; False (nothing marked) when it is not."""
        if not self.live(obj):
            return False
        self.moving[obj.id] += 1
        return True

    def stop_moving(self, obj: Lease | PackedLease | Reservation) -> None:
        n = self.moving[obj.id] - 1
        if n <= 0:
            del self.moving[obj.id]
            if obj.id in self._overdue_moving:  # came due meanwhile: due at the next sweep
                self._overdue_moving.discard(obj.id)
                heapq.heappush(self._due, (obj.expires, obj.id))
        else:
            self.moving[obj.id] = n

    def expired(self, now: float | None = None) -> tuple[list[Lease | PackedLease], list[Reservation]]:
        """What is overdue and not in transfer, in O(what came due) (see the module docstring)."""
        now = time.monotonic() if now is None else now
        leases: list[Lease | PackedLease] = []
        res: list[Reservation] = []
        due = self._due
        while due and due[0][0] <= now:
            _, i = heapq.heappop(due)
            obj = self.leases.get(i) or self.reservations.get(i)
            if obj is None:
                continue  # ended before its deadline
            if i in self.moving:
                self._overdue_moving.add(i)
                continue
            (res if isinstance(obj, Reservation) else leases).append(obj)
        return leases, res
