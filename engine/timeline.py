"""A request's timeline: how long each phase around a request takes, as one Prometheus
histogram with a ``phase`` label (``tierkv_engine_phase_seconds``), in a registry of its own
that the server exports on ``/metrics``.

Phases (seconds; per request unless noted):
  tokenize     the server turning a prompt or chat messages into token ids (on the event loop)
  lookup       the connector's lookup, as the engine waited for it (hashing inside it included)
  hash         computing a prompt's page keys for the engine's prefix cache (once per request)
  queue        from entering the scheduler's queue (after the lookup) to admission
  load         a connector load: from the scheduler handing it out to its pages being usable
  schedule     one scheduler pass (per step)
  compute      one model forward (per step; on CUDA without a device sync, so it is the
               host's time to enqueue the step when the GPU is behind)
  sample       sampling the step's tokens (per step that samples)
  to_thread    event loop -> step thread: from submitting a step to it starting (per step)
  from_thread  step thread -> event loop: from a step returning to the loop resuming (per step)

Observing costs one histogram update (a lock and a bucket search): a few per step.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Histogram

PHASES = (
    "tokenize",
    "lookup",
    "hash",
    "queue",
    "load",
    "schedule",
    "compute",
    "sample",
    "to_thread",
    "from_thread",
)
_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)


class Timeline:
    """Thread-safe: the step thread and the event loop both observe."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        hist = Histogram(
            "tierkv_engine_phase_seconds",
            "Time of one phase of a request or step (see engine/timeline.py)",
            ["phase"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._phases = {p: hist.labels(p) for p in PHASES}  # label lookup once, not per observe

    def observe(self, phase: str, seconds: float) -> None:
        """Record one ``phase`` (one of PHASES; KeyError names an unknown one)."""
        self._phases[phase].observe(seconds)

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._phases[name].observe(time.perf_counter() - t0)

    def count(self, phase: str) -> int:
        """How many times ``phase`` was observed (tests, benchmarks)."""
        v = self.registry.get_sample_value("tierkv_engine_phase_seconds_count", {"phase": phase})
        return int(v or 0)

    def total(self, phase: str) -> float:
        """Seconds observed in ``phase`` so far."""
        v = self.registry.get_sample_value("tierkv_engine_phase_seconds_sum", {"phase": phase})
        return float(v or 0.0)
