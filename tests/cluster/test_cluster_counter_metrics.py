"""A cluster client's counters reach Prometheus (the connector registers the collector, so the
engine's /metrics shows health's ejections and under-replicated writes): real daemons, one
killed so that a write is under-replicated; with two nodes and replicas 2 the floor keeps the
dead one in the view (skipped while its client is down, never ejected: docs/cluster.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from scraping import Scrape
from storeutil import make_blocks

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.client.counter_metrics import CountersCollector
from kvstore.keys import Namespace

NS = Namespace("counter-metrics", "uint8", 4)
FAST = ClientConfig(namespaces=(NS,), op_timeout_s=2.0, connect_timeout_s=0.5, probe_interval_s=0.1)


async def test_ejections_and_under_replicated_writes_show_as_prometheus_counters(start_daemon):
    ds = [start_daemon(use_disk=False) for _ in range(2)]
    c = ClusterClient.static([d.addr for d in ds], FAST, ClusterConfig(replicas=2))
    await c.start(2.0)
    reg = CollectorRegistry()
    reg.register(CountersCollector(lambda: c.counters))
    ds[1].kill9()
    r = await c.put(make_blocks(4, 4096, seed=3, ns=NS), 2.0)
    r = await c.put(make_blocks(4, 4096, seed=4, ns=NS), 2.0)
    assert r.under_replicated == 4 and r.dropped == 0
    m = Scrape(generate_latest(reg).decode())
    await c.close()
    assert m.value("tierkv_store_client_kept_for_floor_down_total") >= 1
    assert not m.has("tierkv_store_client_ejected_down_total")
    assert m.value("tierkv_store_client_blocks_under_replicated_total") == 8
    assert m.value("tierkv_store_client_puts_under_replicated_total") == 2
