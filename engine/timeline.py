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

Per layer group (opt-in: ``ModelRunner.time_layers``, off by default): for each prefill step,
per group of layers, the time the compute waited for the group's loaded KV (``load_wait``)
and the group's compute (``compute``), as :class:`StepLayers` records kept per request
(:meth:`Timeline.layer_steps`, the last LAYER_STEPS_KEPT steps), one log line per step, and
``tierkv_engine_layer_group_seconds{kind,group}``. Nothing is recorded while it is off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger("engine")

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
# Per-layer-group records kept for lookups by request (each a few hundred bytes).
LAYER_STEPS_KEPT = 256


@dataclass(frozen=True)
class GroupTime:
    """One layer group of one step: layers ``[first, stop)``; ``load_wait_s`` the compute
    stream stood waiting for the group's loaded KV (on CPU the loads are complete before the
    step, so it is only the hook's own time), ``compute_s`` the group's layers."""

    first: int
    stop: int
    load_wait_s: float
    compute_s: float


@dataclass(frozen=True)
class StepLayers:
    """One timed prefill step. ``request_ids``: the sequences it prefilled; ``tokens``: all
    tokens it computed; ``wall_s``: the whole forward (on CUDA device time between events around
    it, on CPU host time), so the groups' times sum to at most ``wall_s``."""

    request_ids: tuple[str, ...]
    tokens: int
    wall_s: float
    groups: tuple[GroupTime, ...]


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
        self._groups = Histogram(
            "tierkv_engine_layer_group_seconds",
            "Per layer group of a prefill step: load_wait or compute (see engine/timeline.py)",
            ["kind", "group"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._layer_steps: deque[StepLayers] = deque(maxlen=LAYER_STEPS_KEPT)
        self._lock = threading.Lock()

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

    def record_layers(self, step: StepLayers) -> None:
        """Keep ``step`` for :meth:`layer_steps`, observe its groups and log it (one line)."""
        for i, g in enumerate(step.groups):
            self._groups.labels("load_wait", str(i)).observe(g.load_wait_s)
            self._groups.labels("compute", str(i)).observe(g.compute_s)
        with self._lock:
            self._layer_steps.append(step)
        log.info(
            "event=layer_timeline requests=%s tokens=%d wall_ms=%.3f load_wait_ms=%s compute_ms=%s",
            ",".join(step.request_ids),
            step.tokens,
            step.wall_s * 1000,
            ",".join(f"{g.load_wait_s * 1000:.3f}" for g in step.groups),
            ",".join(f"{g.compute_s * 1000:.3f}" for g in step.groups),
        )

    def layer_steps(self, request_id: str | None = None) -> list[StepLayers]:
        """The kept per-layer-group records (oldest first), only those that prefilled
        ``request_id`` when given. Empty unless layer timing is on."""
        with self._lock:
            steps = list(self._layer_steps)
        return [s for s in steps if request_id is None or request_id in s.request_ids]
