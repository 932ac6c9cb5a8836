"""What every tier offers the node, and the compact per-block index entry they share.

A tier stores (key, encoded header, payload) triples and keeps its own LRU order. Batched calls
take and return lists in input order. The node owns placement and policy: which tier takes a
block, when a block moves down, which blocks may not be evicted (leases, pins). A tier's
``victims()`` is its eviction hook: least recently used keys first.

Index entries are one packed int per block (payload and header offsets, lengths, access
time), so 1M blocks cost a few hundred bytes each, not kilobytes of Python objects.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Protocol

from kvstore.results import Status

_OFF_BITS, _HLEN_BITS, _LEN_BITS = 42, 20, 36
_HOFF_SHIFT = _OFF_BITS
_HLEN_SHIFT = 2 * _OFF_BITS
_LEN_SHIFT = _HLEN_SHIFT + _HLEN_BITS
_T_SHIFT = _LEN_SHIFT + _LEN_BITS
_OFF_MASK = (1 << _OFF_BITS) - 1
MAX_HEADER_LEN = (1 << _HLEN_BITS) - 1
MAX_PAYLOAD_LEN = (1 << _LEN_BITS) - 1


def pack_entry(offset: int, header_offset: int, header_len: int, payload_len: int, atime: int) -> int:
    """One int per block: payload slot offset, a second offset (always 0 now: no tier keeps a
    header in its arena), header and payload lengths, access time (seconds). The disk tier
    leaves both offsets 0."""
    return (
        offset
        | (header_offset << _HOFF_SHIFT)
        | (header_len << _HLEN_SHIFT)
        | (payload_len << _LEN_SHIFT)
        | (atime << _T_SHIFT)
    )


def entry_offset(e: int) -> int:
    return e & _OFF_MASK


def entry_header_offset(e: int) -> int:
    return (e >> _HOFF_SHIFT) & _OFF_MASK


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


class LruIndex:
    """The per-tier index both tiers share: ``_index`` maps a key to its packed entry, least
    recently used first. Subclasses set ``self._index = OrderedDict()``."""

    _index: OrderedDict[bytes, int]

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        idx = self._index
        return [k in idx for k in keys]

    def payload_len(self, key: bytes) -> int:
        return entry_payload_len(self._index[key])

    def atime(self, key: bytes) -> int:
        return entry_atime(self._index[key])

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


class Tier(Protocol):
    """The interface the node drives. Methods named ``*_sync`` never do I/O; the async ones may
    run I/O on threads but never block the event loop. Not thread-safe: call from the loop."""

    name: str

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def __contains__(self, key: bytes) -> bool: ...

    def __len__(self) -> int: ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    async def get_into(self, keys: Sequence[bytes], bufs: Sequence) -> list[tuple[Status, bytes | None]]:
        """Copy each payload into its buffer; per key (status, encoded header or None)."""
        ...

    async def put(self, items: Sequence[tuple[bytes, bytes, object]]) -> list[bool]:
        """Store (key, header, payload) triples; False where there is no room."""
        ...

    async def delete(self, keys: Sequence[bytes]) -> list[bool]: ...

    async def read_header(self, key: bytes) -> bytes | None: ...

    def touch(self, key: bytes) -> None: ...

    def victims(self) -> Iterator[bytes]:
        """Keys in least-recently-used order (the eviction hook)."""
        ...

    def stats(self) -> dict: ...
