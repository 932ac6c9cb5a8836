"""A node's writes: the two-phase put (reserve a slot, fill it, commit: verify, index, write
through to disk; or abort) and the write-back flush. Where a block lands is the node's
placement (``place``, see kvstore.node.store). Same threading rules as the node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.block import BlockHeader, checksum
from kvstore.node.depth_order import commit_order
from kvstore.node.leases import Reservation
from kvstore.node.placement import ROOM_NEEDED, Placement
from kvstore.node.state import NodeState
from kvstore.node.tiers.stack import TierStack
from kvstore.node.tiers.tasks import Finishing, to_the_end
from kvstore.results import PutResult, Status

_INVALID = PutResult(Status.INVALID)  # results are frozen: one instance serves every block


class Writer:
    """Writes into the memory tiers of ``tiers`` (a reservation names its tier) or, for
    private buffers, into the disk, where ``placement`` puts each block; holds, reservations,
    doomed keys (a write to one is BUSY) and tombstones (a key stored again is alive) are
    ``state``'s. With ``write_back`` a memory block is acknowledged at once and marked dirty
    (it reaches disk when evicted or at :meth:`flush`); otherwise it is written through to
    disk before the result. ``finishing``: the node's tracker of work left finishing by
    cancelled callers (its own when not given). An uncommitted reservation is given back by
    :meth:`NodeState.abort`."""

    def __init__(
        self,
        tiers: TierStack,
        state: NodeState,
        placement: Placement,
        write_back: bool,
        finishing: Finishing | None = None,
    ) -> None:
        self._stack = tiers
        self._tiers = tiers.memory
        self._memory = tiers.by_name
        self._disk = tiers.disk
        self._state = state
        self._leases = state.leases
        self._place = placement.place
        self._place_now = placement.place_now
        self._where = state.where
        self._doomed = state.doomed
        self._dirty = state.dirty
        self._write_back = write_back
        self._unhold = state.unhold
        self._counters = state.counters
        self._finishing = finishing if finishing is not None else Finishing()

    async def put(self, blocks: Sequence[tuple[BlockHeader, object]]) -> list[PutResult]:
        """Store (header, payload) pairs: reserve, copy, commit. INVALID when the payload does
        not match its header, EXISTS when the key is stored (the block counts as used, as a
        read), BUSY when it is being written."""
        results: list[PutResult | None] = [None] * len(blocks)
        headers, payloads, idx = [], [], []
        for i, (h, p) in enumerate(blocks):
            mv = memoryview(p).cast("B")
            if mv.nbytes != h.payload_len:  # the checksum is verified once, at commit
                self._counters["put_invalid"] += 1
                results[i] = PutResult(Status.INVALID)
                continue
            headers.append(h)
            payloads.append(mv)
            idx.append(i)
        reserved = await self.reserve(headers)
        to_commit = []
        for i, mv, r in zip(idx, payloads, reserved):
            if isinstance(r, Status):
                results[i] = PutResult(r)
            else:
                r.view[:] = mv
                to_commit.append((i, r))
        committed = await self.commit([r for _, r in to_commit])
        for (i, _), res in zip(to_commit, committed):
            results[i] = res
        return results  # type: ignore[return-value]

    async def reserve(
        self,
        headers: Sequence[BlockHeader],
        lazy: bool = False,
        make_room: bool = True,
        sees: Callable[[bytes | None], bool] | None = None,
    ) -> list[Reservation | Status]:
        """Phase one of a write: a slot per header (EXISTS / BUSY / NO_SPACE otherwise; an
        EXISTS touches the block in the highest tier holding it, as a read does). The
        slot is invisible to readers until :meth:`commit`; it expires after the lease TTL.
        A reservation without a host slot (disk, GPU) gets a private buffer; with ``lazy`` that
        buffer is not allocated here: its ``view`` is empty and the caller hands the payload
        over with :meth:`attach_payload` (no memory is committed before the bytes come).
        Without ``make_room`` nothing is evicted (a RESERVE whose bytes may never come: room
        is made when they arrive, by the PUT that carries them). With ``sees``, a key stored
        in a namespace it refuses is BUSY (another tenant's block: the answer for a key being
        written, never EXISTS). Expired reservations are swept first."""
        self._state.sweep()
        # One pass, checks and slots together (a key twice in a batch: the second is BUSY).
        # Room is made only for a block that finds none free in its tier (place_now says
        # so), one await per such block, each evicting what that block needs: the blocks
        # reserved so far are not yet indexed, so a PUT's own blocks never evict each other.
        where, doomed, reserved = self._where, self._doomed, self._leases.reserved_keys
        add, place_now, touch = self._leases.add_reservation, self._place_now, self._stack.touch
        expires = self._leases.deadline(None)
        out: list[Reservation | Status] = []
        exists = no_space = 0
        try:
            for h in headers:
                key = h.key.raw
                if (t := where(key)) is not None:
                    if sees is not None and not sees(t.namespace(key)):
                        out.append(Status.BUSY)
                        continue
                    # A stored block written again is wanted again: counted as a use, as
                    # a read is (on three nodes the blocks below a cut chain come back so;
                    # docs/eviction-policy.md, "a PUT of a stored block refreshes it").
                    touch(t, key)
                    exists += 1
                    out.append(Status.EXISTS)
                    continue
                if key in reserved or key in doomed:
                    out.append(Status.BUSY)
                    continue
                r = place_now(h, h.encode(), lazy, make_room, expires)
                if r is ROOM_NEEDED:
                    r = await self._place(h, lazy, make_room)
                    expires = self._leases.deadline(None)  # the wait may have been long
                    if r is not None and (st := self._taken(key, r, sees)) is not None:
                        out.append(st)  # (not counted as put_exists: the key was free when asked)
                        continue
                if r is None:
                    no_space += 1
                    out.append(Status.NO_SPACE)
                else:
                    add(r)
                    out.append(r)
        finally:  # counted also when a wait for room is cancelled
            if exists:
                self._counters["put_exists"] += exists
            if no_space:
                self._counters["put_no_space"] += no_space
        return out

    def _taken(self, key: bytes, r: Reservation, sees) -> Status | None:
        """After room was made for ``r`` (an await): BUSY or EXISTS when ``key`` was taken
        meanwhile (``r``'s slot then goes back), None when it is still free."""
        if key in self._doomed:
            # written, leased and deleted by others while we made room: still held (and
            # indexed) until its last release, so BUSY as before the wait
            self._state.free(r)
            return Status.BUSY
        if (t := self._where(key)) is not None or key in self._leases.reserved_keys:
            self._state.free(r)  # another writer won the race while we made room
            foreign = t is not None and sees is not None and not sees(t.namespace(key))
            return Status.BUSY if foreign else Status.EXISTS
        return None

    async def commit(
        self, reservations: Sequence[Reservation], digests: Sequence[int | None] | None = None
    ) -> list[PutResult]:
        """Verify each reservation's payload against its header checksum, index it, and
        (write-through) store it on disk in one transaction. INVALID for a reservation that
        is no longer live or whose bytes do not match; durable when synced to disk. A key
        stored again is alive: its tombstone ends. ``digests`` (by position, optional): the
        checksum of each payload's bytes computed as they landed in its reservation's view
        (:func:`kvstore.block.payload_hasher`), by a caller that owns those bytes since; a
        None entry (or no ``digests``) is computed here."""
        n = len(reservations)
        results: list[PutResult] = [_INVALID] * n  # expired or already done, unless set below
        to_disk: list[tuple[int, Reservation]] = []
        # deepest first (kvstore/node/depth_order.py): the same tie-break on every node
        order = commit_order(
            [r.header.key.raw for r in reservations], [r.header.parent.raw for r in reservations]
        )
        # One pass: verify each (a C call per payload) and collect what each memory tier
        # indexes, in that order; then one commit per tier, counters and tombstones once.
        pop, memory, free = self._leases.pop_reservation, self._memory, self._state.free
        ack_now = self._disk is None or self._write_back  # no disk write before the result
        per_tier: dict[str, list] = {}
        stored: dict[str | None, PutResult] = {}
        invalid = puts = nbytes = 0
        # Taken out of the reservations for a memory tier but not yet indexed: if anything
        # raises before their tier's commit (a GPU copy, a key indexed meanwhile), their slots
        # are given back here, or they would be neither reserved (expiring) nor indexed.
        pending: list[Reservation] = []
        committed: set[str] = set()
        try:
            for i in order:
                r = reservations[i]
                if not pop(r):
                    continue
                h = r.header
                digest = digests[i] if digests is not None else None
                if (checksum(r.view) if digest is None else digest) != h.checksum:
                    free(r)
                    invalid += 1
                    continue
                if r.tier is None:
                    to_disk.append((i, r))
                    continue
                pending.append(r)
                if r.scratch is not None:  # staged in host memory: the slot is not (a GPU's)
                    memory[r.tier].fill(r.slots, r.view)
                todo = per_tier.get(r.tier)
                if todo is None:
                    todo = per_tier[r.tier] = []
                todo.append(
                    (h.key.raw, r.slots, len(r.header_bytes), h.payload_len, h.namespace.raw, h.parent.raw)
                )
                puts += 1
                nbytes += h.payload_len
                if ack_now:
                    res = stored.get(r.tier)
                    if res is None:
                        res = stored[r.tier] = PutResult(Status.STORED, r.tier, False)
                    results[i] = res
                else:
                    to_disk.append((i, r))
            for name, todo in per_tier.items():
                memory[name].commit_many(todo)  # all or none
                committed.add(name)
                if self._disk is not None and self._write_back:
                    self._dirty.update(x[0] for x in todo)
        except BaseException:
            for r in pending:
                if r.tier not in committed:
                    free(r)
            raise
        counters = self._counters
        if invalid:
            counters["put_invalid"] += invalid
        if puts:
            counters["puts"] += puts
            counters["bytes_in"] += nbytes
        if to_disk:
            await self._write_through(to_disk, results)
        dead = self._state.tombstones
        if len(dead):
            dead.discard(
                [r.header.key.raw for r, x in zip(reservations, results) if x.status is Status.STORED]
            )
        return results

    async def _write_through(self, to_disk: list[tuple[int, Reservation]], results: list[PutResult]) -> None:
        disk = self._disk
        keys = [r.header.key.raw for _, r in to_disk]
        items = [(k, r.header_bytes, r.view) for k, (_, r) in zip(keys, to_disk)]
        for k in keys:  # now, not when the task starts: the slots stay put from here on
            self._leases.hold(k)
        # to its end even when the commit is cancelled: the disk thread reads the slots until
        # then, and the holds that keep them in place go only after it
        stored = await to_the_end(self._put_held(keys, items), self._finishing)
        durable = disk.durable  # type: ignore[union-attr]
        for (i, r), ok in zip(to_disk, stored):
            if r.tier is not None:
                results[i] = PutResult(Status.STORED, r.tier, ok and durable)
                continue
            if ok:
                self._counters["puts"] += 1
                self._counters["bytes_in"] += r.header.payload_len
            else:
                self._counters["put_no_space"] += 1
            results[i] = PutResult(Status.STORED if ok else Status.NO_SPACE, "disk", ok and durable)

    async def _put_held(self, keys: list[bytes], items: list) -> list[bool]:
        """Write ``items`` to disk; their ``keys`` are held (the slot must not be freed while
        the writer thread reads it) and are unheld here when the write is over."""
        disk = self._disk
        try:
            stored = await disk.put(items)  # type: ignore[union-attr]
            # deleted while written (held, so only hidden): delete found no disk copy to drop
            # then, and the one just written must not outlive it
            gone = [k for k in keys if k in self._doomed and k in disk]  # type: ignore[operator]
            if gone:
                await disk.delete(gone)  # type: ignore[union-attr]
            return stored
        finally:
            for k in keys:
                self._unhold(k)

    def attach_payload(self, r: Reservation, payload: bytearray) -> None:
        """Give a lazy reservation (see :meth:`reserve`) its received payload buffer.
        ValueError when ``r`` is not a lazy one."""
        if r.scratch is None or r.view.nbytes:
            raise ValueError(f"reservation {r.id} is not a lazy one")
        r.scratch, r.view = payload, memoryview(payload)

    async def flush(self) -> int:
        """Write every dirty (write-back) memory block to disk, but those deleted while held;
        the number of dirty blocks left unwritten."""
        if self._disk is None:
            return 0
        for tier in self._tiers:
            # a block deleted while leased stays in memory (and dirty) until its last release:
            # deleted all the same, it is not written
            todo = [k for k in self._dirty if k in tier and k not in self._doomed]
            items = [(k, tier.header_sync(k), tier.payload_host(k)) for k in todo]
            if items:
                ok = await self._disk.put(items)
                for (k, _, _), stored in zip(items, ok):
                    if stored:
                        self._dirty.discard(k)
        return len(self._dirty)
