"""A store client's counters as Prometheus counters: what the engine's /metrics shows of the
store (the connector registers it beside its own metrics: connector/store_connector.py).

Contract: :class:`CountersCollector` reads ``source()`` (a ``counters`` property: a Counter of
non-negative totals, e.g. :attr:`ClusterClient.counters <kvstore.client.cluster.ClusterClient.counters>`)
at each scrape and yields one ``<prefix>_<name>_total`` counter per entry (names made safe for
Prometheus); a source that raises yields nothing that scrape (logged), never breaks /metrics.
Health's ejections and readmissions (``ejected_<why>``, ``readmitted_<why>``) and the writes'
``blocks_under_replicated`` arrive this way.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("kvstore.client")
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


class CountersCollector:
    def __init__(self, source: Callable[[], Counter[str]], prefix: str = "tierkv_store_client") -> None:
        self.source = source
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        try:
            counters = dict(self.source())
        except Exception as exc:  # a scrape must never fail for the store
            log.warning("event=store_counters_unreadable error=%r", exc)
            return
        for name in sorted(counters):
            value = counters[name]
            if not isinstance(value, (int, float)) or value < 0:
                continue
            fam = CounterMetricFamily(
                f"{self.prefix}_{_UNSAFE.sub('_', name)}", f"Store client: {name.replace('_', ' ')}"
            )
            fam.add_metric([], value)
            yield fam
