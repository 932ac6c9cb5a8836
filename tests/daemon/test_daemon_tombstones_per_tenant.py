"""Tombstones per tenant (issue 34, finding 2), against a real daemon with auth: one tenant
storing and deleting past the cap never pushes out another tenant's tombstone; when a tenant's
own cap (``tombstones.per_tenant``) overflows, the oldest of its own go. A tombstone is seen
through the one thing it does: a peer's repair push of the deleted copy answers DELETED (kept)
or is stored again (gone). Before, tombstones were one global FIFO of 262,144 keys: beta's
262,208 deletes pushed alpha's out and the push of alpha's deleted block was STORED."""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.member.peer_sessions import PEER_TENANT
from kvstore.results import Status

TOK_A, TOK_B, TOK_OP = "tok-tenant-a1", "tok-tenant-b1", "tok-operator-1"
CAP = 128


@pytest.fixture
def daemon(authed_daemon, tmp_path):
    def start():  # again on the same work dir: a restart
        tokens = {TOK_A: "alpha", TOK_B: "beta", TOK_OP: "*"}
        return authed_daemon(tokens, workdir=tmp_path / "node", tombstones={"per_tenant": CAP})

    return start


def client(d, token: str, ns) -> NodeClient:
    return NodeClient(
        d.addr, ClientConfig(token=token, namespaces=(ns,), op_timeout_s=30, probe_interval_s=60)
    )


async def _store_and_delete(c: NodeClient, blocks) -> None:
    for i in range(0, len(blocks), 100):
        part = blocks[i : i + 100]
        assert [r.status for r in await c.put(part)] == [Status.STORED] * len(part)
        assert await c.delete([h.key for h, _ in part]) == [True] * len(part)


def _admin_stats(d) -> dict:
    req = urllib.request.Request(d.admin + "/v1/stats", headers={"Authorization": f"Bearer {TOK_OP}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


async def _pushed(d, blocks) -> list[Status]:
    """A peer's repair push of ``blocks`` (as they were before their delete)."""
    peer = NodeClient(d.addr, ClientConfig(token=TOK_OP, tenant=PEER_TENANT, op_timeout_s=30))
    try:
        return [r.status for r in await peer.put(blocks)]
    finally:
        await peer.close()


async def test_one_tenants_deletes_never_push_out_anothers_tombstone(daemon, ns, blocks_of):
    d = daemon()
    a = client(d, TOK_A, ns)
    b = client(d, TOK_B, ns)
    mine = blocks_of(ns.with_tenant("alpha"), 2, 64, seed=1)
    churn = blocks_of(ns.with_tenant("beta"), CAP + 64, 4, seed=2)
    try:
        await _store_and_delete(a, mine)
        await _store_and_delete(b, churn)
    finally:
        await a.close()
        await b.close()
    assert await _pushed(d, mine) == [Status.DELETED] * 2  # alpha's, past beta's churn
    # beta's own cap overflowed: its 64 oldest went, its newest are kept
    assert await _pushed(d, churn[:64]) == [Status.STORED] * 64
    assert await _pushed(d, churn[-CAP:]) == [Status.DELETED] * CAP
    assert _admin_stats(d)["tombstones"] == {"alpha": 2, "beta": CAP}  # whose, on /v1/stats
    d.stop()
    d = daemon()  # replayed from the side file: whose they are too
    assert await _pushed(d, mine) == [Status.DELETED] * 2
