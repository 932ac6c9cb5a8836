"""The connector's event loop inside vLLM: vLLM calls a connector synchronously, from its
scheduler and model-runner threads; the store client, lookup, loader and saver are asyncio.
:class:`LoopThread` runs one loop on a daemon thread of its own, so writes behind and
connection upkeep go on between vLLM's calls, and vLLM waits only where it must (a lookup, a
load), each under a deadline."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import TypeVar

T = TypeVar("T")


class Running:
    """A coroutine started on the loop: ``future`` its result; ``ended`` is set once the
    coroutine itself ended (a cancelled future is done at once, its coroutine later)."""

    def __init__(self, future: concurrent.futures.Future, ended: threading.Event) -> None:
        self.future, self.ended = future, ended

    def result(self, timeout_s: float | None):
        """The result within ``timeout_s``; else cancel, wait up to ``timeout_s`` more for the
        coroutine to honour it (a load waits for its copy under way), raise TimeoutError."""
        try:
            return self.future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self.future.cancel()
            self.ended.wait(timeout_s)
            raise TimeoutError(f"no answer within {timeout_s} s") from None


async def _tracked(coro: Coroutine[object, object, T], ended: threading.Event) -> T:
    try:
        return await coro
    finally:
        ended.set()


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[object, object, T]) -> Running:
        """Start ``coro`` on the loop, for the caller to wait on (or not)."""
        ended = threading.Event()
        return Running(asyncio.run_coroutine_threadsafe(_tracked(coro, ended), self.loop), ended)

    def run(self, coro: Coroutine[object, object, T], timeout_s: float | None) -> T:
        """Run ``coro`` on the loop and wait for it (:meth:`Running.result`)."""
        return self.submit(coro).result(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
