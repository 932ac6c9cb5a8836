"""Running work that a thread has started to its end, whatever happens to its caller.

Cancelling an await of a thread's future does not stop the thread: a disk write goes on
after its caller is gone. Work that must follow that thread -- the disk index and byte counts
after an LMDB write, the hold that keeps a slot in place while a disk thread reads it -- is
therefore run in its own task that the caller's cancellation does not reach.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("tierkv.node")

T = TypeVar("T")


async def to_the_end(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` in its own task, shielded: a cancelled caller gets CancelledError at
    once while ``coro`` runs on to its end (an error it raises then is logged, as nobody
    awaits it any more)."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_log_failure)
        raise


async def until_the_thread_ends(fut: asyncio.Future[T]) -> T:
    """Await a thread's future; when the caller is cancelled, first wait for the thread to
    end, then raise CancelledError. For threads that write into the caller's buffers: the
    caller may reuse a buffer as soon as this returns or raises, so no copy may still be
    running then (a disk read is bounded by the disk, so the wait is short)."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait({fut})
            except asyncio.CancelledError:
                continue  # cancelled again: still never return under a running copy
        if not fut.cancelled():
            fut.exception()  # retrieved: its failure no longer matters to anyone
        raise


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("event=finish_after_cancel_failed error=%r", task.exception())
