"""The connector's loader: blocks from the store into the engine's pages, pipelined, verified.

Contract of :meth:`Loader.load` (``request``, its ``page_ids`` from ``request.first_token``,
the request's chain ``keys``):

- Blocks are read in batches of ``load_batch_blocks``, ``load_parallel`` batches in flight,
  each through the store's one read (``StoreClient.read``: in process the DRAM slots are lent,
  else the loader's staging buffers are filled), each batch under ``load_deadline_s``: a dead
  or hung node costs at most one deadline while a slow-but-moving load goes on.
- Each block is verified before use (key, parent, token ids, checksum, by the store; its
  payload length here) and copied into its pages as its batch arrives (``ctx.transfer``, in
  layer groups), so the next batch's read overlaps this one's copy.
- The first block that fails for any reason (miss, corrupt, mismatch, timeout, dead node)
  ends the load: it and every block after it are recomputed. The answer is the tokens loaded
  (whole blocks, in order); never an exception, never wrong output.
- A read's lent views and staging buffers are given back only once the copies reading them
  finished (on CUDA from a task that waits for their events): a slot is never reused while
  bytes still move out of it.

Owns the staging buffers (allocated and touched once, registered with the store once); runs on
the engine's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from connector.config import ConnectorConfig
from connector.metrics import ConnectorMetrics
from connector.policy import CostModel
from kvstore.client import Expect, Status, StoreClient
from kvstore.keys import BlockKey, KeyBatch, tokens_le_bytes

log = logging.getLogger("tierkv.connector")


class Loader:
    """See the module docstring. ``block`` is (shape, dtype, bytes) of one block of
    ``block_tokens`` tokens in ``pages_per_block`` pages."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        store: Callable[[], StoreClient],
        transfer,
        block_tokens: int,
        pages_per_block: int,
        block: tuple[tuple[int, ...], torch.dtype, int],
        pin: bool,
        layer_groups: int,
        cost: CostModel,
        metrics: ConnectorMetrics,
    ) -> None:
        self.cfg, self.store, self.transfer = cfg, store, transfer
        self.block_tokens, self.pages_per_block = block_tokens, pages_per_block
        self.block_shape, self.dtype, self.block_bytes = block
        self.pin, self.layer_groups = pin, layer_groups
        self.cost, self.metrics = cost, metrics
        self._releasing: set[asyncio.Task] = set()
        # A fresh buffer costs a page fault per 4 KiB on its first fill, which a load should
        # not pay: enough for every batch in flight, allocated and touched once here.
        self._staging: list[torch.Tensor] = [
            torch.zeros(self.block_bytes, dtype=torch.uint8, pin_memory=pin)
            for _ in range(cfg.load_batch_blocks * cfg.load_parallel)
        ]

    def register_staging(self) -> None:
        """Offer the staging buffers to the store once, so reads into them may move bytes
        one-sidedly (RDMA); a no-op for a store without a device. A refusal costs only that."""
        try:
            for t in self._staging:
                self.store().register(t.numpy())
        except Exception as exc:  # the cache path never fails the engine
            log.warning("event=staging_register_failed error=%r", exc)

    def _buffers(self, n: int) -> list[torch.Tensor]:
        take = [self._staging.pop() for _ in range(min(n, len(self._staging)))]
        more = n - len(take)
        return take + [
            torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.pin) for _ in range(more)
        ]

    async def _fetch(self, request, keys: KeyBatch, first: int, batch: range, parent0: BlockKey, sem):
        """Read one batch: (its read, its staging buffers, seconds)."""
        lo, hi = first + batch.start, first + batch.stop
        step = self.block_tokens * 4  # bytes of one block's token ids
        async with sem:
            toks = tokens_le_bytes(request.token_ids[lo * self.block_tokens : hi * self.block_tokens])
            exp = [
                Expect(keys[g - 1] if g > 0 else parent0, toks[(g - lo) * step : (g - lo + 1) * step])
                for g in range(lo, hi)
            ]
            bufs = self._buffers(len(batch))
            ts = time.perf_counter()
            try:
                read = await self.store().read(
                    keys[lo:hi],
                    [t.numpy() for t in bufs],
                    exp,
                    self.cfg.load_deadline_s,
                )
            except BaseException:
                self._staging.extend(bufs)
                raise
            return read, bufs, time.perf_counter() - ts

    async def load(
        self, request, page_ids: Sequence[int], keys: KeyBatch, tiers: list[str | None], parent0: BlockKey
    ) -> int:
        """Load blocks ``request.first_token // block_tokens ..`` of ``keys`` into ``page_ids``
        (``tiers``: the lookup's tier per block, None where unknown; ``parent0``: the
        namespace id, the first block's parent). See the module docstring."""
        bt, ppb = self.block_tokens, self.pages_per_block
        first = request.first_token // bt
        n = min(len(page_ids) // ppb, len(keys) - first)
        if request.first_token % bt or n <= 0:
            return 0
        t0 = time.perf_counter()
        step = self.cfg.load_batch_blocks
        batches = [range(i, min(i + step, n)) for i in range(0, n, step)]
        sem = asyncio.Semaphore(self.cfg.load_parallel)
        tasks = [asyncio.ensure_future(self._fetch(request, keys, first, b, parent0, sem)) for b in batches]
        done, cause, used = 0, None, 0
        releases: list[Callable[[], None]] = []
        try:
            for batch, task in zip(batches, tasks):
                read, bufs, secs = await task
                used += 1
                releases.append(_giver(read, bufs, self._staging))
                ready, cause = self._verified(read, bufs, batch, page_ids, tiers)
                if ready:
                    pending = self.transfer.scatter(ready, self.layer_groups)
                    done += len(ready)
                    self._release_after(pending, releases)
                    releases = []
                self._observe(len(ready) * self.block_bytes, tiers[batch.start], secs)
                if cause:
                    break
        except Exception as exc:  # never an exception to the engine: recompute the rest
            log.warning("event=load_failed request=%s error=%r", request.request_id, exc)
            cause = "error"
        finally:
            for t in tasks[used:]:
                t.cancel()
            got = await asyncio.gather(*tasks[used:], return_exceptions=True)
            releases += [_giver(r[0], r[1], self._staging) for r in got if isinstance(r, tuple)]
            self._release_after(None, releases)  # after the copies already enqueued
        if cause:
            self.metrics.fallbacks.labels(cause).inc(n - done)
            log.info(
                "event=load_partial request=%s loaded_blocks=%d of=%d cause=%s",
                request.request_id,
                done,
                n,
                cause,
            )
        self.metrics.load_seconds.observe(time.perf_counter() - t0)
        return done * bt

    def _verified(self, read, bufs, batch: range, page_ids, tiers) -> tuple[list, str | None]:
        """The batch's leading verified blocks as ``(pages, block)``; why it stopped, if it did."""
        ppb = self.pages_per_block
        ready, hit_tiers, cause = [], Counter(), None
        for k, (j, r) in enumerate(zip(batch, read.results)):
            if r.status is not Status.HIT:
                cause = r.status.name.lower()
                break
            if r.header is not None and r.header.payload_len != self.block_bytes:
                cause = "mismatch"  # a block of another shape under this key: never used
                break
            src = _as_tensor(read.views[k]) if read.lent[k] else bufs[k]
            block = src[: self.block_bytes].view(self.dtype).view(self.block_shape)
            ready.append((page_ids[j * ppb : (j + 1) * ppb], block))
            hit_tiers[tiers[j] or r.tier or "unknown"] += 1
        for tier, n in hit_tiers.items():  # one metric update per tier and batch, not per block
            self.metrics.hit_tokens.labels(tier).inc(n * self.block_tokens)
        return ready, cause

    def _observe(self, nbytes: int, tier: str | None, secs: float) -> None:
        self.metrics.bytes_loaded.inc(nbytes)
        if nbytes and tier:
            self.cost.observe_load(tier, nbytes, secs)
            self.metrics.tier_bandwidth.labels(tier).set(self.cost.bw(tier))

    def _release_after(self, pending, releases: list[Callable[[], None]]) -> None:
        """Give reads and buffers back once the copies reading them finished: now on CPU (or
        with nothing copied), else from a task that waits for the copy events. Copies are
        enqueued in order on one stream, so any copy enqueued before this call is covered by
        waiting for the last pending load."""
        if not releases:
            return
        if pending is None:
            pending = self.transfer.last_pending()
        if pending is None or pending.done():
            for release in releases:
                release()
            return

        async def later() -> None:
            try:
                await pending.wait()
            finally:
                for release in releases:
                    release()

        task = asyncio.get_running_loop().create_task(later())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def close(self) -> None:
        """Wait for the copies still reading lent views or staging buffers."""
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)


def _giver(read, bufs: list[torch.Tensor], pool: list[torch.Tensor]) -> Callable[[], None]:
    """What gives one batch back: its read's lent views to the store, its buffers to the pool."""

    def give() -> None:
        read.release()
        pool.extend(bufs)

    return give


def _as_tensor(view) -> torch.Tensor:
    """A uint8 tensor over a (read-only) lent payload view, without a copy. The copy only reads it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is read-only
        return torch.frombuffer(view, dtype=torch.uint8)
