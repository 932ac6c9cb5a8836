"""A node's side of the cluster's orphan pass (kvstore/member/orphans.py) and of the repair's
drop (kvstore/member/repair.py): reading its blocks' parents and ``created`` times, and dropping
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

import numpy as np
from msgpack import unpackb

from kvstore.block import make_header
from kvstore.keys import KEY_BYTES, BlockKey, KeyBatch
from kvstore.node.store import NodeStore
from kvstore.node.tiers.index import header_fields
from kvstore.node.tiers.visibility import Visibility

_EVERY = Visibility(everything=True)  # the node's own view: every tenant's blocks


def _prefix_layout() -> tuple[bytes, int, int, np.ndarray]:
    """How :meth:`BlockHeader.encode` begins every header: the map, ``v`` and the 16-byte
    ``key``, ``parent`` and ``ns`` (its first four fields, each value in one fixed place).
    Returns the prefix of a sample header, where its parent and namespace values start, and
    which of its bytes are the same in every header of this block format (not a key's)."""
    marks = {name: bytes([i + 1]) * KEY_BYTES for i, name in enumerate(("key", "parent", "ns"))}
    raw = make_header(
        key=BlockKey(marks["key"]), parent=BlockKey(marks["parent"]), namespace=BlockKey(marks["ns"]),
        tokens=[0], dtype="uint8", shape=[1], payload=b"\0", created=0.0,
    ).encode()  # fmt: skip
    at = {name: raw.index(m) for name, m in marks.items()}
    assert all(raw.count(m) == 1 for m in marks.values()) and at["key"] < at["parent"] < at["ns"]
    prefix = raw[: at["ns"] + KEY_BYTES]
    fixed = np.ones(len(prefix), bool)
    for start in at.values():
        fixed[start : start + KEY_BYTES] = False
    return prefix, at["parent"], at["ns"], fixed


_PREFIX, _PARENT_AT, _NS_AT, _FIXED = _prefix_layout()
_FIXED_BYTES = np.frombuffer(_PREFIX, np.uint8)[_FIXED]


async def _headers(node: NodeStore, keys: Sequence[bytes]) -> list[bytes | None]:
    """Per key, its stored header's bytes from the highest tier holding it (None where gone).
    Memory tiers answer from memory; the disk's blocks in one batched read."""
    out: list[bytes | None] = [None] * len(keys)
    for i, t in enumerate(node.memory):  # top first: a higher tier's header is kept
        got = list(map(t.header_sync, keys))
        out = got if i == 0 else [h if h is not None else g for h, g in zip(out, got)]
    disk = node.disk
    if disk is not None:
        on_disk = [i for i, h in enumerate(out) if h is None and keys[i] in disk]
        if on_disk:
            for i, h in zip(on_disk, await disk.read_headers([keys[i] for i in on_disk])):
                out[i] = h
    return out


async def parents(node: NodeStore, keys: KeyBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key of ``keys``, from its stored header (the highest tier holding it): its
    namespace and parent, and whether both are known (see :func:`header_columns`)."""
    return header_columns(await _headers(node, keys.raws()))


def header_columns(raws: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per encoded header of ``raws``: its ``ns`` and ``parent`` (two ``n x 16`` uint8 arrays,
    zeros where unknown) and whether both are known (a bool array; False where there is no
    header, or it does not parse as one with 16-byte ``ns`` and ``parent``). A header laid out
    as :meth:`BlockHeader.encode` writes it (what every client of this format stores) is read
    in numpy passes over the headers joined in one buffer, no decode per header; any other
    is decoded alone (msgpack), with the same answer :func:`header_fields` gives."""
    n = len(raws)
    ns = np.zeros((n, KEY_BYTES), np.uint8)
    parent = np.zeros((n, KEY_BYTES), np.uint8)
    known = np.zeros(n, bool)
    hs = [h if h is not None else b"" for h in raws]
    lens = np.fromiter(map(len, hs), np.int64, count=n)
    buf = np.frombuffer(b"".join(hs), np.uint8)
    fit = np.flatnonzero(lens >= len(_PREFIX))
    starts = (np.cumsum(lens) - lens)[fit]
    rows = buf[starts[:, None] + np.arange(len(_PREFIX))]  # each header's first bytes
    laid = (rows[:, _FIXED] == _FIXED_BYTES).all(axis=1)
    at = fit[laid]
    parent[at] = rows[laid, _PARENT_AT : _PARENT_AT + KEY_BYTES]
    ns[at] = rows[laid, _NS_AT : _NS_AT + KEY_BYTES]
    known[at] = True
    alone = lens > 0
    alone[at] = False
    for i in np.flatnonzero(alone).tolist():  # another encoder's layout: decoded alone
        n_s, p = header_fields(hs[i])
        if n_s is not None and p is not None and len(n_s) == len(p) == KEY_BYTES:
            ns[i] = np.frombuffer(n_s, np.uint8)
            parent[i] = np.frombuffer(p, np.uint8)
            known[i] = True
    return ns, parent, known


async def stored(node: NodeStore, keys: KeyBatch) -> np.ndarray:
    """Per key, whether any tier of ``node`` holds it (a bool array; deleted-while-held keys
    count as gone): numpy passes over the tiers' indexes, no Python per key."""
    if not len(keys):
        return np.zeros(0, bool)
    return np.frombuffer(await node.lookup(keys, _EVERY), np.uint8) != 0


def orphan_bytes(node: NodeStore, keys: Sequence[bytes]) -> Counter[tuple[str, str]]:
    """Bytes (payload and header) of ``keys`` per ``(tier, namespace hex)`` where they are
    stored now (a block in two tiers counts in each)."""
    c: Counter[tuple[str, str]] = Counter()
    for k in keys:
        for t in node.tiers:
            if k in t:
                ns = t.namespace(k)
                c[(t.name, ns.hex() if ns is not None else "")] += t.payload_len(k)
    return c


async def created(node: NodeStore, keys: Sequence[bytes]) -> list[float | None]:
    """Per key, its stored header's ``created`` (the highest tier holding it; None where the
    key is gone or its header does not parse): which copy of a key this node holds now."""
    held = (await stored(node, KeyBatch(b"".join(keys)))).tolist()
    live = [k for k, ok in zip(keys, held) if ok]
    got = dict(zip(live, map(_created, await _headers(node, live))))
    return [got.get(k) for k in keys]


def _created(raw: bytes | None) -> float | None:
    try:
        return float(unpackb(raw)["created"]) if raw else None
    except Exception:  # a header that does not parse: no copy to speak of
        return None


async def drop(node: NodeStore, keys: Sequence[bytes], reason: str = "orphan") -> Counter[str]:
    """Evict ``keys`` from every tier of ``node`` without a tombstone: ``dropped`` (blocks),
    ``held`` (leased or pinned: kept). ``reason``: ``orphan`` (the orphan pass) or
    ``deleted_elsewhere`` (the repair, for a copy another node deleted since it was written).
    Node counters: ``evictions_<tier>`` and ``evictions_<tier>_<reason>``."""
    c: Counter[str] = Counter()
    st = node.state  # leases, pins, dirty keys and the node's counters
    on_disk: list[bytes] = []
    held = (await stored(node, KeyBatch(b"".join(keys)))).tolist()
    seen: set[bytes] = set()
    for k, ok in zip(keys, held):
        if not ok or k in seen:
            continue
        seen.add(k)
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
