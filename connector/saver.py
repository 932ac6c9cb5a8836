"""The connector's saver: new full blocks copied out of the pages, queued, written behind.

Contract.

- :meth:`Saver.save` copies the request's full blocks that are not known to be stored out of
  the pages (on CUDA in one hop to a worker thread per up to 64 MiB) and queues them; it
  returns once they are copied, so the engine may drop its reference on the pages. The request
  never waits for a write.
- The queue is bounded in bytes (``save_queue_bytes``): a save waits for room up to
  ``save_deadline_s``, then drops the rest (counted ``dropped_saves{cause="queue_full"}``)
  rather than stall inference.
- One background task writes the queue in batches of up to 16 blocks (``put`` under
  ``save_deadline_s``). A block that no node took is forgotten as stored, so a later request
  tries again; how each block ended is tallied for :meth:`flush`.
- Known-stored keys (those queued, written, or seen held by a lookup: :meth:`remember`) are a
  bounded LRU of ``_KNOWN_STORED_MAX`` keys; a forgotten key costs one redundant write (EXISTS).

Runs on the engine's event loop; reads the store and the namespace through the connector's
accessors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from connector.config import ConnectorConfig
from connector.flush import FlushResult, SaveTally
from connector.metrics import ConnectorMetrics
from kvstore.client import Status, StoreClient, make_header
from kvstore.keys import KeyBatch, Namespace

log = logging.getLogger("tierkv.connector")

_KNOWN_STORED_MAX = 1 << 16
_GATHER_BYTES = 64 << 20  # a save copies out up to this much per hop to a worker thread (CUDA)
_PUT_BATCH = 16


class Saver:
    """See the module docstring. ``block`` is (shape, dtype name, bytes) of one block."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        store: Callable[[], StoreClient],
        namespace: Callable[[], Namespace],
        transfer,
        pages_per_block: int,
        block: tuple[tuple[int, ...], str, int],
        metrics: ConnectorMetrics,
    ) -> None:
        self.cfg, self.store, self.namespace, self.transfer = cfg, store, namespace, transfer
        self.pages_per_block = pages_per_block
        self.block_shape, self.dtype_name, self.block_bytes = block
        self.metrics = metrics
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._queue: asyncio.Queue | None = None
        self._queued_bytes = 0
        self._space: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._saving = 0  # save() calls still copying blocks out
        self._idle = asyncio.Event()
        self._idle.set()
        self._tally = SaveTally()  # how saves ended since the last flush()

    def start(self) -> None:
        """Start the writing task (idempotent; the first save starts it otherwise)."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._space = asyncio.Event()
            self._task = asyncio.create_task(self._write_loop(), name="kv-connector-saver")

    def remember(self, keys: KeyBatch) -> None:
        """``keys`` are stored: one C-level update (a key known already keeps its place)."""
        d = self._stored
        d.update(dict.fromkeys(keys.raws()))
        for _ in range(len(d) - _KNOWN_STORED_MAX):
            d.popitem(last=False)

    def _full(self) -> bool:
        return bool(self._queued_bytes) and self._queued_bytes + self.block_bytes > self.cfg.save_queue_bytes

    @property
    def queued_bytes(self) -> int:
        """Bytes of blocks queued and not yet written or dropped."""
        return self._queued_bytes

    async def save(
        self,
        request,
        page_ids: Sequence[int],
        keys: KeyBatch,
        first: int = 0,
        gather: Callable[[Sequence[int]], torch.Tensor] | None = None,
    ) -> None:
        """Queue ``request``'s blocks ``keys`` (one per ``pages_per_block`` of ``page_ids``),
        from block ``first`` on (the blocks before it only give the chain its parents).
        ``gather``: what copies a block's pages out, instead of ``transfer.gather`` (vLLM's
        connector hands blocks it already copied out of the pages)."""
        self._saving += 1  # flush() waits for saves still copying out, not only the queue
        self._idle.clear()
        try:
            await self._save(request, page_ids, keys, first, gather or self.transfer.gather)
        finally:
            self._saving -= 1
            if not self._saving:
                self._idle.set()

    async def _save(self, request, page_ids: Sequence[int], keys: KeyBatch, first: int, gather) -> None:
        bt = self.namespace().block_tokens
        ns_id = self.namespace().id
        self.start()
        deadline = time.monotonic() + self.cfg.save_deadline_s
        parent = keys[first - 1] if first else ns_id
        gathered: dict[int, torch.Tensor] = {}
        for j in range(first, len(keys)):
            key = keys[j]
            if key.raw not in self._stored:
                # Bounded in bytes: wait for the writer to make room (the engine holds these
                # pages meanwhile, inference goes on), and drop the rest past the deadline.
                while self._full() and (left := deadline - time.monotonic()) > 0:
                    self._space.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._space.wait(), left)
                if self._full():
                    n_drop = sum(1 for k in keys[j:] if k.raw not in self._stored)
                    self.metrics.dropped_saves.labels("queue_full").inc(n_drop)
                    self._tally.add("dropped", "queue_full", n_drop)
                    break
                if j not in gathered:
                    gathered = await self._gather_from(j, keys, page_ids, gather)
                payload = gathered.pop(j).view(torch.uint8).reshape(-1).numpy()
                h = make_header(
                    key=key,
                    parent=parent,
                    namespace=ns_id,
                    tokens=request.token_ids[j * bt : (j + 1) * bt],
                    dtype=self.dtype_name,
                    shape=self.block_shape,
                    payload=payload,
                )
                self._queue.put_nowait((h, payload))
                self._queued_bytes += self.block_bytes
                self._stored[key.raw] = None  # in flight counts as stored
                self._stored.move_to_end(key.raw)
                while len(self._stored) > _KNOWN_STORED_MAX:
                    self._stored.popitem(last=False)
                if j % 8 == 7:
                    await asyncio.sleep(0)  # long prompts: let the writer and the engine loop run
            parent = key
        self.metrics.save_queue.set(self._queue.qsize())

    async def _gather_from(
        self, j: int, keys: KeyBatch, page_ids: Sequence[int], gather_pages
    ) -> dict[int, torch.Tensor]:
        """Copy out block ``j`` and the next not-yet-stored blocks, up to _GATHER_BYTES (at
        least one block): on CUDA in one hop to a worker thread (the copies block their
        thread), not one hop per block."""
        ppb = self.pages_per_block
        most = max(1, _GATHER_BYTES // self.block_bytes)
        idx = [i for i in range(j, len(keys)) if i == j or keys[i].raw not in self._stored][:most]

        def gather() -> dict[int, torch.Tensor]:
            return {i: gather_pages(page_ids[i * ppb : (i + 1) * ppb]) for i in idx}

        return await asyncio.to_thread(gather) if self.transfer.cuda else gather()

    async def _write_loop(self) -> None:
        q = self._queue
        while True:
            batch = [await q.get()]
            while not q.empty() and len(batch) < _PUT_BATCH:
                batch.append(q.get_nowait())
            try:
                report = await self.store().put(batch, self.cfg.save_deadline_s)
                res = report.results
                self._tally.add("under_replicated", n=report.under_replicated)
            except Exception as exc:
                log.warning("event=save_failed blocks=%d error=%r", len(batch), exc)
                res = [None] * len(batch)
            for (h, _), r in zip(batch, res):
                if r is not None and r.status.ok:
                    self._tally.add("saved")
                    if r.status is Status.STORED:
                        self.metrics.saved_blocks.inc()
                        self.metrics.bytes_saved.inc(h.payload_len)
                else:
                    self._stored.pop(h.key.raw, None)  # let a later request try again
                    cause = r.status.name.lower() if r is not None else "error"
                    self.metrics.dropped_saves.labels(cause).inc()
                    self._tally.add("failed", cause)
            self._queued_bytes -= len(batch) * self.block_bytes
            self._space.set()
            for _ in batch:
                q.task_done()
            self.metrics.save_queue.set(q.qsize())

    async def flush(self, timeout_s: float) -> FlushResult:
        """Wait until every save begun so far has copied its blocks out and every queued block
        was written or dropped; how the saves since the previous flush ended (``complete``
        False on timeout)."""

        async def drained() -> None:
            await self._idle.wait()
            if self._queue is not None:
                await self._queue.join()

        try:
            await asyncio.wait_for(drained(), timeout_s)
            complete = True
        except TimeoutError:
            complete = False
        return self._tally.take(complete)

    async def close(self) -> None:
        """Stop the writing task (after a flush: what is still queued is dropped)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
