"""The one read of every store client: :class:`BlockRead`, and the one check of a read's arguments.

``store.read(keys, bufs, expect, deadline_s)`` answers a :class:`BlockRead`; use it as

    async with store.read(keys, bufs, expect) as r:
        ...  # r.results[i], r.views[i]: copy the bytes out before the block ends

or ``r = await store.read(...)`` followed by ``r.release()`` once the bytes are copied (a caller
whose copies finish later, on a device stream). On entry the read is done: per key a
:class:`~kvstore.results.GetResult` (HIT only when the block arrived whole and matched its key
and ``expect[i]``; a block longer than ``bufs[i]`` is BUF_TOO_SMALL) and, for a HIT, a view of
exactly its payload:

- lent (``r.lent[i]``): the store's own memory, read-only (in process, a leased DRAM slot);
  valid until release, after which the slot may hold another block;
- else ``bufs[i]``'s first bytes, which the read filled (a daemon's reply, the local disk).

Release is idempotent and never raises; a store problem is a miss, as everywhere in the client
(kvstore/client/api.py). ``get_into`` is this read followed by :meth:`BlockRead.copy_lent`: the
two are one mechanism. A remote client's read is :func:`filling` over its ``get_into``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any

from kvstore.client.conn import byte_view
from kvstore.keys import BlockKey
from kvstore.results import Expect, GetResult, Status

# What a read's fill answers: results, views, which views are lent, and what releases them.
Filled = tuple[list[GetResult], list[memoryview | None], list[bool], Callable[[], None] | None]


def check_read(
    op: str, keys: Sequence[BlockKey], bufs: Sequence[Any], expect: Sequence[Expect | None] | None
) -> list[Expect | None]:
    """The argument check of every read (``op`` names the call in the error): one buffer and at
    most one expectation per key, else ValueError. Returns the expectations, one per key."""
    if len(bufs) != len(keys) or (expect is not None and len(expect) != len(keys)):
        n_exp = "no" if expect is None else len(expect)
        raise ValueError(f"{op}: {len(keys)} keys but {len(bufs)} buffers and {n_exp} expectations")
    return list(expect) if expect is not None else [None] * len(keys)


class BlockRead:
    """One read's results and views; see the module docstring. Built by a client from ``fill``,
    a coroutine function run once, on entry (or when awaited)."""

    def __init__(self, fill: Callable[[], Awaitable[Filled]]) -> None:
        self._fill: Callable[[], Awaitable[Filled]] | None = fill
        self.results: list[GetResult] = []
        self.views: list[memoryview | None] = []
        self.lent: list[bool] = []
        self._release: Callable[[], None] | None = None

    async def _run(self) -> BlockRead:
        if self._fill is None:
            raise RuntimeError("a BlockRead is entered once")
        fill, self._fill = self._fill, None
        self.results, self.views, self.lent, self._release = await fill()
        return self

    def __await__(self) -> Generator[Any, None, BlockRead]:
        return self._run().__await__()

    async def __aenter__(self) -> BlockRead:
        return await self._run()

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Give lent views back to the store (idempotent); afterwards they must not be read."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def copy_lent(self, bufs: Sequence[Any]) -> list[GetResult]:
        """Copy every lent HIT into its buffer (what ``get_into`` adds to a read); the results."""
        for i, (lent, view) in enumerate(zip(self.lent, self.views)):
            if lent and view is not None:
                byte_view(bufs[i])[: view.nbytes] = view
        return self.results


def filled_views(bufs: Sequence[Any], results: Sequence[GetResult]) -> Filled:
    """A read whose bytes went into ``bufs``: per HIT the view of its payload in its buffer."""
    views = [
        byte_view(b)[: r.header.payload_len] if r.status is Status.HIT and r.header is not None else None
        for b, r in zip(bufs, results)
    ]
    return list(results), views, [False] * len(views), None


def filling(
    get_into: Callable[..., Awaitable[list[GetResult]]],
    keys: Sequence[BlockKey],
    bufs: Sequence[Any],
    expect: Sequence[Expect | None] | None,
    deadline_s: float | None,
) -> BlockRead:
    """The read of a client that fills buffers (daemons): ``get_into`` into ``bufs``, the views
    their filled bytes, nothing lent."""
    exp = check_read("read", keys, bufs, expect)

    async def fill() -> Filled:
        return filled_views(bufs, await get_into(keys, bufs, exp, deadline_s))

    return BlockRead(fill)
