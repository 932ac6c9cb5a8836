"""32 concurrent clients x 1,000 mixed ops against one daemon, every byte verified."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvstore.block import make_header
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Status

CLIENTS = 32
OPS = 1000


async def _client(i: int, addr: str, ns, blocks_of, shared) -> dict:
    rng = random.Random(i)
    c = NodeClient(addr, ClientConfig(namespaces=(ns,), pool_size=1, op_timeout_s=30))
    mine = {}  # key -> payload, for blocks this client stored and did not delete
    gone = set()
    pool = iter(blocks_of(ns, 4 * OPS, 256, seed=1000 + i))  # headers only; payloads resized below
    seen_shared = set()
    stats = {"hits": 0, "ops": 0}

    def fresh(n):
        out = []
        for h, _ in (next(pool) for _ in range(n)):
            size = rng.randrange(256, 8192)
            payload = rng.randbytes(size)
            out.append(
                (
                    make_header(
                        key=h.key,
                        parent=h.parent,
                        namespace=h.namespace,
                        tokens=h.token_bytes,
                        dtype="uint8",
                        shape=[size],
                        payload=payload,
                    ),
                    payload,
                )
            )
        return out

    for _ in range(OPS):
        stats["ops"] += 1
        r = rng.random()
        if r < 0.30 or not mine:
            blocks = fresh(rng.randint(1, 4))
            res = await c.put(blocks)
            assert [x.status for x in res] == [Status.STORED] * len(blocks), res
            mine.update((h.key, p) for h, p in blocks)
        elif r < 0.60:
            keys = rng.sample(sorted(mine, key=lambda k: k.raw), min(len(mine), rng.randint(1, 6)))
            keys += rng.sample(sorted(gone, key=lambda k: k.raw), min(len(gone), 1))
            bufs = [bytearray(8192) for _ in keys]
            got = await get_into(c, keys, bufs)
            for k, g, b in zip(keys, got, bufs):
                if k in mine:
                    assert g.status is Status.HIT, (k, g)
                    assert bytes(b[: len(mine[k])]) == mine[k]
                    stats["hits"] += 1
                else:
                    assert g.status is Status.MISS
        elif r < 0.70:
            keys = list(mine)[-3:] + list(gone)[-2:]
            tiers = (await c.lookup(keys)).names()
            assert [t is not None for t in tiers] == [k in mine for k in keys]
        elif r < 0.78:
            k = rng.choice(sorted(mine, key=lambda k: k.raw))
            assert await c.delete([k]) == [True]
            del mine[k]
            gone.add(k)
        else:
            j = rng.randrange(len(shared))
            h, p = shared[j]
            if j not in seen_shared:
                (res,) = await c.put([(h, p)])
                assert res.status in (Status.STORED, Status.EXISTS)
                seen_shared.add(j)
            buf = bytearray(len(p))
            (g,) = await get_into(c, [h.key], [buf], None)
            assert g.status is Status.HIT and bytes(buf) == p
    assert c.counters["errors"] == 0 and c.counters["timeouts"] == 0
    await c.close()
    return stats


@pytest.mark.heavy
async def test_32_clients_1000_mixed_ops(start_daemon, ns, blocks_of):
    d = start_daemon(dram={"capacity": "128MiB", "slab_size": "1MiB"}, disk={"capacity": "1GiB"})
    shared = blocks_of(ns, 40, 4000, seed=99999)
    results = await asyncio.gather(*(_client(i, d.addr, ns, blocks_of, shared) for i in range(CLIENTS)))
    assert sum(r["ops"] for r in results) == CLIENTS * OPS
    assert sum(r["hits"] for r in results) > CLIENTS * OPS // 2
    assert d.proc.poll() is None
