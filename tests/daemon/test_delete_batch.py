"""DELETE takes as many keys as EXISTS, and a key repeated in one DELETE is answered once
(issue 34, smaller findings), against a real daemon. Before: DELETE refused more than 4,096
keys while docs/protocol.md says "exactly as EXISTS" (16,384), and ``[k, k]`` answered
``[1, 1]``."""

from __future__ import annotations

import os

from daemonutil import RawPeer

from kvstore import protocol as P
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.results import Status


async def test_delete_takes_exists_many_keys_and_answers_a_repeated_key_once(start_daemon, ns, blocks_of):
    d = start_daemon()  # DRAM and disk: a key's disk copy goes after the batch's memory ones
    c = NodeClient(d.addr, ClientConfig(namespaces=(ns,), op_timeout_s=30, probe_interval_s=60))
    blocks = blocks_of(ns, 2, 1024, seed=5)
    assert [r.status for r in await c.put(blocks)] == [Status.STORED] * 2
    (h1, _), (h2, _) = blocks
    p = RawPeer(d.data_port)
    p.hello("", ns)
    for n in (P.MAX_EXISTS_KEYS, P.MAX_EXISTS_KEYS + 1):
        p.request({"op": "EXISTS", "keys": os.urandom(16 * n)})
        exists = p.reply()
        p.request({"op": "DELETE", "keys": os.urandom(16 * n)})
        delete = p.reply()
        assert exists.get("ok") == delete.get("ok") == (n == P.MAX_EXISTS_KEYS), (n, exists, delete)
        if not delete.get("ok"):
            assert delete["code"] == exists["code"] == P.BAD_REQUEST
    p.request({"op": "DELETE", "keys": h1.key.raw * 2 + h2.key.raw + h1.key.raw})
    assert p.reply()["res"] == bytes([1, 0, 1, 0])
    assert (await c.lookup([h1.key, h2.key])).names() == [None, None]
    p.close()
    await c.close()
