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
(kvstore/client/api.py). :func:`get_into` is this read followed by :meth:`BlockRead.copy_lent`,
for callers that want every payload in their own buffers: a module function over ``read``, so
each client has one read. A client that fills buffers (the daemons' clients) builds its read
with :func:`filling`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Protocol

from kvstore.client.conn import byte_view
from kvstore.keys import BlockKey
from kvstore.results import Expect, GetResult, Status

# A read's arguments, named once for every client's ``read`` (and :func:`get_into`): the keys,
# one writable buffer per key (a numpy array, bytearray or pinned tensor: anything
# ``memoryview(buf).cast("B")`` takes), and at most one expectation per key (or none).
ReadKeys = Sequence[BlockKey]
ReadBuffers = Sequence[Any]
ReadExpects = Sequence[Expect | None] | None

# What a read's fill answers: results, views, which views are lent, and what releases them.
Filled = tuple[Sequence[GetResult], Sequence[memoryview | None], Sequence[bool], Callable[[], None] | None]
# What fills buffers: (keys, bufs, one expectation per key, deadline) -> one result per key.
Fill = Callable[
    [Sequence[BlockKey], Sequence[Any], list[Expect | None], float | None], Awaitable[Sequence[GetResult]]
]


def check_read(
    op: str, keys: Sequence[BlockKey], bufs: Sequence[Any], expect: Sequence[Expect | None] | None
) -> list[Expect | None]:
    """The argument check of every read (``op`` names the call in the error): one buffer and at
    most one expectation per key, else ValueError. Returns the expectations, one per key."""
    if len(bufs) != len(keys) or (expect is not None and len(expect) != len(keys)):
        n_exp = "no" if expect is None else len(expect)
        raise ValueError(f"{op}: {len(keys)} keys but {len(bufs)} buffers and {n_exp} expectations")
    return list(expect) if expect is not None else [None] * len(keys)


class Readable(Protocol):
    """What :func:`get_into` reads from: any store client (kvstore/client/api.py), a node client."""

    def read(
        self, keys: ReadKeys, bufs: ReadBuffers, expect: ReadExpects = None, deadline_s: float | None = None
    ) -> BlockRead: ...


class BlockRead:
    """One read's results and views; see the module docstring. Built by a client from ``fill``,
    a coroutine function run once, on entry (or when awaited)."""

    def __init__(self, fill: Callable[[], Awaitable[Filled]]) -> None:
        self._fill: Callable[[], Awaitable[Filled]] | None = fill
        self.results: Sequence[GetResult] = []
        self.views: Sequence[memoryview | None] = []
        self.lent: Sequence[bool] = []
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

    def copy_lent(self, bufs: Sequence[Any]) -> Sequence[GetResult]:
        """Copy every lent HIT into its buffer (what :func:`get_into` adds to a read); the results."""
        if any(self.lent):
            for i, (lent, view) in enumerate(zip(self.lent, self.views)):
                if lent and view is not None:
                    byte_view(bufs[i])[: view.nbytes] = view
        return self.results


async def get_into(
    store: Readable,
    keys: Sequence[BlockKey],
    bufs: Sequence[Any],
    expect: Sequence[Expect | None] | None = None,
    deadline_s: float | None = None,
) -> Sequence[GetResult]:
    """``store.read`` with every HIT's payload in ``bufs[i]`` (lent bytes copied out before the
    read is released): one result per key, in order (a remote node's read: one
    :class:`~kvstore.results.GetResults`). Bytes of a buffer whose result is not HIT are
    unspecified. ValueError at once for a buffer or expectation count that is not the keys'."""
    async with store.read(keys, bufs, expect, deadline_s) as r:
        return r.copy_lent(bufs)


class FilledViews(Sequence[memoryview | None]):
    """Per key of a read that filled ``bufs``: its HIT's payload in its buffer, else None;
    made when indexed, so a read of thousands of blocks makes no view nobody asks for."""

    def __init__(self, bufs: Sequence[Any], results: Sequence[GetResult]) -> None:
        self._bufs, self._results = bufs, results

    def __len__(self) -> int:
        return len(self._results)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        r = self._results[i]
        if r.status is not Status.HIT or r.header is None:
            return None
        return byte_view(self._bufs[i])[: r.header.payload_len]


def filling(
    fill_into: Fill,
    keys: Sequence[BlockKey],
    bufs: Sequence[Any],
    expect: Sequence[Expect | None] | None,
    deadline_s: float | None,
) -> BlockRead:
    """The read of a client that fills buffers (daemons): ``fill_into`` (keys, bufs, one
    expectation per key, deadline) fills ``bufs``; the views are their filled bytes, nothing
    lent. The arguments are checked now (ValueError)."""
    exp = check_read("read", keys, bufs, expect)

    async def fill() -> Filled:
        results = await fill_into(keys, bufs, exp, deadline_s)
        return results, FilledViews(bufs, results), [False] * len(results), None

    return BlockRead(fill)
