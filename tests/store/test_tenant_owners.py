"""A namespace's bytes count under its tenant once a HELLO claims it (issue 34): blocks stored
before the claim (found on disk at start, or copied in by a peer) move to the tenant's sum in
every tier, and the cap forgets only namespaces no connection declares and no tier holds."""

from __future__ import annotations

import pytest
from storeutil import checked, make_blocks, make_cfg

from kvstore.keys import Namespace
from kvstore.node.store import NodeStore
from kvstore.node.tiers.owners import NamespaceCapError


async def test_blocks_stored_before_the_claim_count_under_the_tenant(tmp_path):
    async with checked(await NodeStore.open(make_cfg(tmp_path, limits__max_namespaces_per_tenant=2))) as node:
        a, b = (Namespace(f"m{i}", "uint8", 4).with_tenant("alpha") for i in range(2))
        blocks = make_blocks(3, 1024, ns=a, seed=1) + make_blocks(2, 1024, ns=b, seed=2)
        await node.writer.put(blocks)
        dram, disk = node.dram, node.disk
        a_bytes = dram.owner_usage(a.id.raw)
        assert a_bytes > 3 * 1024 and dram.owner_usage("alpha") == 0  # unclaimed: its own owner
        node.owners.claim("alpha", [a.id.raw, b.id.raw])
        stats = node.inspector.stats()["tiers"]
        for t in (dram, disk):
            assert t.owner_usage(a.id.raw) == t.owner_usage(b.id.raw) == 0
            by_ns = stats[t.name]["namespaces"]
            assert (
                t.owner_usage("alpha")
                == by_ns[a.id.hex] + by_ns[b.id.hex]
                == stats[t.name]["tenants"]["alpha"]
            )
        c = Namespace("m2", "uint8", 4).with_tenant("alpha")
        with pytest.raises(NamespaceCapError, match="max_namespaces_per_tenant"):
            node.owners.claim("alpha", [c.id.raw])  # both held by blocks (and declared)
        node.owners.release([a.id.raw, b.id.raw])
        with pytest.raises(NamespaceCapError):
            node.owners.claim("alpha", [c.id.raw])  # no longer declared, but still holding blocks
        await node.delete([h.key for h, _ in blocks[3:]])
        node.owners.claim("alpha", [c.id.raw])  # b's blocks are gone: it no longer counts
        assert node.owners.held("alpha") == 2
