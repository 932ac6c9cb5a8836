"""What a connector's ``flush()`` tells its caller: how the saves since the previous flush
ended. A save that did not store its blocks is never silent."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FlushResult:
    """Blocks handed to the saver since the previous flush: ``saved`` (stored, or already
    there), ``dropped`` (never sent: the save queue stayed full past the save deadline),
    ``failed`` (sent, but no replica took them: error, timeout, no space), by ``causes``;
    ``under_replicated``: saved blocks on fewer nodes than ``replicas`` (repair adds the rest
    later; they are hits meanwhile). ``complete`` is False when the flush timed out with saves still in flight (they are in
    none of the counts yet). True in a boolean context only when everything was saved."""

    saved: int
    dropped: int
    failed: int
    complete: bool
    causes: dict[str, int] = field(default_factory=dict)
    under_replicated: int = 0

    @property
    def ok(self) -> bool:
        return self.complete and not self.dropped and not self.failed

    def __bool__(self) -> bool:
        return self.ok


class SaveTally:
    """Counts since the last :meth:`take` (owned by the connector's event loop)."""

    def __init__(self) -> None:
        self.saved = self.dropped = self.failed = self.under_replicated = 0
        self.causes: Counter[str] = Counter()

    def add(self, outcome: str, cause: str = "", n: int = 1) -> None:
        """``outcome`` is ``saved``, ``dropped``, ``failed`` or ``under_replicated``."""
        setattr(self, outcome, getattr(self, outcome) + n)
        if cause:
            self.causes[cause] += n

    def take(self, complete: bool) -> FlushResult:
        r = FlushResult(
            self.saved, self.dropped, self.failed, complete, dict(self.causes), self.under_replicated
        )
        self.saved = self.dropped = self.failed = self.under_replicated = 0
        self.causes.clear()
        return r


class SavesLostError(RuntimeError):
    """A caller that needs every block stored (demo, benchmarks) got a flush that lost some."""


def require_saved(result: FlushResult, what: str) -> FlushResult:
    """``result`` if every block was saved; else SavesLostError naming ``what`` and the counts."""
    if not result.ok:
        raise SavesLostError(
            f"{what}: not every KV block was stored (saved={result.saved} dropped={result.dropped} "
            f"failed={result.failed} complete={result.complete} causes={result.causes})"
        )
    return result
