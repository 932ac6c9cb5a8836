"""The tiers' indexes keep each block's namespace id (no header read, no decode) for the
tenant check, NodeStore.lookup: it must see exactly the decoded header's namespace for
DRAM and disk blocks -- also after a restart rebuilds the disk index -- and no namespace for
absent, deleted and corrupt blocks. Asserted through lookup itself (seen_namespaces)."""

from __future__ import annotations

from storeutil import checked, make_blocks, on_disk_only, tiers_of

from kvstore.block import BlockHeader
from kvstore.keys import KeyBatch, Namespace
from kvstore.lookups import tier_names
from kvstore.node.store import NodeStore
from kvstore.node.tiers.namespace_ids import NamespaceIds

KiB = 1 << 10
OTHER = Namespace("other-model", "float16", 4)
TENANT = Namespace("test-model", "float16", 4).with_tenant("acme")


def _decoded_ns(node_tier, key: bytes) -> bytes:
    return BlockHeader.decode(node_tier.header_sync(key)).namespace.raw


async def seen_namespaces(node: NodeStore, keys: list, spaces) -> list[bytes | None]:
    """Per key the one of ``spaces`` under which the tenant check shows it, None where it
    shows under none of them nor under any namespace at all (absent to every reader)."""
    batch = KeyBatch.of(keys)
    out: list[bytes | None] = [None] * len(keys)
    for ns in set(spaces):
        for i, code in enumerate(await node.lookup(batch, lambda seen, ns=ns: seen == ns)):
            if code:
                assert out[i] is None, f"key {i} seen under two namespaces"
                out[i] = ns
    anyone = await node.lookup(batch, lambda seen: True)
    assert [bool(c) for c in anyone] == [ns is not None for ns in out], "a block under another namespace"
    return out


async def test_dram_and_disk_blocks_report_their_headers_namespace(cfg_factory):
    cfg = cfg_factory(disk__sync=True)
    node = await NodeStore.open(cfg)
    mine, other, tenant = make_blocks(3), make_blocks(2, ns=OTHER, seed=4), make_blocks(2, ns=TENANT, seed=5)
    blocks = mine + other + tenant
    missing = make_blocks(1, seed=99)[0][0].key
    try:
        await node.writer.put(blocks)
        keys = [h.key for h, _ in blocks] + [missing]
        decoded = [_decoded_ns(node.dram, h.key.raw) for h, _ in blocks]
        got = await seen_namespaces(node, keys, decoded)
        assert got == decoded + [None]
        assert len(set(got[:-1])) == 3, "three namespaces, told apart"
    finally:
        await node.close()
    # reopened without DRAM: every block is on disk only, its namespace read at open
    async with checked(await NodeStore.open(cfg_factory(disk__sync=True, dram__capacity=0))) as node:
        assert tiers_of(node, keys) == ["disk"] * len(blocks) + [None]
        assert await seen_namespaces(node, keys, decoded) == decoded + [None]


async def test_deleted_and_leased_then_deleted_blocks_have_no_namespace(node):
    blocks = make_blocks(3)
    await node.writer.put(blocks)
    keys = [h.key for h, _ in blocks]
    [lease] = await node.leaser.lease(keys[:1])
    assert await node.delete(keys[:2]) == [True, True]
    # the leased one is still in DRAM (freed at release) but deleted: no namespace
    spaces = [h.namespace.raw for h, _ in blocks]
    assert await seen_namespaces(node, keys, spaces) == [None, None, spaces[2]]
    node.state.release([lease])
    assert await seen_namespaces(node, keys[:1], spaces) == [None]


async def test_a_namespace_id_freed_by_deletes_serves_the_next_namespace(node):
    a, b = make_blocks(4), make_blocks(4, ns=OTHER, seed=6)
    await node.writer.put(a)
    await node.delete([h.key for h, _ in a])
    await node.writer.put(b)
    spaces = [OTHER.id.raw, a[0][0].namespace.raw]
    assert await seen_namespaces(node, [h.key for h, _ in b], spaces) == [OTHER.id.raw] * 4
    assert await seen_namespaces(node, [h.key for h, _ in a], spaces) == [None] * 4


async def test_corrupt_disk_header_is_dropped_at_open_and_has_no_namespace(cfg_factory):
    cfg = cfg_factory(dram__capacity=0, disk__sync=True)
    node = await NodeStore.open(cfg)
    blocks = make_blocks(3, nbytes=64 * KiB)
    await node.writer.put(blocks)
    await node.close()
    enc = blocks[1][0].encode()
    with open(f"{cfg.disk.path}/data.mdb", "r+b") as f:
        data = f.read()
        off = data.find(enc)
        assert off >= 0, "header not found in the LMDB file"
        f.seek(off)
        f.write(b"\x01")  # the map marker becomes an int: the header no longer parses
    async with checked(await NodeStore.open(cfg)) as node:
        got = await seen_namespaces(node, [h.key for h, _ in blocks], [h.namespace.raw for h, _ in blocks])
        assert got == [blocks[0][0].namespace.raw, None, blocks[2][0].namespace.raw]


def test_namespace_ids_are_counted_and_reused():
    ids = NamespaceIds()
    assert ids.acquire(None) == 0 and ids.get(0) is None
    a = ids.acquire(b"a" * 16)
    assert ids.acquire(b"a" * 16) == a and len(ids) == 1
    b = ids.acquire(b"b" * 16)
    assert b != a and ids.get(b) == b"b" * 16
    ids.release(a)
    assert ids.get(a) == b"a" * 16, "one block still holds it"
    ids.release(a)
    assert ids.get(a) is None and len(ids) == 1
    assert ids.acquire(b"c" * 16) == a, "a freed id is reused"
    assert ids.get(a) == b"c" * 16 and ids.get(b) == b"b" * 16


async def test_lookup_is_contains_filtered_by_namespace(cfg_factory):
    node = await NodeStore.open(cfg_factory())
    mine, other = make_blocks(3, seed=6), make_blocks(2, ns=OTHER, seed=7)
    missing = make_blocks(1, seed=98)[0][0].key
    try:
        await node.writer.put(mine + other)
        keys = KeyBatch.of([h.key for h, _ in mine + other] + [missing])
        mine_ns = mine[0][0].namespace.raw
        assert tier_names(await node.lookup(keys, lambda ns: ns == mine_ns)) == ["dram"] * 3 + [None] * 3
        assert tier_names(await node.lookup(keys, lambda ns: ns is not None)) == tiers_of(node, keys)
        await node.delete([mine[0][0].key])
        assert tier_names(await node.lookup(keys[:1], lambda ns: True)) == [None]
    finally:
        await node.close()


async def test_lookup_is_exact_per_key_over_tiers_namespaces_and_held_deletes(cfg_factory):
    """The bulk probe against the per-key reference (contains, then each block's namespace as
    written, then the tenant check) for every mix of visible namespaces, with blocks on disk only and in DRAM,
    in any key order, and a key deleted while leased (absent to every reader)."""
    old = make_blocks(3, seed=11) + make_blocks(2, ns=OTHER, seed=12) + make_blocks(2, ns=TENANT, seed=13)
    node = await on_disk_only(cfg_factory(disk__sync=True), old)
    new = make_blocks(2, seed=14) + make_blocks(2, ns=OTHER, seed=15)
    missing = [h.key for h, _ in make_blocks(2, seed=97)]
    try:
        await node.writer.put(new)
        order = [h.key for h, _ in new + old] + missing
        order = order[1::2] + order[::2]  # tiers and namespaces interleaved
        keys = KeyBatch.of(order)
        written = {h.key: h.namespace.raw for h, _ in new + old}
        tiers = tiers_of(node, order)
        nss = [written[k] if t is not None else None for k, t in zip(order, tiers)]
        assert {"dram", "disk", None} <= set(tiers), tiers
        spaces = sorted({ns for ns in nss if ns is not None})
        assert len(spaces) == 3
        for accept in ([], spaces[:1], spaces[1:], spaces):
            want = [t if t is not None and ns in accept else None for t, ns in zip(tiers, nss)]
            got = await node.lookup(keys, lambda ns, accept=accept: ns in accept)
            assert len(got) == len(order)
            assert tier_names(got) == want, accept
        held = order[0]
        [lease] = await node.leaser.lease([held])
        assert lease is not None
        await node.delete([held])
        got = tier_names(await node.lookup(keys, lambda ns: True))
        assert got[0] is None and got[1:] == [t for t in tiers[1:]]
        node.state.release([lease])
    finally:
        await node.close()
