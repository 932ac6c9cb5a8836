"""One storage node: the tier stack (hbm -> dram -> disk) and the parts that work on it.

A write lands in the highest memory tier (and, write-through, on disk before it is
acknowledged durable). Eviction in each tier's order moves blocks down (hbm -> dram -> disk
-> dropped; kvstore.node.eviction); a write-back block reaches disk when it leaves memory or
at close. A disk hit can be promoted into the top memory tier when that costs no I/O
(kvstore.node.placement). Held blocks (leases, in-flight copies) and pinned blocks are never
evicted, overwritten or freed; capacity in bytes is never exceeded.

The node composes its parts and callers reach them directly (no method here forwards to
one): ``state`` (:class:`~kvstore.node.state.NodeState`: leases, reservations, pins, dirty
and doomed keys, tombstones, counters; it ends leases and reservations), ``placement``,
``leaser`` (lease), ``reader`` (the copying read: lease -> copy -> release), ``writer``
(reserve -> fill -> commit, put, flush), ``evictor`` and ``inspector`` (list, describe,
verify, stats). Each part takes (tiers, state, placement) or the subset it uses. What stays
here is what spans the tiers: presence (:meth:`lookup`),
:meth:`delete`, :meth:`check`, :meth:`open` and :meth:`close`.

Every batched call returns one result per key in input order; failures of one key (corruption,
no space, I/O error) are per-key statuses and counters, never exceptions. All methods must be
called from the event loop that opened the node; none blocks it on disk I/O.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.config import StoreConfig
from kvstore.keys import BlockKey, KeyBatch
from kvstore.keytable import key_pairs
from kvstore.lookups import TIER_CODES
from kvstore.node.eviction import Evictor
from kvstore.node.inspection import Inspector
from kvstore.node.leasing import Leaser
from kvstore.node.placement import Placement
from kvstore.node.reads import Reader
from kvstore.node.state import NodeState
from kvstore.node.tiers.base import BottomTier, SlotTier
from kvstore.node.tiers.build import build_tiers
from kvstore.node.tiers.owners import NamespaceOwners
from kvstore.node.tiers.ram import IndexMemory
from kvstore.node.tiers.stack import TierStack
from kvstore.node.tiers.tasks import Finishing, to_the_end
from kvstore.node.tombstones import Tombstones
from kvstore.node.writes import Writer

log = logging.getLogger("tierkv.node")

# How long close waits for work that cancelled callers left finishing (disk writes of a few
# blocks take well under a second); past it the tiers close anyway, so a stuck disk cannot
# hang a shutdown.
_FINISH_WAIT_S = 5.0


class NodeStore:
    """Use :meth:`open`; the constructor takes already-built tiers: ``memory`` top first, and
    the bottom ``disk`` tier (or None), and ``finishing``, the tracker the disk tier was built
    with: every part that leaves work finishing for a cancelled caller shares it."""

    def __init__(
        self, cfg: StoreConfig, memory: list[SlotTier], disk: BottomTier | None, finishing: Finishing
    ) -> None:
        self.cfg = cfg
        self.stack = TierStack(memory, disk)
        self.tiers = self.stack.all  # top first
        self.memory = memory
        self.disk = disk
        self.name = cfg.node.name or socket.gethostname()
        self._closed = False
        self._finishing = finishing
        # what this node deleted, so another node's repair cannot bring it back (beside LMDB)
        tombstones = Tombstones.beside(
            cfg.disk.path if disk is not None else None, cfg.tombstones.per_tenant, cfg.tombstones.max_age_s
        )
        self.state = NodeState(self.stack, cfg.node.lease_ttl_s, tombstones)
        self.evictor = Evictor(self.stack, self.state, finishing)
        self.placement = Placement(self.stack, self.state, self.evictor, cfg.node.promote_on_read)
        self.leaser = Leaser(self.stack, self.state, self.placement)
        self.reader = Reader(self.state, self.leaser)
        write_back = cfg.disk.write_mode == "write-back"
        self.writer = Writer(self.stack, self.state, self.placement, write_back, finishing)
        self.inspector = Inspector(self.name, self.stack, self.state)
        # which tenant each namespace is (the daemon's HELLOs claim them): the shares' unit
        self.owners = NamespaceOwners(cfg.limits.max_namespaces_per_tenant)
        # the RAM blocks cost beside their payloads, charged where it is spent
        self.index_memory = IndexMemory(cfg.node.index_memory)
        for t in self.tiers:
            t.attach_owners(self.owners)  # type: ignore[attr-defined]
            t.attach_memory(self.index_memory)  # type: ignore[attr-defined]
        if disk is not None:
            disk.protect(self.state.protected)  # a leased or pinned block stays on disk too

    @classmethod
    async def open(cls, cfg: StoreConfig) -> NodeStore:
        """Build the configured tiers and rebuild the disk index. Raises TierError naming the
        tier that cannot be opened."""
        finishing = Finishing()
        memory, disk = await build_tiers(cfg, finishing)
        node = cls(cfg, memory, disk, finishing)
        log.info(
            "event=node_open tiers=%s disk_blocks=%d write_mode=%s",
            ",".join(t.name for t in node.tiers),
            len(disk) if disk is not None else 0,
            cfg.disk.write_mode,
        )
        return node

    @property
    def dram(self) -> SlotTier | None:
        return self.stack.dram

    @property
    def dram_buffer(self) -> memoryview | None:
        """The whole DRAM arena, for registering once with an RDMA device."""
        d = self.dram
        return d.host_buffer if d is not None else None

    # ------------------------------------------------------------------ presence
    async def lookup(self, keys: KeyBatch, sees: Callable[[bytes | None], bool]) -> bytes:
        """Per key one tier code (kvstore.lookups): the highest tier holding it when ``sees``
        accepts its namespace id there (the raw 16 bytes of the block's header, kept in the tiers'
        indexes at commit and at open: no I/O, no decode; None for a block with none), else 0 -- exactly
        ``state.where`` per key plus the tenant check, so another tenant's block reads as absent.
        The daemon's EXISTS and DELETE (8,192 keys for a long prompt): numpy passes per tier
        over the packed keys (:meth:`LruIndex.probe`), no Python per key. Constant shape:
        every tier is asked about every key, whatever the tiers above answered, so another
        tenant's key costs what an absent one does (docs/security.md)."""
        n = len(keys)
        codes = np.zeros(n, dtype=np.uint8)
        pairs = key_pairs(keys)
        above = np.zeros(n, dtype=bool)  # a tier above holds it: that copy is the one seen
        for t in self.tiers:
            held, visible = t.probe(pairs, sees)
            first = held & ~above
            codes[first & visible] = TIER_CODES[t.name]
            above |= held
        doomed = self.state.doomed
        if doomed:  # deleted while held: absent for every reader
            gone = np.fromiter(map(doomed.__contains__, keys.raws()), dtype=bool, count=n)
            codes[gone] = 0
        return codes.tobytes()

    # ------------------------------------------------------------------ delete
    async def delete(self, keys: Sequence[BlockKey], by: str = "", cause: str = "delete") -> list[bool]:
        """Remove blocks from every tier. A held block disappears at once for readers and is
        freed when its last lease ends (:meth:`NodeState.forget`). False where the key was
        absent, and for a key repeated in ``keys`` after its first. Every key is tombstoned,
        absent ones too: a copy elsewhere may come back; the
        tombstones name ``by`` (the deleting tenant) and ``cause`` (kvstore/node/tombstones.py)."""
        st = self.state
        out = []
        disk_keys = []
        seen: set[bytes] = set()  # a disk copy is still indexed until the batch's disk delete
        for key in keys:
            k = key.raw
            present = k not in seen and st.where(k) is not None
            seen.add(k)
            out.append(present)
            if not present:
                continue
            st.pinned.discard(k)
            st.forget(k)
            if self.disk is not None and k in self.disk:
                disk_keys.append(k)
        st.counters["deletes"] += sum(out)
        st.tombstones.add([k.raw for k in keys], by, cause)
        if disk_keys:
            # to its end even when the caller is cancelled: what raced the disk delete is
            # undone only after it
            await to_the_end(self._delete_on_disk(disk_keys), self._finishing)
        return out

    async def _delete_on_disk(self, keys: list[bytes]) -> None:
        """Drop ``keys``' disk copies, then what raced that delete while it ran (the keys
        still indexed on disk meanwhile)."""
        await self.disk.delete(keys)  # type: ignore[union-attr]
        st = self.state
        for k in keys:
            st.pinned.discard(k)  # pinned meanwhile: a pin does not outlive the delete
            if self.stack.in_memory(k):  # a racing read may have promoted it
                st.forget(k)

    # ------------------------------------------------------------------ close, check
    async def close(self) -> None:
        """Wait for work that cancelled callers left finishing (disk writes and what follows
        them; up to a few seconds, then logged and left), flush write-back blocks to disk,
        end leases, close tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # first: that work needs the tiers (the disk's writer thread, LMDB, held slots) to its end
        unfinished = await self._finishing.drain(_FINISH_WAIT_S)
        if unfinished:
            log.warning("event=close_unfinished tasks=%d wait_s=%s", unfinished, _FINISH_WAIT_S)
        left = await self.writer.flush()
        if left:
            log.warning("event=close_unflushed blocks=%d", left)
        for t in self.tiers:
            await t.close()
        self.state.tombstones.close()
        log.info("event=node_closed")

    def check(self) -> None:
        """Integrity check for tests: every tier consistent and within capacity
        (``Tier.check``), and the state's invariants (:meth:`NodeState.check`)."""
        for t in self.tiers:
            t.check()
        self.state.check()
