"""The connector's Prometheus metrics, in a registry of its own (no module globals). The
engine's server exports them by registering ``ConnectorMetrics.registry`` as a collector."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ConnectorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.lookups = Counter("tierkv_connector_lookups", "Prefix lookups", registry=r)
        self.lookup_hit_tokens = Counter(
            "tierkv_connector_lookup_hit_tokens", "Tokens the store held at lookup", ["tier"], registry=r
        )
        self.hit_tokens = Counter(
            "tierkv_connector_hit_tokens", "Prompt tokens loaded instead of computed", ["tier"], registry=r
        )
        self.bytes_loaded = Counter("tierkv_connector_bytes_loaded", "KV bytes loaded", registry=r)
        self.bytes_saved = Counter("tierkv_connector_bytes_saved", "KV bytes stored", registry=r)
        self.block_bytes = Gauge(
            "tierkv_connector_block_bytes",
            "Payload bytes of one block at the engine's KV dtype (fp8: K/V bytes plus scales)",
            ["kv_dtype"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "tierkv_connector_load_seconds",
            "Time of one request's load",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.fallbacks = Counter(
            "tierkv_connector_recompute_fallbacks",
            "Blocks recomputed although the lookup reported them, by cause",
            ["cause"],
            registry=r,
        )
        self.policy_skipped_tokens = Counter(
            "tierkv_connector_policy_recompute_tokens",
            "Hit tokens the cost model chose to recompute",
            registry=r,
        )
        self.saved_blocks = Counter("tierkv_connector_saved_blocks", "Blocks stored", registry=r)
        self.dropped_saves = Counter(
            "tierkv_connector_dropped_saves", "Blocks not stored, by cause", ["cause"], registry=r
        )
        self.save_queue = Gauge(
            "tierkv_connector_save_queue_depth", "Blocks waiting to be stored", registry=r
        )
        self.prefill_tps = Gauge(
            "tierkv_connector_prefill_tokens_per_second", "Prefill speed the cost model uses", registry=r
        )
        self.tier_bandwidth = Gauge(
            "tierkv_connector_tier_bandwidth_bytes",
            "Load bandwidth the cost model uses",
            ["tier"],
            registry=r,
        )

    def value(self, name: str, **labels) -> float:
        """Current value of a sample (tests, the demo). 0 when absent."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v
