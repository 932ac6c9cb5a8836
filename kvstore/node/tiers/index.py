"""The compact per-block index every tier keeps: one packed int per block, in LRU order.

An entry packs the payload's slot offset, the block's namespace (as a small id, see
:class:`NamespaceIds`), header and payload lengths and the access time, so 1M blocks cost a
few hundred bytes each, not kilobytes of Python objects. Keeping the namespace in the entry
lets the daemon's per-tenant visibility check (every EXISTS: 8,192 keys for a 128K-token
prompt) answer from memory, with no header read or decode.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from itertools import islice, repeat
from operator import and_, rshift

import msgpack
import numpy as np

_OFF_BITS, _HLEN_BITS, _LEN_BITS = 42, 20, 36
_NS_SHIFT = _OFF_BITS
_HLEN_SHIFT = 2 * _OFF_BITS
_LEN_SHIFT = _HLEN_SHIFT + _HLEN_BITS
_T_SHIFT = _LEN_SHIFT + _LEN_BITS
_OFF_MASK = (1 << _OFF_BITS) - 1
MAX_HEADER_LEN = (1 << _HLEN_BITS) - 1
MAX_OFFSET = _OFF_MASK
MAX_PAYLOAD_LEN = (1 << _LEN_BITS) - 1


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
    if raw is None:
        return None
    try:
        ns = msgpack.unpackb(raw, raw=False).get("ns")
    except Exception:  # a header that does not parse belongs to no namespace
        return None
    return ns if isinstance(ns, bytes) else None


class NamespaceIds:
    """Small ids for the namespaces a tier's blocks belong to (a node holds a few: one per
    model, dtype and block size). Id 0 is "no namespace". Reference-counted, so an id whose
    last block is gone is reused: blocks written under ever new namespaces cannot grow it
    past the number of blocks held."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}
        self._ns: list[bytes | None] = [None]
        self._refs: list[int] = [0]
        self._free: list[int] = []

    def acquire(self, ns: bytes | None) -> int:
        """The id of ``ns`` (one more block holds it); 0 for None."""
        if ns is None:
            return 0
        i = self._ids.get(ns)
        if i is None:
            if self._free:
                i = self._free.pop()
                self._ns[i] = ns
            else:
                i = len(self._ns)
                self._ns.append(ns)
                self._refs.append(0)
            self._ids[ns] = i
        self._refs[i] += 1
        return i

    def release(self, i: int) -> None:
        """One block holding id ``i`` is gone (0 is ignored)."""
        if i == 0:
            return
        self._refs[i] -= 1
        if self._refs[i] == 0:
            del self._ids[self._ns[i]]  # type: ignore[arg-type]
            self._ns[i] = None
            self._free.append(i)

    def get(self, i: int) -> bytes | None:
        return self._ns[i]

    def ids_where(self, accept: Callable[[bytes | None], bool]) -> frozenset[int]:
        """The ids whose namespace ``accept`` takes (0, "no namespace", asked as None): a
        tier holds a few namespaces, so this is a few calls, not one per block."""
        return frozenset(i for i, ns in enumerate(self._ns) if accept(ns))

    def count(self) -> int:
        """How many ids exist (in use or free), 0 included: ids are ``range(count())``."""
        return len(self._ns)

    def __len__(self) -> int:
        return len(self._ids)


class LruIndex:
    """The per-tier index: ``_index`` maps a key to its packed entry, least recently used
    first. Entries are added with :meth:`_index_add` and removed with :meth:`_index_pop`
    (which keep the namespace ids counted). Subclasses call ``LruIndex.__init__``."""

    def __init__(self) -> None:
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._ns_ids = NamespaceIds()

    def _index_add(
        self, key: bytes, offset: int, header_len: int, payload_len: int, atime: int, ns: bytes | None
    ) -> None:
        """Index ``key`` (most recently used); ``ns``: its header's namespace (see
        :func:`header_namespace`). An entry already there is replaced (its namespace id
        released: the ids stay counted)."""
        self._index_pop(key)
        ns_id = self._ns_ids.acquire(ns)
        self._index[key] = pack_entry(offset, ns_id, header_len, payload_len, atime)

    def _index_pop(self, key: bytes) -> int | None:
        e = self._index.pop(key, None)
        if e is not None:
            self._ns_ids.release(entry_ns_id(e))
        return e

    def _index_clear(self) -> None:
        self._index.clear()
        self._ns_ids = NamespaceIds()

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        idx = self._index
        return [k in idx for k in keys]

    def probe(self, keys: list[bytes], sees: Callable[[bytes | None], bool]) -> tuple[np.ndarray, np.ndarray]:
        """Per key, whether this tier holds it and whether it holds it in a namespace ``sees``
        accepts (two bool arrays): one pass of C-level maps over the index, no Python
        bytecode per key. ``sees`` is asked once per namespace id of the tier; the entry's
        id decides per key (exact, as :meth:`namespace` then ``sees`` would)."""
        n, idx = len(keys), self._index
        held = np.fromiter(map(idx.__contains__, keys), dtype=bool, count=n)
        ok = self._ns_ids.ids_where(sees)
        if len(ok) == self._ns_ids.count():  # every namespace here is visible
            return held, held
        if not ok or not held.any():
            return held, np.zeros(n, dtype=bool)
        entries = map(idx.get, keys, repeat(0, n))
        ids = map(and_, map(rshift, entries, repeat(_NS_SHIFT, n)), repeat(_OFF_MASK, n))
        visible = np.fromiter(map(ok.__contains__, ids), dtype=bool, count=n)
        return held, visible & held

    def payload_len(self, key: bytes) -> int:
        return entry_payload_len(self._index[key])

    def atime(self, key: bytes) -> int:
        return entry_atime(self._index[key])

    def namespace(self, key: bytes) -> bytes | None:
        """The namespace id (raw bytes) in ``key``'s stored header, None when absent or when
        the header had none. From the index: no I/O, no decode."""
        e = self._index.get(key)
        return None if e is None else self._ns_ids.get((e >> _NS_SHIFT) & _OFF_MASK)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` most recently used (no-op when absent)."""
        e = self._index.get(key)
        if e is not None:
            self._index[key] = entry_touch(e, now_s())
            self._index.move_to_end(key)

    def victims(self, limit: int = 256) -> Iterator[bytes]:
        """Up to ``limit`` keys, least recently used first (a snapshot: safe to mutate after)."""
        return iter(list(islice(self._index, limit)))

    def keys(self) -> Iterator[bytes]:
        return iter(self._index)
