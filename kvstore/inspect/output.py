"""How the CLI prints: rich tables for people, one JSON document for machines.

Colours and terminal width only when stdout is a terminal (``NO_COLOR`` is honoured); on a
pipe, tables are plain text, wide enough that keys are never cut. ``--json`` prints exactly
one JSON document (sorted keys, 2-space indent) on stdout per command, errors included.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

from kvstore.config import format_size

PIPE_WIDTH = 200


class Output:
    def __init__(self, as_json: bool, stream: TextIO | None = None, err: TextIO | None = None) -> None:
        self.as_json = as_json
        stream = stream or sys.stdout
        tty = stream.isatty()
        self.console = Console(
            file=stream, highlight=False, width=None if tty else PIPE_WIDTH, soft_wrap=not tty
        )
        self.err = Console(file=err or sys.stderr, highlight=False, soft_wrap=True)

    def json(self, doc: Any) -> None:
        self.console.file.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")

    def print(self, *items: Any, **kw: Any) -> None:
        self.console.print(*items, **kw)

    def table(
        self, title: str | None, columns: list[str], rows: list[list[Any]], right: set[str] = frozenset()
    ) -> None:
        t = Table(title=title, title_justify="left", header_style="bold", box=None, pad_edge=False)
        for c in columns:
            t.add_column(c, justify="right" if c in right else "left", no_wrap=True)
        for r in rows:
            t.add_row(*[x if not isinstance(x, (int, float)) else str(x) for x in r])
        self.console.print(t)

    def error(self, prog: str, message: str, node: str | None = None) -> None:
        """Report an error: a line on stderr; with ``--json`` also ``{"error": {...}}`` on stdout."""
        self.err.print(f"{prog}: {message}", style="red", markup=False)
        if self.as_json:
            self.json({"error": {"message": message, "node": node}})


def human_size(n: int | float | None) -> str:
    return "-" if n is None else format_size(n)


def ago(ts: float | None, now: float | None = None) -> str:
    """``ts`` (epoch seconds) as a short age: ``42s``, ``5m``, ``3h``, ``2d``; ``-`` for 0/None."""
    if not ts:
        return "-"
    d = max(0.0, (now or time.time()) - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= size:
            return f"{int(d // size)}{unit}"
    return f"{int(d)}s"


def short(hexstr: str, n: int = 12) -> str:
    return hexstr if len(hexstr) <= n else hexstr[:n] + "…"
