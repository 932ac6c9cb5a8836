"""The node's state beside its tiers, with one owner: the leases and reservations (and the
holds behind them, kvstore.node.leases), the pinned keys, the dirty keys (write-back: in
memory only, not yet on disk), the doomed keys (deleted while held: invisible to every reader,
freed at their last hold), the tombstones (what this node deleted lately) and the node's
counters.

Every part of the node (kvstore.node.leasing, reads, writes, eviction, placement, inspection)
is handed this one object; holds end only through :meth:`NodeState.unhold`, leases through
:meth:`release`, reservations through :meth:`abort` (or a writer's commit), keys leave the
memory tiers on delete only through :meth:`forget`. :meth:`check` asserts the invariants that
tie these together; it costs O(state), not O(stored blocks), so tests call it after every
scenario. Same threading rules as the node: one event loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvstore.keys import BlockKey
from kvstore.node.leases import Lease, LeaseTable, PackedLease, Reservation
from kvstore.node.tiers.base import Tier
from kvstore.node.tiers.stack import TierStack
from kvstore.node.tombstones import Tombstones


class NodeState:
    """The state of a node over ``tiers``; leases last ``lease_ttl_s`` unless asked otherwise."""

    def __init__(self, tiers: TierStack, lease_ttl_s: float, tombstones: Tombstones) -> None:
        self.tiers = tiers
        self.leases = LeaseTable(lease_ttl_s)
        self.pinned: set[bytes] = set()
        self.dirty: set[bytes] = set()  # write-back: in memory only
        self.doomed: set[bytes] = set()  # deleted while held: freed at the last release
        self.tombstones = tombstones
        self.counters: Counter[str] = Counter()

    # ------------------------------------------------------------------ where a key is
    def where(self, key: bytes) -> Tier | None:
        """The highest tier holding ``key``, None when absent or deleted (doomed)."""
        if key in self.doomed:
            return None
        for t in self.tiers.all:  # a plain loop: this runs per key of every lease
            if key in t:
                return t
        return None

    def protected(self, key: bytes) -> bool:
        """Whether ``key`` may not be evicted from any tier: held (leased, in a copy) or pinned."""
        return key in self.leases.holds or key in self.pinned

    def forget(self, key: bytes) -> None:
        """Drop a deleted ``key`` from the memory tiers now, or (held) hide it until its last
        hold ends (:meth:`unhold` frees it then)."""
        if self.leases.held(key):
            self.doomed.add(key)
            return
        for t in self.tiers.memory:
            t.remove(key)
        self.dirty.discard(key)

    def unhold(self, key: bytes, copy: bool = True) -> None:
        """Drop one hold on ``key``, a copy's (``LeaseTable.hold``) unless ``copy`` is False
        (:meth:`release`: a lease's); at its last, a key deleted while held (doomed) is freed."""
        if self.leases.unhold(key, copy) and key in self.doomed:
            self.doomed.discard(key)
            for t in self.tiers.memory:
                t.remove(key)
            self.dirty.discard(key)

    # ------------------------------------------------------------------ leases and reservations
    def release(self, leases: Sequence[Lease | PackedLease]) -> None:
        """End leases, packed ones whole (idempotent). A block deleted while leased is freed at
        its last release."""
        pop, unhold = self.leases.pop_lease, self.unhold
        for lease in leases:
            if pop(lease.id) is None:
                continue
            if isinstance(lease, PackedLease):
                for k in lease.keys:
                    unhold(k, False)
            else:
                unhold(lease.key.raw, False)

    def abort(self, reservations: Sequence[Reservation]) -> None:
        """Give back uncommitted reservations (idempotent)."""
        for r in reservations:
            if self.leases.pop_reservation(r):
                self.free(r)

    def free(self, r: Reservation) -> None:
        """Give back a reservation's slot (nothing for a private buffer)."""
        if r.tier is not None:
            self.tiers.by_name[r.tier].abandon(r.slots)

    def sweep(self) -> None:
        """End what has expired (leases and reservations past their deadline, not in transfer).
        Each entry point that takes new holds calls it first."""
        leases, reservations = self.leases.expired()
        if leases:
            self.counters["leases_expired"] += len(leases)
            self.release(leases)
        if reservations:
            self.counters["reservations_expired"] += len(reservations)
            self.abort(reservations)

    def is_live(self, held: Lease | PackedLease | Reservation) -> bool:
        """Whether a lease or reservation is still in force (not released, expired, done)."""
        return self.leases.live(held)

    def begin_transfer(self, held: Sequence[Lease | PackedLease | Reservation]) -> list[bool]:
        """Mark leases/reservations whose bytes are about to move (a send from the slot, a
        receive into it): until :meth:`end_transfer` they cannot expire, so their slots are
        not freed or reused under the transfer. Per item: False when it is no longer live
        (released, expired, committed): its view must not be touched. The caller bounds the
        transfer with a deadline and calls :meth:`end_transfer` for exactly the items marked."""
        start = self.leases.start_moving
        return [start(x) for x in held]

    def end_transfer(self, held: Sequence[Lease | PackedLease | Reservation]) -> None:
        stop = self.leases.stop_moving
        for x in held:
            stop(x)

    def leased_disk_bytes(self, owner: str) -> int:
        """Bytes of live leases read from disk for ``owner`` (Leaser.lease's ``owner``); O(1)."""
        self.sweep()
        return self.leases.disk_bytes.get(owner, 0)

    # ------------------------------------------------------------------ pins
    def pin(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Exempt stored blocks from eviction until :meth:`unpin`. False where absent."""
        out = []
        for key in keys:
            ok = self.where(key.raw) is not None
            if ok:
                self.pinned.add(key.raw)
            out.append(ok)
        return out

    def unpin(self, keys: Sequence[BlockKey]) -> list[bool]:
        out = []
        for key in keys:
            out.append(key.raw in self.pinned)
            self.pinned.discard(key.raw)
        return out

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Assert the invariants of the state (O(state), see the module docstring): holds are
        positive and each key's are exactly those of its live leases and of its copies under
        way (a hold no lease accounts for would never be dropped: the block never evictable,
        deleted it stays doomed); reserved keys and reservations match one to one;
        a doomed key is still held (else its last release would have freed it); a pinned key
        is stored; a dirty key is in memory; a transfer marks only live items; each owner's
        share of leased disk bytes is the sum of its live leases."""
        lt = self.leases
        assert all(n > 0 for n in lt.holds.values()), "a hold count is not positive"
        per_key: Counter[bytes] = Counter()
        for x in lt.leases.values():
            per_key.update(x.keys if isinstance(x, PackedLease) else (x.key.raw,))
        assert all(n > 0 for n in lt.copying.values()), "a copy's hold count is not positive"
        for k in per_key.keys() | lt.holds.keys() | lt.copying.keys():
            n, c, h = per_key[k], lt.copying[k], lt.holds.get(k, 0)
            assert h == n + c, f"key {k.hex()} has {h} holds for {n} live leases and {c} copies"
        assert len(lt.reserved_keys) == len(lt.reservations), "reserved keys and reservations differ"
        for r in lt.reservations.values():
            assert lt.reserved_keys.get(r.header.key.raw) == r.id, f"reservation {r.id} not indexed"
        for k in self.doomed:
            assert k in lt.holds, f"doomed key {k.hex()} is no longer held: never freed"
        for k in self.pinned:
            assert self.where(k) is not None, f"pinned key {k.hex()} not stored"
        for k in self.dirty:
            assert self.tiers.in_memory(k), f"dirty key {k.hex()} is in no memory tier"
        for i in lt.moving:
            assert i in lt.leases or i in lt.reservations, f"transfer {i} marks an ended item"
        owed: Counter[str] = Counter()
        for x in lt.leases.values():
            if x.owner is not None:
                owed[x.owner] += x.view.nbytes
        assert owed == lt.disk_bytes, f"leased disk bytes {dict(lt.disk_bytes)} != {dict(owed)}"
