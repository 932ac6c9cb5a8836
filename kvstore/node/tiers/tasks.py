"""Running work that a thread has started to its end, whatever happens to its caller.

Cancelling an await of a thread's future does not stop the thread: a disk write goes on
after its caller is gone. Work that must follow that thread -- the disk index and byte counts
after an LMDB write, the hold that keeps a slot in place while a disk thread reads it -- is
therefore run in its own task that the caller's cancellation does not reach, and tracked
(:class:`Finishing`) so that the node's close waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("tierkv.node")

T = TypeVar("T")


class Finishing:
    """The tasks :func:`to_the_end` runs for one node: work its cancelled callers left
    finishing. The node makes one at open and hands it to every part that starts such work,
    and awaits it (:meth:`drain`) before its tiers close: a write left finishing needs the
    disk's writer thread and LMDB environment until its end."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future] = set()

    def __len__(self) -> int:
        """Tasks not yet ended."""
        return len(self._tasks)

    def track(self, task: asyncio.Future) -> None:
        """Hold ``task`` until it ends."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for every task to end, including tasks those start
        meanwhile (a write that ends with a delete); the number still running then. Never
        cancels one: a task left running ends (or fails, logged) on its own."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._tasks and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)
        return len(self._tasks)


async def to_the_end(coro: Coroutine[Any, Any, T], finishing: Finishing) -> T:
    """Await ``coro`` in its own task, shielded and tracked by ``finishing``: a cancelled
    caller gets CancelledError at once while ``coro`` runs on to its end (an error it raises
    then is logged, as nobody awaits it any more)."""
    task = asyncio.ensure_future(coro)
    finishing.track(task)
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
