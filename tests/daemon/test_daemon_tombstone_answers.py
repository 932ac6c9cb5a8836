"""A node's answer to another node's repair push of a key it deleted (protocol 3, issue 33):
DELETED -- its own status, never MISS -- and only for a copy written before the delete. A copy
written after it (the key stored again where the delete did not reach) is taken, and that
write ends the tombstone. A tenant's session never sees DELETED."""

from __future__ import annotations

import dataclasses
import time

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.member.peer_sessions import PEER_TENANT
from kvstore.results import Status


async def test_a_peer_push_of_a_deleted_key_answers_deleted_only_for_a_copy_older_than_the_delete(
    start_daemon, ns, blocks_of
):
    d = start_daemon(use_disk=False)
    blocks = blocks_of(ns, 3, 256, seed=7)
    keys = [h.key for h, _ in blocks]
    tenant = NodeClient(d.addr, ClientConfig(namespaces=(ns,), op_timeout_s=5.0))
    peer = NodeClient(d.addr, ClientConfig(tenant=PEER_TENANT, op_timeout_s=5.0))
    try:
        assert all(r.status is Status.STORED for r in await tenant.put(blocks))
        assert await tenant.delete(keys) == [True] * 3
        after = time.time() + 1.0  # a copy written after the delete (clocks a second apart)
        newer = (dataclasses.replace(blocks[1][0], created=after), blocks[1][1])
        got = await peer.put([blocks[0], newer, blocks[2]])
        assert [r.status for r in got] == [Status.DELETED, Status.STORED, Status.DELETED]
        assert peer.up and peer.counters["errors"] == 0
        assert (await tenant.lookup(keys)).names() == [None, "dram", None]
        # the write ended that key's tombstone: the old copy is taken now too
        assert (await peer.put([blocks[1]]))[0].status is Status.EXISTS
        # a tenant writing a deleted key stores it (and revives it): never DELETED
        assert [r.status for r in await tenant.put([blocks[0]])] == [Status.STORED]
        assert [r.status for r in await peer.put([blocks[0]])] == [Status.EXISTS]
    finally:
        await tenant.close()
        await peer.close()
