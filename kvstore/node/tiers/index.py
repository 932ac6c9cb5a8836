"""The compact per-block index every tier keeps: one packed int per block, and the tier's
eviction order beside it (kvstore.node.tiers.order: which block goes first).

An entry packs the payload's slot offset, the block's namespace (as a small id, see
:class:`~kvstore.node.tiers.namespace_ids.NamespaceIds`), header and payload lengths and the access time, so 1M blocks cost a
few hundred bytes each, not kilobytes of Python objects. Keeping the namespace in the entry
lets the daemon's per-tenant visibility check (every EXISTS: 8,192 keys for a 128K-token
prompt) answer from memory, with no header read or decode.

Beside the dict, a :class:`~kvstore.keytable.KeyTable` maps each key to its namespace
id, so an EXISTS probes a whole batch of packed keys in a few numpy passes
(:meth:`LruIndex.probe`), not one dict probe per key. Adds and removals only mark the key
(one dict store); the table catches up on the marked keys, all at once, at the next probe
(or every ``_SYNC_EVERY`` changes), from the dict (the truth), so a probe always answers
exactly as the dict would. It costs 60-110 bytes per block (log, index and filter arrays,
sized with headroom; ~70 measured at 100K blocks), beside ~280 for the dict, its entries and
the eviction order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from itertools import islice, repeat
from operator import and_, rshift

import msgpack
import numpy as np

from kvstore.keys import KeyBatch
from kvstore.keytable import KeyTable, key_pairs
from kvstore.node.tiers.namespace_ids import NamespaceIds
from kvstore.node.tiers.order import EvictionOrder, LruOrder
from kvstore.node.tiers.owners import NamespaceOwners
from kvstore.node.tiers.ram import IndexMemory
from kvstore.node.tiers.visibility import Visibility

_OFF_BITS, _HLEN_BITS, _LEN_BITS = 42, 20, 36
_NS_SHIFT = _OFF_BITS
_HLEN_SHIFT = 2 * _OFF_BITS
_LEN_SHIFT = _HLEN_SHIFT + _HLEN_BITS
_T_SHIFT = _LEN_SHIFT + _LEN_BITS
_OFF_MASK = (1 << _OFF_BITS) - 1
MAX_HEADER_LEN = (1 << _HLEN_BITS) - 1
MAX_OFFSET = _OFF_MASK
MAX_PAYLOAD_LEN = (1 << _LEN_BITS) - 1
_TABLE_MAX = 1 << 30  # the probe table's bound: far past any tier's block count
_TOP_NAMESPACES = 16  # namespaces a tier's stats name one by one (the rest summed)
_SYNC_EVERY = 8192  # changed keys that make the probe table catch up at once (bounds the marks)


def pack_entry(offset: int, ns_id: int, header_len: int, payload_len: int, atime: int) -> int:
    """One int per block: payload slot offset (on disk, where a block has no slot: the version
    of the stored copy), namespace id (0: none), header and payload lengths, access time
    (seconds)."""
    return (
        offset
        | (ns_id << _NS_SHIFT)
        | (header_len << _HLEN_SHIFT)
        | (payload_len << _LEN_SHIFT)
        | (atime << _T_SHIFT)
    )


def entry_offset(e: int) -> int:
    return e & _OFF_MASK


def entry_ns_id(e: int) -> int:
    return (e >> _NS_SHIFT) & _OFF_MASK


def entry_header_len(e: int) -> int:
    return (e >> _HLEN_SHIFT) & MAX_HEADER_LEN


def entry_payload_len(e: int) -> int:
    return (e >> _LEN_SHIFT) & MAX_PAYLOAD_LEN


def entry_atime(e: int) -> int:
    return e >> _T_SHIFT


def entry_touch(e: int, atime: int) -> int:
    return (e & ((1 << _T_SHIFT) - 1)) | (atime << _T_SHIFT)


def now_s() -> int:
    """Wall-clock seconds, the resolution of access times in the index."""
    return int(time.time())


def header_namespace(raw) -> bytes | None:
    """The ``ns`` field of an encoded header (bytes), without building a BlockHeader; None
    when the header does not parse as a map with a bytes ``ns``."""
    return header_fields(raw)[0]


def header_fields(raw) -> tuple[bytes | None, bytes | None]:
    """The ``ns`` and ``parent`` fields of an encoded header (one decode, no BlockHeader);
    None for a field that is not bytes or a header that does not parse as a map."""
    if raw is None:
        return None, None
    try:
        d = msgpack.unpackb(raw, raw=False)
        ns, parent = d.get("ns"), d.get("parent")
    except Exception:  # a header that does not parse belongs to no namespace
        return None, None
    return (ns if isinstance(ns, bytes) else None), (parent if isinstance(parent, bytes) else None)


class LruIndex:
    """The per-tier index: ``_index`` maps a key to its packed entry; ``_order`` (an
    :class:`~kvstore.node.tiers.order.EvictionOrder`, per-block LRU unless given) says which
    goes first. Entries are added with :meth:`_index_add` and removed with :meth:`_index_pop`
    (which keep the namespace ids and the order up to date). Subclasses call
    ``LruIndex.__init__``."""

    def __init__(self, order: EvictionOrder | None = None) -> None:
        self._index: dict[bytes, int] = {}
        self._ns_ids = NamespaceIds()
        self._order: EvictionOrder = order if order is not None else LruOrder()
        self._table = KeyTable(_TABLE_MAX)  # key -> namespace id, for batch probes
        self._changed: dict[bytes, None] = {}  # keys added or removed since the table's sync
        self._ram: IndexMemory | None = None  # the node's budget (attach_memory)
        self.ram_bytes = 0  # what this tier's blocks are charged against it

    # a memory tier keeps its headers in RAM: they are charged too, from the reservation on
    # (MemoryTier.reserve), so reservations in flight cannot pass the budget
    headers_in_ram = False

    def _index_add(
        self,
        key: bytes,
        offset: int,
        header_len: int,
        payload_len: int,
        atime: int,
        ns: bytes | None,
        parent: bytes | None = None,
        demoted: bool = False,
    ) -> None:
        """Index ``key`` (most recently used); ``ns`` and ``parent``: its header's namespace and
        parent key (see :func:`header_fields`); ``demoted``: moved down from a tier above (see
        EvictionOrder.add). An entry already there is replaced (its namespace id released: the
        ids stay counted)."""
        self._index_pop(key)
        ns_id = self._ns_ids.acquire(ns, header_len + payload_len)
        if not self.headers_in_ram:  # a memory tier charged it at its reservation
            self._charge_ram(IndexMemory.cost(0))
        self._index[key] = pack_entry(offset, ns_id, header_len, payload_len, atime)
        self._order.add(key, parent, demoted)
        self._changed[key] = None
        if len(self._changed) >= _SYNC_EVERY:  # writes with no probe between: bounded marks
            self._sync_table()

    def _index_pop(self, key: bytes) -> int | None:
        e = self._index.pop(key, None)
        if e is not None:
            self._ns_ids.release(entry_ns_id(e), entry_header_len(e) + entry_payload_len(e))
            self._charge_ram(-self.ram_cost(entry_header_len(e)))
            self._order.discard(key)
            self._changed[key] = None
        return e

    def _sync_table(self) -> None:
        """Bring the probe table to the dict: each key changed since the last sync is set to
        its entry's namespace id, or dropped when the dict no longer holds it (work per
        change, in C-level maps, paid by the next probe; none when nothing changed)."""
        if not self._changed:
            return
        keys = list(self._changed)
        self._changed.clear()
        n, idx = len(keys), self._index
        pairs = key_pairs(KeyBatch(b"".join(keys)))
        held = np.fromiter(map(idx.__contains__, keys), dtype=bool, count=n)
        gone = np.flatnonzero(~held)
        if len(gone):
            self._table.remove(pairs[gone])
        at = np.flatnonzero(held)
        if len(at):
            entries = map(idx.__getitem__, [keys[i] for i in at.tolist()])
            ids = np.fromiter(
                map(and_, map(rshift, entries, repeat(_NS_SHIFT)), repeat(_OFF_MASK)),
                dtype=np.int64,
                count=len(at),
            )
            self._table.insert(pairs[at], ids)

    def _index_clear(self) -> None:
        for key in list(self._index):
            self._index_pop(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        idx = self._index
        return [k in idx for k in keys]

    def probe(self, pairs: np.ndarray, sees: Callable[[bytes | None], bool]) -> tuple[np.ndarray, np.ndarray]:
        """Per key (rows of ``pairs``, packed keys: :func:`~kvstore.keytable.key_pairs`),
        whether this tier holds it and whether it holds it in a namespace ``sees`` accepts
        (two bool arrays): numpy passes over the probe table, no Python per key. A
        :class:`~kvstore.node.tiers.visibility.Visibility` is read for its own namespaces (a
        few dict lookups: the work does not grow with the namespaces other tenants hold); any
        other callable is asked once per namespace id of the tier. The key's id decides per
        key (exact, as :meth:`namespace` then ``sees`` would). When every block of the tier
        holds an id ``sees`` accepts (one tenant's blocks, the usual case), held is visible."""
        self._sync_table()
        nsi = self._ns_ids
        if isinstance(sees, Visibility):
            if sees.everything:  # a peer session: nothing to hide, the run guess is fine
                held = self._table.find(pairs) >= 0
                return held, held
            # a tenant: each key through the index, held or not, so the time of the answer
            # does not tell another tenant's key from an absent one
            ids = self._table.find_each(pairs)
            held = ids >= 0
            ok = [i for ns in sees.namespaces if (i := nsi.id_of(ns)) is not None]
            if sum(map(nsi.refs, ok)) == len(self._index):  # every block here is visible
                return held, held
            return held, held & np.isin(ids, ok)
        ids = self._table.find(pairs)
        held = ids >= 0
        ok_ids = nsi.ids_where(sees)
        if nsi.all_held_in(ok_ids):
            return held, held
        seen = np.zeros(nsi.count(), dtype=bool)
        seen[list(ok_ids)] = True
        return held, held & seen.take(np.maximum(ids, 0))

    def payload_len(self, key: bytes) -> int:
        return entry_payload_len(self._index[key])

    def atime(self, key: bytes) -> int:
        return entry_atime(self._index[key])

    def namespace(self, key: bytes) -> bytes | None:
        """The namespace id (raw bytes) in ``key``'s stored header, None when absent or when
        the header had none. From the index: no I/O, no decode."""
        e = self._index.get(key)
        return None if e is None else self._ns_ids.get((e >> _NS_SHIFT) & _OFF_MASK)

    def attach_memory(self, ram: IndexMemory) -> None:
        """Charge this tier's blocks against ``ram`` (the node's budget) from now on."""
        ram.charge(self.ram_bytes)
        self._ram = ram

    def _charge_ram(self, nbytes: int) -> None:
        """Charge ``nbytes`` (negative: refund) to this tier and the node's RAM budget."""
        self.ram_bytes += nbytes
        if self._ram is not None:
            self._ram.charge(nbytes)

    def ram_room(self, header_len: int) -> bool:
        """Whether the node's RAM budget has room for one more block of this header here."""
        ram = self._ram
        return ram is None or ram.fits(IndexMemory.cost(header_len if self.headers_in_ram else 0))

    def ram_cost(self, header_len: int) -> int:
        return IndexMemory.cost(header_len if self.headers_in_ram else 0)

    def ram_free(self) -> float:
        """Bytes left in the node's RAM budget (infinite when none is attached)."""
        return float("inf") if self._ram is None else self._ram.free()

    def attach_owners(self, owners: NamespaceOwners) -> None:
        """Sum this tier's bytes per tenant as ``owners`` (the node's) says (tenant shares)."""
        self._ns_ids.owners = owners
        owners.watch(self._ns_ids)

    def owner(self, key: bytes) -> Hashable:
        """The owner ``key``'s bytes count under (kvstore.node.tiers.owners), None when absent."""
        e = self._index.get(key)
        return None if e is None else self._ns_ids.owner_of((e >> _NS_SHIFT) & _OFF_MASK)

    def owner_of_namespace(self, ns: bytes | None) -> Hashable:
        """The owner a block of namespace ``ns`` would count under."""
        owners = self._ns_ids.owners
        return owners.owner(ns) if owners is not None else ns

    def owner_usage(self, owner: Hashable) -> int:
        """Bytes (payloads and headers) of this tier's blocks that ``owner`` holds."""
        return self._ns_ids.owner_usage(owner)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` used now (no-op when absent)."""
        e = self._index.get(key)
        if e is not None:
            self._index[key] = entry_touch(e, now_s())
            self._order.touch(key)

    def victims(self, limit: int = 256) -> Iterator[bytes]:
        """Up to ``limit`` keys in eviction order (a snapshot: safe to mutate after)."""
        it = self._order.candidates()
        try:
            return iter(list(islice(it, limit)))
        finally:
            it.close()

    def first_victim(self, accept: Callable[[bytes], bool], limit: int) -> bytes | None:
        """The first key in eviction order (of the first ``limit``) that ``accept`` takes, or
        None: one step of the order where a snapshot of ``limit`` would pay for all of them."""
        it = self._order.candidates()
        try:
            for k in islice(it, limit):
                if accept(k):
                    return k
            return None
        finally:
            it.close()

    def eviction_stats(self) -> dict:
        """The order's policy and counters (see kvstore.node.tiers.order), the bytes of its
        orphans, and the bytes per tenant and of the top namespaces (:meth:`~kvstore.node.tiers.namespace_ids.NamespaceIds.usage_summary`)."""
        orphans = getattr(self._order, "orphans", ())
        idx = self._index
        return {
            **self._order.stats(),
            "ram_bytes": self.ram_bytes,  # this tier's share of the node's RAM budget
            "ram_budget_bytes": self._ram.budget if self._ram is not None else 0,
            "ram_used_bytes": self._ram.used if self._ram is not None else self.ram_bytes,  # every tier
            "orphan_bytes": sum(entry_payload_len(idx[k]) + entry_header_len(idx[k]) for k in orphans),
            **self._ns_ids.usage_summary(_TOP_NAMESPACES),
        }

    def keys(self) -> Iterator[bytes]:
        """Stored keys, in no particular order."""
        return iter(self._index)

    def keys_added(self) -> int:
        """How many keys ever joined this tier's probe table (brought to the dict first): the
        same number twice means no key was added in between (deleted ones a reader skips)."""
        self._sync_table()
        return self._table.added

    def key_pairs(self) -> np.ndarray:
        """Every stored key as an ``(n, 2)`` uint64 row (kvstore.keytable.key_pairs), from the
        probe table brought to the dict first: no Python per key (a listing's key snapshot of
        100,000 keys as ``list(keys())`` held the loop 1-2 ms)."""
        self._sync_table()
        return self._table.live_pairs()
