"""One PUT over the wire whose blocks end every way a block can: stored, EXISTS (the tenant's
own), BUSY (another tenant's key; the same key twice in one request), INVALID (a key the
tenant cannot derive; bytes that do not match the checksum). Each status lands at its
block's position, the bytes of the refused blocks in between are skipped, and what is stored
reads back byte for byte."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from daemonutil import RawPeer

from kvstore.block import make_header
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Status

TOKENS = "tok-acme-0001 acme\ntok-globex-01 globex\n"


@pytest.fixture
def authed(start_daemon, tmp_path):
    f = tmp_path / "tokens.txt"
    f.write_text(TOKENS)
    return start_daemon(auth={"token_file": str(f)})


def _client(d, ns, token) -> NodeClient:
    return NodeClient(
        d.addr, ClientConfig(token=token, namespaces=(ns,), op_timeout_s=5, probe_interval_s=60)
    )


async def test_every_status_of_one_put_lands_at_its_block(authed, ns, blocks_of):
    acme, globex = _client(authed, ns, "tok-acme-0001"), _client(authed, ns, "tok-globex-01")
    try:
        mine = blocks_of(ns.with_tenant("acme"), 8, 4096, seed=1)
        theirs = blocks_of(ns.with_tenant("globex"), 2, 4096, seed=2)
        assert [r.status for r in await acme.put(mine[:2])] == [Status.STORED] * 2
        assert [r.status for r in await globex.put(theirs)] == [Status.STORED] * 2
        (th, tp), (th1, tp1) = theirs
        # globex's second key, derived from its first key and tokens (what an on-path observer
        # has) in acme's namespace: acme may write it, and it is stored as globex's
        acme_ns = ns.with_tenant("acme")
        assert acme_ns.next_key(th.key, th1.tokens) == th1.key
        derived = make_header(
            key=th1.key, parent=th.key, namespace=acme_ns.id, tokens=list(th1.tokens),
            dtype="uint8", shape=[len(tp1)], payload=tp1,
        )  # fmt: skip
        # globex's block under acme's namespace and globex's key: acme cannot derive it
        stolen = make_header(
            key=th.key, parent=mine[1][0].key, namespace=mine[1][0].namespace, tokens=list(th.tokens),
            dtype="uint8", shape=[len(tp)], payload=tp,
        )  # fmt: skip
        (bh, bp) = mine[5]
        bad = dataclasses.replace(bh, checksum=(bh.checksum + 1) % (1 << 64))  # bytes do not match
        batch = [
            mine[2],  # STORED
            mine[0],  # EXISTS: acme's own
            (stolen, tp),  # INVALID: not a key acme derives (auth on)
            mine[3],  # STORED
            mine[3],  # BUSY: the same key again in this request
            (derived, tp1),  # BUSY: another tenant's key, never EXISTS
            (bad, bp),  # INVALID: checksum
            mine[4],  # STORED
        ]
        want = [Status.STORED, Status.EXISTS, Status.INVALID, Status.STORED, Status.BUSY, Status.BUSY]
        want += [Status.INVALID, Status.STORED]
        p = RawPeer(authed.data_port)
        p.hello("tok-acme-0001", ns)
        p.request({"op": "PUT", "hdrs": [h.encode() for h, _ in batch]}, plen=sum(len(x) for _, x in batch))
        for _, payload in batch:
            p.send(payload)
        got = p.reply()["st"]
        assert [Status(s) for s in got] == want, got
        p.close()
        stored = [mine[i] for i in (0, 1, 2, 3, 4)]
        bufs = [np.zeros(4096, np.uint8) for _ in stored]
        res = await get_into(acme, [h.key for h, _ in stored], bufs)
        assert [r.status for r in res] == [Status.HIT] * 5
        assert all(bytes(b) == x for b, (_, x) in zip(bufs, stored))
        assert (await acme.lookup([mine[5][0].key])).names() == [None]  # its bytes did not match
        # globex's blocks are untouched by acme's refused writes
        tbs = [np.zeros(4096, np.uint8) for _ in theirs]
        res = await get_into(globex, [th.key, th1.key], tbs)
        assert [r.status for r in res] == [Status.HIT] * 2
        assert bytes(tbs[0]) == tp and bytes(tbs[1]) == tp1
    finally:
        await acme.close()
        await globex.close()
