"""A write past its deadline is lateness, not a failure (issue 18: on a loaded host one late
PUT marked the only node of a ``kvstore://one-node`` URL down, and the whole flush after it
found no node to write to). A proxy in front of a real daemon makes one PUT late
(tests/cluster/slowproxy.py); a real connection failure still takes the node out."""

from __future__ import annotations

import pytest
from cluster.slowproxy import SlowProxy
from storeutil import make_blocks

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.client.read import get_into
from kvstore.keys import Namespace
from kvstore.results import Status

NS = Namespace("cluster-test", "uint8", 4)
CFG = ClientConfig(
    namespaces=(NS,), op_timeout_s=5.0, probe_interval_s=0.1, streams=1
)  # one stripe: one late call
# a chunk's write deadline is write_floor_s whatever its size: a slow link misses it, a small
# write on a loaded host does not
LATE = ClusterConfig(replicas=1, write_floor_s=1.0, write_min_bytes_per_s=1e12)


@pytest.fixture
async def proxied(start_daemon):
    d = start_daemon(use_disk=False)
    p = await SlowProxy(d.addr).start()
    yield d, p
    await p.close()


async def test_one_late_put_leaves_the_node_in_use_for_the_writes_and_reads_after_it(proxied):
    _, p = proxied
    c = ClusterClient.static([p.addr], CFG, LATE)
    await c.start(5.0)
    before = make_blocks(4, 4096, seed=11, ns=NS)
    assert (await c.put(before, 5.0)).stored == 4
    p.rate = 1e6  # 1 MB/s: a 4 MiB chunk takes 4 s, four times its deadline
    late = await c.put(make_blocks(16, 256 * 1024, seed=12, ns=NS), 5.0)
    assert late.dropped == 16 and {r.status for r in late.results} == {Status.TIMEOUT}, late
    p.rate = 0.0  # the host is quick again
    after = make_blocks(4, 4096, seed=13, ns=NS)
    report = await c.put(after, 5.0)
    assert (report.stored, report.dropped) == (4, 0), report
    bufs = [bytearray(4096) for _ in before + after]
    res = await get_into(c, [h.key for h, _ in before + after], bufs, None, 5.0)
    assert [r.status for r in res] == [Status.HIT] * 8
    assert [bytes(b) for b in bufs] == [bytes(pl) for _, pl in before + after]
    assert c.live_addrs() == [p.addr] and c.counters["node_down"] == 0
    assert c.health.counters["write_timeouts"] == 1  # the late chunk, judged by health
    await c.close()


async def test_a_closed_connection_still_takes_the_node_out(proxied):
    d, p = proxied
    c = ClusterClient.static([p.addr], CFG, LATE)
    await c.start(5.0)
    assert (await c.put(make_blocks(2, 4096, seed=14, ns=NS), 5.0)).stored == 2
    d.kill9()
    report = await c.put(make_blocks(2, 4096, seed=15, ns=NS), 5.0)
    assert report.dropped == 2, report
    assert c.live_addrs() == [] and c.counters["node_down"] == 1
    await c.close()
