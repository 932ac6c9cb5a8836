"""The daemon's Prometheus metrics (names prefixed ``tierkv_``), in a registry per daemon.

Counters are bumped on the event loop thread by the data and admin servers. Tier usage is
read from ``node.stats()`` at scrape time by a collector, so it is never stale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


class _TierCollector:
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self):
        try:
            tiers = self._stats().get("tiers", {})
        except Exception:  # a scrape must never fail because the node is closing
            tiers = {}
        fams = {
            "used_bytes": GaugeMetricFamily(
                "tierkv_tier_bytes",
                "Bytes a tier holds for its blocks (slots or file records)",
                labels=["tier"],
            ),
            "payload_bytes": GaugeMetricFamily(
                "tierkv_tier_payload_bytes", "Payload bytes of the blocks stored per tier", labels=["tier"]
            ),
            "waste_bytes": GaugeMetricFamily(
                "tierkv_tier_waste_bytes",
                "Memory a tier holds but no payload fills (slot tails, free slots of used spans)",
                labels=["tier"],
            ),
            "file_bytes": GaugeMetricFamily(
                "tierkv_tier_file_bytes", "Size of the tier's file on disk (LMDB)", labels=["tier"]
            ),
            "capacity_bytes": GaugeMetricFamily(
                "tierkv_tier_capacity_bytes", "Configured capacity per tier", labels=["tier"]
            ),
            "blocks": GaugeMetricFamily("tierkv_tier_blocks", "Blocks stored per tier", labels=["tier"]),
            "evictions": CounterMetricFamily(
                "tierkv_tier_evictions", "Blocks evicted per tier", labels=["tier"]
            ),
        }
        for name, t in tiers.items():
            for field, fam in fams.items():
                v = t.get(field)
                if isinstance(v, (int, float)):
                    fam.add_metric([name], v)
        yield from fams.values()


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
