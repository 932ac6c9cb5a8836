"""The orphan pass reads its blocks' parents in columns (kvstore/node/orphans.py): headers laid
out as BlockHeader.encode writes them are read in numpy passes over one buffer, any other is
decoded alone, and both agree with the one-header decode (``header_fields``). Real DRAM and
disk tiers for the node's side; counts only, no timing."""

from __future__ import annotations

import msgpack
import numpy as np
from storeutil import checked, make_blocks

from kvstore.keys import BlockKey, KeyBatch, Namespace
from kvstore.node import orphans as node_orphans
from kvstore.node.store import NodeStore
from kvstore.node.tiers.index import header_fields

NS = Namespace("orphan-headers", "uint8", 4)


def expected(raw: bytes | None) -> tuple[bytes, bytes] | None:
    """What the one-header decode says: (ns, parent) when both are 16 bytes, else None."""
    ns, parent = header_fields(raw)
    return (ns, parent) if ns is not None and parent is not None and len(ns) == len(parent) == 16 else None


def columns_as_list(cols) -> list[tuple[bytes, bytes] | None]:
    ns, parent, known = cols
    return [(bytes(n), bytes(p)) if k else None for n, p, k in zip(ns, parent, known.tolist())]


def test_header_columns_agree_with_the_one_header_decode(monkeypatch):
    blocks = make_blocks(6, nbytes=64, seed=1, ns=NS) + make_blocks(3, nbytes=4096, seed=2)
    encoded = [h.encode() for h, _ in blocks]
    d = msgpack.unpackb(encoded[1], raw=False)
    reordered = msgpack.packb(dict(reversed(list(d.items()))), use_bin_type=True)  # parent last
    other_version = msgpack.packb({**d, "v": 2}, use_bin_type=True)  # same layout, another byte
    short_parent = msgpack.packb({**d, "parent": b"\x01" * 8}, use_bin_type=True)
    # the parent's key written as str 8 (0xd9) instead of fixstr: another layout, same fields
    str8 = encoded[2].replace(b"\xa6parent", b"\xd9\x06parent")
    assert header_fields(str8) == header_fields(encoded[2])
    odd = [reordered, other_version, short_parent, str8, b"\x00" * 90, b"\xc1", b"\x80"]
    raws = [*encoded, None, *odd, b""]
    decoded_alone = []
    monkeypatch.setattr(
        node_orphans, "header_fields", lambda raw: decoded_alone.append(raw) or header_fields(raw)
    )  # counts the headers that took the per-header path (the real decode runs)
    got = columns_as_list(node_orphans.header_columns(raws))
    assert got == [expected(r) for r in raws]
    assert got[0] == (NS.id.raw, NS.id.raw)  # a chain's first block names its namespace
    assert got[1] == (NS.id.raw, blocks[0][0].key.raw)
    assert got[len(encoded) + 1] == (NS.id.raw, blocks[0][0].key.raw)  # reordered, decoded alone
    assert got[len(encoded) + 3] is None  # an 8-byte parent is not a key
    # every header BlockHeader.encode wrote went through the columns, every other alone
    assert decoded_alone == odd
    empty = node_orphans.header_columns([])
    assert [a.shape for a in empty] == [(0, 16), (0, 16), (0,)]


async def test_parents_read_from_every_tier_and_stored_answers_in_columns(cfg_factory):
    # 8 MiB of DRAM: most of 64 blocks of 256 KiB go down to disk as more arrive
    async with checked(await NodeStore.open(cfg_factory())) as node:
        blocks = make_blocks(64, seed=3, ns=NS)
        for i in range(0, len(blocks), 8):
            res = await node.writer.put(blocks[i : i + 8])
            assert all(r.status.ok for r in res), [r.status.name for r in res]
        on_disk = [h.key.raw for h, _ in blocks if h.key.raw in node.disk and h.key.raw not in node.memory[0]]
        in_dram = [h.key.raw for h, _ in blocks if h.key.raw in node.memory[0]]
        assert on_disk and in_dram, (len(on_disk), len(in_dram))  # both tiers answer
        absent = [BlockKey(bytes([7]) * 16).raw, BlockKey(bytes([8]) * 16).raw]
        keys = [h.key.raw for h, _ in blocks][::-1] + absent
        got = columns_as_list(await node_orphans.parents(node, KeyBatch(b"".join(keys))))
        want = {h.key.raw: (h.namespace.raw, h.parent.raw) for h, _ in blocks}
        assert got == [want.get(k) for k in keys]
        held = await node_orphans.stored(node, KeyBatch(b"".join(keys)))
        assert held.tolist() == [True] * len(blocks) + [False, False]
        assert (await node_orphans.stored(node, KeyBatch(b""))).shape == (0,)
        # dropped blocks are gone from the columns too
        gone = (await node_orphans.drop(node, keys[:5] + keys[:1]))["dropped"]
        assert gone == 5  # a key twice is dropped once
        held = await node_orphans.stored(node, KeyBatch(b"".join(keys)))
        assert held.tolist() == [False] * 5 + [True] * (len(blocks) - 5) + [False, False]
        ns, parent, known = await node_orphans.parents(node, KeyBatch(b"".join(keys[:6])))
        assert known.tolist() == [False] * 5 + [True]
        assert not ns[:5].any() and not parent[:5].any()
        assert np.array_equal(parent[5], np.frombuffer(want[keys[5]][1], np.uint8))
