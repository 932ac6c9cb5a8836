"""The daemon's Prometheus metrics (names prefixed ``tierkv_``), in a registry per daemon.

Counters are bumped on the event loop thread by the data and admin servers. Tier usage is
read from ``node.inspector.stats()`` at scrape time by a collector, so it is never stale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


# per tier: the stats field, and the family it is exported as
_TIER_FAMILIES = (
    (
        "used_bytes",
        GaugeMetricFamily,
        "tierkv_tier_bytes",
        "Bytes a tier holds for its blocks (slots or file records)",
    ),
    (
        "payload_bytes",
        GaugeMetricFamily,
        "tierkv_tier_payload_bytes",
        "Payload bytes of the blocks stored per tier",
    ),
    (
        "waste_bytes",
        GaugeMetricFamily,
        "tierkv_tier_waste_bytes",
        "Memory a tier holds but no payload fills (slot tails, free slots of used spans)",
    ),
    ("file_bytes", GaugeMetricFamily, "tierkv_tier_file_bytes", "Size of the tier's file on disk (LMDB)"),
    ("capacity_bytes", GaugeMetricFamily, "tierkv_tier_capacity_bytes", "Configured capacity per tier"),
    ("blocks", GaugeMetricFamily, "tierkv_tier_blocks", "Blocks stored per tier"),
    ("evictions", CounterMetricFamily, "tierkv_tier_evictions", "Blocks evicted per tier"),
)


class _TierCollector:
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self):
        try:
            stats = self._stats()
            tiers, node = stats.get("tiers", {}), stats.get("node", {})
        except Exception:  # a scrape must never fail because the node is closing
            tiers, node = {}, {}
        fams = {field: kind(name, doc, labels=["tier"]) for field, kind, name, doc in _TIER_FAMILIES}
        for name, t in tiers.items():
            for field, fam in fams.items():
                v = t.get(field)
                if isinstance(v, (int, float)):
                    fam.add_metric([name], v)
        yield from fams.values()
        yield from _eviction_families(tiers, node)


def _eviction_families(tiers: dict, node: dict):
    """Eviction and admission per tier (docs/storage.md "Eviction"): hit tokens, evictions by
    reason, admission refusals, orphaned bytes, and bytes per namespace (tenant shares)."""
    hit_tokens = CounterMetricFamily(
        "tierkv_hit_tokens", "Tokens of the blocks read (headers' token counts) per tier", labels=["tier"]
    )
    by_reason = CounterMetricFamily(
        "tierkv_tier_evictions_by_reason",
        "Blocks evicted per tier and reason (write: room for a write; promotion: room for a disk "
        "block moving up; map_full: the LMDB map, not capacity, was full; orphan: no parent in "
        "the cluster, found by the orphan pass)",
        labels=["tier", "reason"],
    )
    refused = CounterMetricFamily(
        "tierkv_admission_rejections",
        "Blocks refused room per tier (share: kept for another namespace's share; no_room: "
        "nothing evictable)",
        labels=["tier", "why"],
    )
    orphans = GaugeMetricFamily(
        "tierkv_tier_orphan_bytes",
        "Bytes of blocks stored while their parent had been evicted from the same tier",
        labels=["tier"],
    )
    ns_bytes = GaugeMetricFamily(
        "tierkv_tier_namespace_bytes",
        "Bytes per tier of its largest namespaces (a tenant's salt is in each id); the rest "
        'summed as namespace="other"',
        labels=["tier", "namespace"],
    )
    tenant_bytes = GaugeMetricFamily(
        "tierkv_tier_tenant_bytes",
        "Bytes per tier and tenant, summed over its namespaces (the tenant shares' unit); "
        'namespaces no HELLO claimed as tenant="(unclaimed)"',
        labels=["tier", "tenant"],
    )
    for name, t in tiers.items():
        hit_tokens.add_metric([name], node.get(f"hit_tokens_{name}", 0))
        if name == "disk":
            own = t.get("evictions", 0) - t.get("map_full_evictions", 0)
            by_reason.add_metric([name, "write"], own)
            by_reason.add_metric([name, "map_full"], t.get("map_full_evictions", 0))
            by_reason.add_metric([name, "orphan"], node.get("evictions_disk_orphan", 0))
        else:
            for reason in ("write", "promotion", "orphan"):
                by_reason.add_metric([name, reason], node.get(f"evictions_{name}_{reason}", 0))
        refused.add_metric([name, "share"], t.get("share_refusals", 0))
        refused.add_metric([name, "no_room"], node.get(f"room_refused_{name}", 0))
        orphans.add_metric([name], t.get("orphan_bytes", 0))
        for ns, nbytes in (t.get("namespaces") or {}).items():
            ns_bytes.add_metric([name, ns], nbytes)
        ns_bytes.add_metric([name, "other"], (t.get("namespaces_other") or {}).get("bytes", 0))
        for tenant, nbytes in (t.get("tenants") or {}).items():
            tenant_bytes.add_metric([name, tenant], nbytes)
        tenant_bytes.add_metric([name, "(unclaimed)"], t.get("unclaimed_bytes", 0))
    yield from (hit_tokens, by_reason, refused, orphans, ns_bytes, tenant_bytes)


class DaemonMetrics:
    """All of one daemon's metrics. Not thread-safe beyond what prometheus_client gives."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        r = self.registry = CollectorRegistry()
        self.ops = Counter("tierkv_ops", "Data-port requests by op and outcome", ["op", "result"], registry=r)
        self.latency = Histogram(
            "tierkv_op_seconds", "Data-port request latency", ["op"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.hits = Counter("tierkv_hits", "GET keys served", registry=r)
        self.misses = Counter("tierkv_misses", "GET keys not served (miss, mismatch, corrupt)", registry=r)
        self.checksum_failures = Counter(
            "tierkv_checksum_failures", "Payloads refused or dropped for a checksum mismatch", registry=r
        )
        self.bytes_in = Counter("tierkv_bytes_in", "Payload bytes received on the data port", registry=r)
        self.bytes_out = Counter("tierkv_bytes_out", "Payload bytes sent on the data port", registry=r)
        self.auth_failures = Counter("tierkv_auth_failures", "Refused tokens", ["port"], registry=r)
        self.protocol_errors = Counter(
            "tierkv_protocol_errors", "Bad frames and requests", ["code"], registry=r
        )
        self.hellos = Counter(
            "tierkv_hellos", "Accepted HELLOs by the transport chosen (tcp, rdma)", ["transport"], registry=r
        )
        self.rdma_accept_failures = Counter(
            "tierkv_rdma_accept_failures", "RDMA offers the device could not connect (TCP used)", registry=r
        )
        self.connections = Gauge("tierkv_connections", "Open data-port connections", registry=r)
        self.timeouts = Counter(
            "tierkv_timeouts",
            "Connections closed at a deadline (hello, idle, transfer, request, admin)",
            ["kind"],
            registry=r,
        )
        self.refused_connections = Counter(
            "tierkv_refused_connections",
            "Connections closed at a limit (unauthenticated, per_tenant, revoked, admin_limit)",
            ["why"],
            registry=r,
        )
        self.admin_request_errors = Counter(
            "tierkv_admin_request_errors",
            "Admin-port requests that failed: bad_http (unparseable: a header line over 8,190 bytes, "
            "over 128 headers, a bad method) or handler (a route raised)",
            ["kind"],
            registry=r,
        )
        r.register(_TierCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, float]:
        """Counter totals for ``/v1/stats`` and the STATS op."""
        out: dict[str, float] = {}
        for metric in self.registry.collect():
            if metric.type != "counter":
                continue
            for s in metric.samples:
                if s.name.endswith("_total"):
                    label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    out[s.name + (f"{{{label}}}" if label else "")] = s.value
        return out


def plain(obj: Any) -> Any:
    """``obj`` with only msgpack/JSON-safe types (stats may hold tuples, enums, floats)."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)
