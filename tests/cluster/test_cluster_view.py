"""The client's view never collapses (issue 33, findings 4 and 5): a stalled node is silence,
not a failure. Every ejection health decides keeps at least max(replicas, majority) nodes in
the view, a node that answers nothing is weighted down before it is ejected, and a busy
host's slowness ejections never double the readmission back-off."""

from __future__ import annotations

import logging
import re
import signal

from polling import until_async
from storeutil import make_blocks

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace

NS = Namespace("view-floor", "uint8", 4)
CFG = ClientConfig(namespaces=(NS,), op_timeout_s=2.0, connect_timeout_s=1.0, probe_interval_s=0.1)
LOOKUP_S = 0.2  # the connector's lookup deadline


async def _cluster(start_daemon, **cluster) -> tuple[list, ClusterClient]:
    ds = [start_daemon(use_disk=False) for _ in range(3)]
    c = ClusterClient.static([d.addr for d in ds], CFG, ClusterConfig(replicas=2, **cluster))
    await c.start(5.0)
    return ds, c


async def _store(c: ClusterClient, n: int, seed: int) -> list:
    prompts = [make_blocks(4, 4096, seed=seed + i, ns=NS) for i in range(n)]
    for p in prompts:
        r = await c.put(p, 5.0)
        assert r.copies == [2] * len(p), r
    return prompts


async def _found(c: ClusterClient, prompts) -> int:
    return sum([(await c.lookup([h.key for h, _ in p], 1.0)).hit_blocks for p in prompts])


async def _answers(addr: str) -> bool:
    n = NodeClient(addr, CFG)
    try:
        return await n.stats(0.5) is not None
    finally:
        await n.close()


async def test_two_stalled_nodes_stay_in_the_view_and_serve_once_they_resume(start_daemon):
    """Two of three nodes stopped (SIGSTOP: connections up, nothing answers). Lookups under
    the connector's deadline keep asking them; before, each confirm that got no answer ejected
    its node with no floor, the view fell to the one node that holds a third of the blocks and
    the stalled ones stayed out for their back-off after they resumed."""
    ds, c = await _cluster(start_daemon, eject_base_s=600.0, eject_max_s=600.0, confirm_timeout_s=0.3)
    try:
        prompts = await _store(c, 16, seed=100)
        total = sum(len(p) for p in prompts)
        assert await _found(c, prompts) == total
        stalled = ds[:2]
        for d in stalled:
            d.signal(signal.SIGSTOP)
        views: list[int] = []

        async def lookups_until_judged() -> int:
            for p in prompts:
                await c.lookup([h.key for h, _ in p], LOOKUP_S)
                views.append(len(c.live_addrs()))
            kept = sum(n for k, n in c.health.counters.items() if k.startswith("kept_for_floor_"))
            return kept >= 1 or len(c.live_addrs()) < 2

        try:
            # one stalled node ejected, an ejection of the other refused for the floor (before:
            # both ejected, the view down to one node)
            await until_async(lookups_until_judged, 60.0, "the floor to hold off an ejection")
        finally:
            for d in stalled:
                d.signal(signal.SIGCONT)
        floor = c.health.view_floor()
        assert floor == 2 and min(views) >= floor, f"the view fell under its floor: {sorted(set(views))}"
        ejected = sum(n for k, n in c.health.counters.items() if k.startswith("ejected_"))
        assert ejected <= 3 - floor, dict(c.health.counters)
        assert len(c.live_addrs()) >= floor
        for d in stalled:
            await until_async(lambda d=d: _answers(d.addr), 30.0, f"{d.addr} to answer after SIGCONT")
        # no readmission can happen here (a 600 s back-off): the view that held them serves
        assert await until_async(
            lambda: _found(c, prompts), 10.0, "every block found", ok=lambda n: n == total
        )
    finally:
        for d in ds:
            d.signal(signal.SIGCONT)
        await c.close()


async def test_a_silent_node_is_weighted_down_before_it_is_ejected(start_daemon):
    """One node stopped: its first missed deadline lowers its weight (still in the view); an
    unanswered confirm or its window then ejects it (the floor allows one out of three)."""
    ds, c = await _cluster(start_daemon, eject_base_s=600.0, eject_max_s=600.0, confirm_timeout_s=0.3)
    stalled = ds[0]
    try:
        prompts = await _store(c, 8, seed=200)
        stalled.signal(signal.SIGSTOP)
        seen_quiet_in_view = False

        async def step() -> bool:
            nonlocal seen_quiet_in_view
            for p in prompts:
                await c.lookup([h.key for h, _ in p], LOOKUP_S)
                if c.health.quiet(stalled.addr) and stalled.addr in c.live_addrs():
                    seen_quiet_in_view = True
                    assert c.health.weight(stalled.addr) < 0.5
            return stalled.addr not in c.live_addrs()

        await until_async(step, 60.0, "the stalled node ejected")
        assert c.health.counters["weighted_down_unresponsive"] >= 1
        assert seen_quiet_in_view, f"ejected without being weighted down first: {dict(c.health.counters)}"
        assert stalled.addr not in c.live_addrs()
    finally:
        stalled.signal(signal.SIGCONT)
        await c.close()


def _last_out_s(caplog) -> float:
    """The back-off of the last ejection, as its log line tells the operator (``out_s=``)."""
    lines = [r.getMessage() for r in caplog.records if "event=cluster_node_out" in r.getMessage()]
    return float(re.search(r"out_s=([0-9.]+)", lines[-1]).group(1))


async def test_slowness_ejections_never_double_the_back_off(start_daemon, caplog):
    """A busy host makes every node an outlier now and then: each such ejection keeps the
    node out for ``eject_base_s``, however often it happens (before: 1, 2, 4, 8 ... s)."""
    caplog.set_level(logging.INFO, logger="kvstore.client")
    ds, c = await _cluster(start_daemon, eject_base_s=5.0, eject_max_s=60.0, probe_interval_s=0.05)
    a = ds[0].addr
    try:
        outs = []
        for why in ("outlier", "late", "outlier", "late"):
            c.health.eject(a, why)
            outs.append(_last_out_s(caplog))
            c.health._readmit(a, "test")  # noqa: SLF001 -- readmit at once, as a passing probe would
        assert outs == [5.0] * 4, outs
        c.health.eject(a, "unresponsive")
        c.health._readmit(a, "test")  # noqa: SLF001
        c.health.eject(a, "unresponsive")
        assert _last_out_s(caplog) == 10.0, "failures still back off"
    finally:
        await c.close()
