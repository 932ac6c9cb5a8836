"""Health judged on the data path: a node slowed by a token bucket (``tc tbf rate 2mbit burst
16kb``, the issue's setting) is ejected and stays out, although a small probe fits in the
bucket's burst; reads are served by the other replica meanwhile."""

from __future__ import annotations

import time

import pytest
from cluster.cluster_hosts import TENANT_NS
from storeutil import make_blocks

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.read import get_into
from kvstore.results import Status

pytestmark = pytest.mark.heavy
NBYTES = 32 * 1024


async def test_cluster_slow_node_behind_a_token_bucket_stays_out_and_replicas_serve(hosts):
    ds = [hosts.start_node() for _ in range(3)]
    deadline = 1.0
    c = ClusterClient.static(
        [d.addr for d in ds],
        hosts.client_cfg(op_timeout_s=deadline),
        ClusterConfig(replicas=2, probe_interval_s=0.1),
    )
    await c.start(5.0)
    prompts = [make_blocks(8, NBYTES, seed=900 + i, ns=TENANT_NS) for i in range(10)]
    for p in prompts:
        assert [r.status.ok for r in await c.put(p, 5.0)] == [True] * len(p)
    slow = ds[1]
    hosts.net.shape(slow.host, "2mbit", "16kb")
    out, misses, t_end = [], 0, time.monotonic() + 8.0
    while time.monotonic() < t_end:
        for p in prompts:
            keys = [h.key for h, _ in p]
            n = (await c.lookup(keys, deadline)).hit_blocks
            bufs = [bytearray(NBYTES) for _ in keys]
            res = await get_into(c, keys, bufs, None, deadline)
            misses += (n != len(keys)) + sum(r.status is not Status.HIT for r in res)
            assert len(res) == len(p) and all(
                bytes(b) == x for r, b, (_, x) in zip(res, bufs, p) if r.status is Status.HIT
            )
            # out of the read path: ejected, or weighted down for silence (reads ask its
            # co-owner first; such a node may never be asked again, so never be ejected)
            out.append(slow.addr not in c.live_addrs() or c.health.quiet(slow.addr))
    seen = f"{len(out)} requests, misses {misses}, health counters {dict(c.health.counters)}"
    assert True in out, f"the slow node was never taken out of the read path: {seen}"
    first = out.index(True)
    kept_out = sum(out[first:]) / len(out[first:])
    print(f"{len(out)} requests; out after {first}; out {kept_out:.3f} of the rest; {seen}")
    # a weighted-down node whose confirm answered is lifted once, then ejected by its next late
    # read: a request or two back in the path, never a readmission
    assert kept_out >= 0.9, f"the slow node was let back in: out {kept_out:.3f} of the rest; {seen}"
    assert c.counters["marked_up"] == 0, seen
    assert misses <= 2, misses  # only the request that found it slow may miss, then replicas serve
    hosts.net.heal(slow.host)
    await c.close()


async def test_a_node_failure_readmits_a_node_that_was_out_only_for_being_slow(hosts):
    """An outlier ejection is a preference, a failure is a loss: with one node out for
    slowness (on a busy 2-core machine a few ms of scheduling noise can do it) and another
    killed, the blocks those two held must still be read from the slow one. Before the fix a
    third of the blocks (owners = the two nodes) missed until the slow node's backoff ended."""
    ds = [hosts.start_node() for _ in range(3)]
    c = ClusterClient.static(
        [d.addr for d in ds], hosts.client_cfg(op_timeout_s=1.0), ClusterConfig(replicas=2)
    )
    await c.start(5.0)
    prompts = [make_blocks(4, NBYTES, seed=700 + i, ns=TENANT_NS) for i in range(30)]
    for p in prompts:
        assert [r.status.ok for r in await c.put(p, 5.0)] == [True] * len(p)
    c.health.eject(ds[0].addr, "outlier")
    assert ds[0].addr not in c.live_addrs()
    ds[1].kill9()

    async def read_all() -> int:
        missing = 0
        for p in prompts:
            keys = [h.key for h, _ in p]
            n = (await c.lookup(keys, 1.0)).hit_blocks
            bufs = [bytearray(NBYTES) for _ in keys]
            res = await get_into(c, keys[:n], bufs[:n], None, 1.0)
            missing += len(keys) - sum(r.status is Status.HIT for r in res)
            assert len(res) == n and all(
                bytes(b) == x for r, b, (_, x) in zip(res, bufs, p) if r.status is Status.HIT
            )
        return missing

    await read_all()  # finds the dead node
    assert ds[1].addr not in c.live_addrs()
    assert ds[0].addr in c.live_addrs()
    assert await read_all() == 0
    assert c.counters["readmitted_on_failure"] == 1
    await c.close()
