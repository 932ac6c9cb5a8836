"""Structured logs: one line per event, ``key=value`` pairs, values quoted when needed."""

from __future__ import annotations

import logging
import sys


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
