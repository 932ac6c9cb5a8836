"""Structured logs: one line per event, ``key=value`` pairs, values quoted when needed."""

from __future__ import annotations

import logging
import sys
import time


def kv(event: str, **fields: object) -> str:
    """``event=start data_port=7001 host=127.0.0.1``; strings with spaces or quotes are quoted."""
    parts = [f"event={event}"]
    for k, v in fields.items():
        s = str(v)
        if not s or any(c in s for c in ' "=\n'):
            s = '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        parts.append(f"{k}={s}")
    return " ".join(parts)


def setup_logging(level: str = "INFO") -> None:
    """Send ``kvstore.*`` logs to stderr as ``ts=... level=... logger=... event=...``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            "ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s", "%Y-%m-%dT%H:%M:%S%z"
        )
    )
    root = logging.getLogger("kvstore")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


class RateLimitedLog:
    """At most ``burst`` lines per ``period_s`` for one noisy event (bad frames from a fuzzer
    or an attacker); the rest are dropped and their number is logged with the next line that
    passes. Counters, not logs, carry the volume. Loop thread only."""

    def __init__(self, logger: logging.Logger, burst: int = 10, period_s: float = 10.0) -> None:
        self.logger = logger
        self.burst = burst
        self.period_s = period_s
        self._window = 0.0
        self._sent = 0
        self.suppressed = 0

    def info(self, event: str, **fields: object) -> None:
        self._log(logging.INFO, event, fields)

    def warning(self, event: str, **fields: object) -> None:
        self._log(logging.WARNING, event, fields)

    def _log(self, level: int, event: str, fields: dict[str, object]) -> None:
        now = time.monotonic()
        if now - self._window >= self.period_s:
            self._window, self._sent = now, 0
        if self._sent >= self.burst:
            self.suppressed += 1
            return
        self._sent += 1
        if self.suppressed:
            fields = {**fields, "suppressed_before": self.suppressed}
            self.suppressed = 0
        self.logger.log(level, kv(event, **fields))
