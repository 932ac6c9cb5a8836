"""The suite's one poller: wait until something holds, within a deadline, and fail saying what
was awaited and what was last seen. A deadline here is a generous bound on a loaded machine,
never a measurement: a test that needs speed belongs in bench/ (a ratio against a floor).

``until`` is for synchronous tests (it sleeps the thread), ``until_async`` for coroutines (it
sleeps the event loop, so servers in the same loop keep running)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

INTERVAL_S = 0.05


def _timed_out(what: str, deadline_s: float, last: Any) -> AssertionError:
    return AssertionError(f"waited {deadline_s:g} s for {what}; last seen: {last!r}")


def until(
    probe: Callable[[], Any],
    deadline_s: float,
    what: str,
    ok: Callable[[Any], bool] = bool,
    interval_s: float = INTERVAL_S,
) -> Any:
    """Call ``probe()`` until ``ok(value)`` holds and return that value. After ``deadline_s``
    seconds without it: AssertionError naming ``what`` and the last value. The probe is called
    at least once, and once more at the deadline; what it raises propagates."""
    end = time.monotonic() + deadline_s
    while True:
        last_call = time.monotonic() >= end
        value = probe()
        if ok(value):
            return value
        if last_call:
            raise _timed_out(what, deadline_s, value)
        time.sleep(min(interval_s, max(0.0, end - time.monotonic())))


async def until_async(
    probe: Callable[[], Any],
    deadline_s: float,
    what: str,
    ok: Callable[[Any], bool] = bool,
    interval_s: float = INTERVAL_S,
    wait: Callable[[float], Any] | None = None,
) -> Any:
    """``until`` for coroutines: ``probe()`` may return a value or an awaitable of one.
    ``wait(seconds)``, when given, is awaited between probes instead of a plain sleep (e.g. a
    membership's ``wait_changed``, so a change is seen at once); it gets the time left, at
    most ``interval_s``."""
    end = time.monotonic() + deadline_s
    while True:
        last_call = time.monotonic() >= end
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if ok(value):
            return value
        if last_call:
            raise _timed_out(what, deadline_s, value)
        pause = min(interval_s, max(0.0, end - time.monotonic()))
        if wait is None:
            await asyncio.sleep(pause)
        else:
            await wait(pause)


async def until_grown_async(
    probe: Callable[[], float], by: float, deadline_s: float, what: str, interval_s: float = INTERVAL_S
) -> float:
    """Await a counter: ``probe()`` grown by ``by`` from its value now (``until_async``'s
    deadline and failure); returns the value that did."""
    start = probe()
    return await until_async(probe, deadline_s, what, ok=lambda v: v >= start + by, interval_s=interval_s)
