"""What every bench shares: free loopback ports, ``kvstore serve`` daemons (started by the
tests' own helper, tests/daemonutil.py), CPU seconds of a process, percentiles, the load
average, Markdown tables and the JSON result file (with the command, date and commit that made
it, which docs/benchmarks.md quotes beside each table).

A bench imports it as ``import common`` (``python bench/x.py`` puts bench/ first on the path);
importing it puts the repository and tests/ on the path too. It needs only the standard library
until a daemon is started (bench/peers_mooncake.py runs it in the peers venv, without tierkv)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daemonutil import Daemon

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from ports import free_port  # noqa: E402 - tests/ports.py, the one helper (stdlib only)

_TICK = os.sysconf("SC_CLK_TCK")

__all__ = [
    "REPO",
    "cpu_s",
    "free_port",
    "loadavg",
    "md_table",
    "pct",
    "running_daemon",
    "start_daemon",
    "write_json",
]


def start_daemon(
    wd: Path,
    *,
    use_disk: bool = False,
    env: dict[str, str] | None = None,
    ready_s: float = 0.0,
    **sections: dict,
) -> Daemon:
    """``kvstore serve`` under ``wd`` on ephemeral loopback ports (tests/daemonutil.py's
    ``launch_daemon``): DRAM only unless ``use_disk``; ``sections`` override config tables
    ({"dram": {"capacity": "1GiB"}}). With ``ready_s``, also awaits its ``/readyz`` (a daemon
    that pins and faults in a large DRAM tier serves only after). Stop it with ``.stop()``."""
    from daemonutil import launch_daemon
    from polling import until

    daemon = launch_daemon(Path(wd), use_disk=use_disk, env=env, **sections)
    if ready_s:

        def ready() -> bool:
            if daemon.proc.poll() is not None:
                raise RuntimeError(f"daemon exited ({daemon.proc.returncode}):\n{daemon.logs()}")
            try:
                with urllib.request.urlopen(daemon.admin + "/readyz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        try:
            until(ready, ready_s, "the daemon's /readyz")
        except BaseException:
            daemon.stop()
            raise
    return daemon


@contextlib.contextmanager
def running_daemon(wd: Path, **kwargs) -> Iterator[Daemon]:
    """:func:`start_daemon` for a ``with`` block: stopped when it ends."""
    daemon = start_daemon(wd, **kwargs)
    try:
        yield daemon
    finally:
        daemon.stop()


def cpu_s(pids: int | Iterable[int]) -> float:
    """User + system CPU seconds the process(es) ``pids`` used so far, all threads (Linux /proc)."""
    total = 0
    for pid in [pids] if isinstance(pids, int) else pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICK


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs`` by nearest rank; NaN for no samples."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded (printed beside every measurement: the
    host is shared, only same-run ratios mean anything)."""
    return [round(x, 2) for x in os.getloadavg()]


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table; floats with 3 significant digits, None as n/a."""

    def cell(v: object) -> str:
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def write_json(path: str | Path | None, doc: dict) -> dict:
    """Write ``doc`` to ``path`` (when given) as indented JSON under a ``run`` entry saying
    what made it: the command line, UTC date, commit, CPU count and load average now."""
    doc = {
        "run": {
            "command": "python " + shlex.join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": _commit(),
            "host_cpus": os.cpu_count(),
            "loadavg_end": loadavg(),
        },
        **doc,
    }
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    return doc
