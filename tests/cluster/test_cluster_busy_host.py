"""A busy cluster is not a broken one (issue 23): the loaded-host case made deterministic.

Nothing fails. The client's own event loop is blocked for 40 ms every 100 ms and for 0.25 s
(past the lookup deadline) every second (what engine steps or a descheduled process do on a
loaded host; the issue measured a loop-lag p99 of 34 ms), and one of three daemons answers a
few milliseconds late (a SlowProxy in front of it). Under three concurrent request streams of
writes (2 copies wanted), lookups under the connector's short lookup deadline and reads, the
healthy view must never drop below ``replicas``, writes must keep their 2 copies and the hit
rate must stay at 0.99 or better. Before the fix, lookups past their deadline marked nodes
down and hedged reads ejected them at once with no floor: the view fell to 0-1 nodes, 42 % and
0.7 % of writes kept 2 copies, hit rate 0.42 and 0.007 (two runs).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from cluster.slowproxy import SlowProxy
from storeutil import make_blocks, read_back

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.keys import Namespace

pytestmark = pytest.mark.heavy
NS = Namespace("busy-host", "uint8", 4)
NBYTES = 32 * 1024
BLOCKS = 8
RUN_S = 15.0
LOOKUP_DEADLINE_S = 0.2  # the connector's lookup deadline
LONG_BLOCK_S = 0.25
WORKERS = 3  # concurrent request streams, as an engine has


async def block_the_loop(stop: asyncio.Event, block_s: float = 0.04, every_s: float = 0.1) -> int:
    """Block the event loop (a synchronous sleep) for ``block_s`` every ``every_s``, and every
    10th time for ``LONG_BLOCK_S`` (longer than a lookup's deadline)."""
    n = 0
    while not stop.is_set():
        await asyncio.sleep(every_s - block_s)
        time.sleep(LONG_BLOCK_S if n % 10 == 9 else block_s)  # noqa: ASYNC251 -- the point
        n += 1
    return n


async def sample_view(c: ClusterClient, stop: asyncio.Event, out: list[list[str]]) -> None:
    while not stop.is_set():
        out.append(c.live_addrs())
        await asyncio.sleep(0.02)


class Tally:
    def __init__(self) -> None:
        self.copies: list[int] = []
        self.hits = self.wanted = self.wrong = 0


async def worker(c: ClusterClient, w: int, t_end: float, tally: Tally) -> None:
    """An engine's request stream: store a prompt, then look up and read it and two older ones."""
    stored: list = []
    seed = 0
    while time.monotonic() < t_end:
        seed += 1
        prompt = make_blocks(BLOCKS, NBYTES, seed=100_000 * (w + 1) + seed, ns=NS)
        rep = await c.put(prompt, 1.0)
        tally.copies += rep.copies
        stored.append(prompt)
        for p in (stored[-1], stored[seed // 2], stored[seed // 3]):
            hits, wrong = await read_back(c, p, LOOKUP_DEADLINE_S, 1.0)
            tally.hits += hits
            tally.wrong += wrong
            tally.wanted += len(p)


async def test_busy_client_loop_and_a_slightly_slow_node_keep_the_view_writes_and_hits(start_daemon):
    # room for everything the run writes (~6,000 blocks x 2 copies on a fast run): a block
    # evicted for capacity would be a miss that says nothing about health
    ds = [start_daemon(use_disk=False, dram={"capacity": "512MiB"}) for _ in range(3)]
    proxy = await SlowProxy(ds[2].addr, reply_delay_s=0.004).start()
    addrs = [ds[0].addr, ds[1].addr, proxy.addr]
    cfg = ClientConfig(namespaces=(NS,), op_timeout_s=2.0, connect_timeout_s=1.0, probe_interval_s=0.1)
    c = ClusterClient.static(addrs, cfg, ClusterConfig(replicas=2))
    await c.start(5.0)
    stop = asyncio.Event()
    views: list[list[str]] = []
    blocker = asyncio.create_task(block_the_loop(stop))
    sampler = asyncio.create_task(sample_view(c, stop, views))
    tally = Tally()
    t_end = time.monotonic() + RUN_S
    await asyncio.gather(*(worker(c, w, t_end, tally) for w in range(WORKERS)))
    stop.set()
    blocks = await blocker
    await sampler
    counters = c.counters
    time_out = c.time_out()
    await c.close()
    await proxy.close()
    copies, hits, wanted = tally.copies, tally.hits, tally.wanted
    full = sum(1 for x in copies if x >= 2) / len(copies)
    smallest = min(len(v) for v in views)
    print(
        f"loop blocked {blocks} times; {len(copies)} blocks written, {full:.4f} with 2 copies; "
        f"hit rate {hits / wanted:.4f}; smallest view {smallest}; seconds out of the view {time_out}"
    )
    print(dict(counters))
    assert blocks > RUN_S / 0.2 and len(views) > 100 and len(copies) > 100
    assert tally.wrong == 0
    assert smallest >= 2, f"the healthy view fell to {smallest} node(s)"
    assert full >= 0.99, f"only {full:.4f} of the writes got 2 copies"
    assert hits / wanted >= 0.99, f"hit rate {hits / wanted:.4f}"
