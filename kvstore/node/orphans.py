"""A node's side of the cluster's orphan pass (kvstore/client/orphans.py) and of the repair's
drop (kvstore/client/repair.py): reading its blocks' parents and ``created`` times, and dropping
the blocks the pass found orphaned or another node deleted since they were written.

An orphan is a block whose parent is stored nowhere in the cluster: no hit prefix can reach
it again (a lookup stops at the missing parent), so its bytes are wasted until it is evicted.
Dropping one is an eviction (reason ``orphan``), not a delete: it leaves no tombstone, so a
client that writes the chain again stores the block as new. A held (leased, in a copy) or
pinned block stays where it is. Same threading rules as the node: one event loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from msgpack import unpackb

from kvstore.node.tiers.index import header_fields


async def _headers(node, keys: Sequence[bytes]) -> list[bytes | None]:
    """Per key, its stored header's bytes from the highest tier holding it (None where gone).
    Memory tiers answer from memory; the disk's blocks in one batched read."""
    out: list[bytes | None] = [None] * len(keys)
    on_disk: list[int] = []
    for i, k in enumerate(keys):
        for t in node.memory:
            if k in t:
                out[i] = t.header_sync(k)
                break
        else:
            if node.disk is not None and k in node.disk:
                on_disk.append(i)
    if on_disk:
        for i, h in zip(on_disk, await node.disk.read_headers([keys[i] for i in on_disk])):
            out[i] = h
    return out


async def parents(node, keys: Sequence[bytes]) -> list[tuple[bytes | None, bytes | None]]:
    """Per key, ``(namespace, parent)`` from its stored header (the highest tier holding it;
    ``(None, None)`` where the key is gone or its header does not parse)."""
    return [header_fields(h) for h in await _headers(node, keys)]


def stored(node, key: bytes) -> bool:
    """Whether any tier of ``node`` holds ``key`` (deleted-while-held keys count as gone)."""
    return key not in node.state.doomed and any(key in t for t in node.tiers)


def orphan_bytes(node, keys: Sequence[bytes]) -> Counter[tuple[str, str]]:
    """Bytes (payload and header) of ``keys`` per ``(tier, namespace hex)`` where they are
    stored now (a block in two tiers counts in each)."""
    c: Counter[tuple[str, str]] = Counter()
    for k in keys:
        for t in node.tiers:
            if k in t:
                ns = t.namespace(k)
                c[(t.name, ns.hex() if ns is not None else "")] += t.payload_len(k)
    return c


async def created(node, keys: Sequence[bytes]) -> list[float | None]:
    """Per key, its stored header's ``created`` (the highest tier holding it; None where the
    key is gone or its header does not parse): which copy of a key this node holds now."""
    live = [k for k in keys if stored(node, k)]
    got = dict(zip(live, map(_created, await _headers(node, live))))
    return [got.get(k) for k in keys]


def _created(raw: bytes | None) -> float | None:
    try:
        return float(unpackb(raw)["created"]) if raw else None
    except Exception:  # a header that does not parse: no copy to speak of
        return None


async def drop(node, keys: Sequence[bytes], reason: str = "orphan") -> Counter[str]:
    """Evict ``keys`` from every tier of ``node`` without a tombstone: ``dropped`` (blocks),
    ``held`` (leased or pinned: kept). ``reason``: ``orphan`` (the orphan pass) or
    ``deleted_elsewhere`` (the repair, for a copy another node deleted since it was written).
    Node counters: ``evictions_<tier>`` and ``evictions_<tier>_<reason>``."""
    c: Counter[str] = Counter()
    st = node.state  # leases, pins, dirty keys and the node's counters
    on_disk: list[bytes] = []
    for k in keys:
        if not stored(node, k):
            continue
        if st.protected(k):
            c["held"] += 1
            continue
        for t in node.memory:
            if t.remove(k, evicted=True):
                st.counters[f"evictions_{t.name}"] += 1
                st.counters[f"evictions_{t.name}_{reason}"] += 1
        st.dirty.discard(k)
        if node.disk is not None and k in node.disk:
            on_disk.append(k)
        c["dropped"] += 1
    if on_disk:
        gone = sum(await node.disk.delete(on_disk))
        st.counters[f"evictions_disk_{reason}"] += gone
    return c
