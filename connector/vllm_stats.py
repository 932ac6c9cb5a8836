"""The vLLM connector's counters, one set per side (scheduler, each worker): its own (lookups,
tokens reported to vLLM, blocks reported as load errors, ...), the connector's Prometheus
counters and the store client's. With ``stats_path`` set they are written as JSON to
``stats_path/<side>.json`` after each step that changed them (atomically: a reader sees a
whole file), so a test or a benchmark reads what each path really did."""

from __future__ import annotations

import json
import os
from collections import Counter

from connector.store_connector import StoreConnector

_PREFIX = "tierkv_connector_"


class SideStats:
    def __init__(self, stats_path: str, side: str) -> None:
        self.counts: Counter[str] = Counter()
        self.file = os.path.join(stats_path, f"{side}.json") if stats_path else ""
        self._written: dict[str, float] | None = None

    def snapshot(self, conn: StoreConnector | None) -> dict[str, float]:
        out: dict[str, float] = dict(self.counts)
        if conn is not None:
            for metric in conn.metrics.registry.collect():
                for s in metric.samples:
                    if s.name.startswith(_PREFIX) and s.name.endswith("_total"):
                        key = s.name[len(_PREFIX) : -len("_total")]
                        key += "".join(f".{v}" for v in s.labels.values())
                        out[key] = s.value
            out.update((f"store.{k}", v) for k, v in conn.backend.counters.items())
        return out

    def write(self, conn: StoreConnector | None) -> None:
        """Rewrite the file when the counters changed since the last write (no-op without one)."""
        if not self.file:
            return
        snap = self.snapshot(conn)
        if snap == self._written:
            return
        tmp = f"{self.file}.tmp"
        with open(tmp, "w") as f:
            json.dump(snap, f, sort_keys=True)
        os.replace(tmp, self.file)
        self._written = snap
