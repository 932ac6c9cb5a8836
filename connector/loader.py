"""The connector's loader: blocks from the store into the engine's pages, pipelined, verified.

Contract of :meth:`Loader.load` (``request``, its ``page_ids`` from ``request.first_token``,
the request's chain ``keys``):

- Blocks are read in batches of ``load_batch_blocks``, or with 0 (the default) of what a read
  finishes in half of ``load_deadline_s`` at the larger of ``load_floor_bandwidth`` and the
  read bandwidth last measured (bytes of its leading hits over the seconds the read itself
  took; forgotten after a read that ran out its deadline): at least one block, at most
  ``AUTO_BATCH_BYTES``. A fast link gets large batches from its second read on, a slow one
  batches that end within their deadline. ``load_parallel`` reads in flight and one more batch being copied (a
  batch holds its staging slot until its copy ended), each through the store's
  one read (``StoreClient.read``: in process the DRAM slots are lent, else a staging slot is
  filled), each batch under ``load_deadline_s`` (its wait for a staging slot included, see
  ``load_staging_bytes``): a dead or hung node costs at most one deadline
  while a slow-but-moving load goes on. Few large reads, not many small ones: a batch is one
  request per node, which the store client streams over its connections.
- Each block is verified before use (key, parent, token ids, checksum, by the store; its
  payload length here) and its batch is copied into its pages as it arrives
  (``ctx.transfer``, in layer groups): on CPU on the loader's copy thread, so the next batches'
  reads go on while this one is copied; on CUDA the copies are enqueued on the copy stream.
- The first block that fails for any reason (miss, corrupt, mismatch, timeout, dead node)
  ends the load: it and every block after it are recomputed. The answer is the tokens loaded
  (whole blocks, in order); never an exception, never wrong output. On CPU every copy has
  finished when the load returns (cancelled too: it waits for the copy under way).
- A read's lent views and staging slot are given back only once the copies reading them
  finished (on CUDA from a task that waits for their events): a slot is never reused while
  bytes still move out of it. A batch that fails between its read and its copy (a view that
  does not fit, a copy that cannot be enqueued or started) is given back there and then (on
  CUDA after what a broken-off copy enqueued), and the load ends as for any other failure.

Owns the staging slots (connector/staging.py: allocated and touched once, registered with the
store once) and the copy thread; runs on the engine's event loop. One file (~400 lines) on
purpose: the batch pipeline, the slot hand-back and the copy ordering above are one contract
whose every path ends in "give the slot back, recompute the rest"; split, the hand-back rules
would live apart from the paths that must follow them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from connector.config import ConnectorConfig
from connector.metrics import ConnectorMetrics
from connector.policy import CostModel
from connector.staging import StagingFull, StagingPool, StagingSlot
from kvstore.client import Expect, Status, StoreClient
from kvstore.keys import BlockKey, KeyBatch, tokens_le_bytes

log = logging.getLogger("tierkv.connector")

# load_batch_blocks = 0: a batch of at most this many bytes. Measured on the 2-core CPU host
# (docs/benchmarks.md, TTFT): a remote load of 368 MB cost the client 142 ms of CPU for one
# raw GET, 181 ms in batches of 128 MiB, 208 ms of 64 MiB, 228 ms of 32 MiB (each read's
# per-request work on top of the copy into pages): where the cores are busy moving the bytes,
# overlapping the copy wins less than fewer reads save. On CUDA the last batch's host-to-device
# copy is the part of a load not overlapped with its reads (not measured at this size here).
AUTO_BATCH_BYTES = 128 << 20


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
        self.layer_groups = layer_groups
        self.cost, self.metrics = cost, metrics
        self.batch_blocks = cfg.load_batch_blocks or max(1, AUTO_BATCH_BYTES // self.block_bytes)
        # Bytes/s one read moved, last measured (None: not yet, or the last read ran out its
        # deadline). Not the cost model's per-tier figure: that starts from a prior and keeps
        # its estimate through a timeout, where batch sizing must fall back to the floor.
        self.read_bps: float | None = None
        self._releasing: set[asyncio.Task] = set()
        # A fresh buffer costs a page fault per 4 KiB on its first fill, which a load should
        # not pay: a slot for every read in flight and one being copied, allocated once here
        # (a load holds at most that many).
        slot_bytes = self.batch_blocks * self.block_bytes
        self.staging = StagingPool(
            cfg.load_parallel + 1,
            cfg.load_staging_bytes // slot_bytes,  # never below the up-front slots
            self.batch_blocks,
            self.block_bytes,
            self.block_shape,
            self.dtype,
            pin,
        )
        # CPU copies are memcpys (torch releases the GIL): on a thread of their own they overlap
        # the next reads. One thread keeps a load's copies in order.
        self._copier = None if transfer.cuda else ThreadPoolExecutor(1, thread_name_prefix="tierkv-load-copy")

    def register_staging(self) -> None:
        """Offer the staging slots to the store once, so reads into them may move bytes
        one-sidedly (RDMA); a no-op for a store without a device. A refusal costs only that."""
        try:
            self.staging.register(self.store().register)
        except Exception as exc:  # the cache path never fails the engine
            log.warning("event=staging_register_failed error=%r", exc)

    async def _fetch(
        self, request, keys: KeyBatch, first: int, batch: range, parent0: BlockKey, reading, held
    ):
        """Read one batch: (its read, its staging slot, seconds in all, seconds of the read
        itself)."""
        lo, hi = first + batch.start, first + batch.stop
        step = self.block_tokens * 4  # bytes of one block's token ids
        await held.acquire()  # released when the batch's slot is given back (its copy ended)
        toks = tokens_le_bytes(request.token_ids[lo * self.block_tokens : hi * self.block_tokens])
        exp = [
            Expect(keys[g - 1] if g > 0 else parent0, toks[(g - lo) * step : (g - lo + 1) * step])
            for g in range(lo, hi)
        ]
        ts = time.perf_counter()
        try:
            # concurrent loads past load_staging_bytes wait for a slot: the wait and the read
            # share one deadline
            slot = await self.staging.take(self.cfg.load_deadline_s)
        except BaseException:
            held.release()
            raise
        waited = time.perf_counter() - ts  # for the slot (not for the reads before this one)
        try:
            async with reading:
                tr = time.perf_counter()
                left = self.cfg.load_deadline_s - waited
                if left <= 0:
                    raise StagingFull(f"no time left to read after {waited:.3f} s waiting for a staging slot")
                read = await self.store().read(keys[lo:hi], slot.rows[: hi - lo], exp, left)
        except BaseException:
            self.staging.give(slot)
            held.release()
            raise
        now = time.perf_counter()
        return read, slot, now - ts, now - tr

    def _next_batch(self) -> int:
        """Blocks of the next batch (the module docstring's rule)."""
        if self.cfg.load_batch_blocks:
            return self.batch_blocks
        # Never below the floor: a small read's latency makes a fast link look slow, and a
        # link that moved the first, floor-sized batch in time moves every later one in time.
        bps = max(self.cfg.load_floor_bandwidth, self.read_bps or 0.0)
        fits = int(bps * self.cfg.load_deadline_s / 2) // self.block_bytes
        return max(1, min(self.batch_blocks, fits))

    def _measured(self, cause: str | None, hits: int, read_secs: float) -> None:
        """Follow one read's bandwidth: its ``hits`` leading blocks over its own seconds; a
        read that ran out its deadline (``cause``) sends the next batches back to the floor."""
        if cause == "timeout":
            self.read_bps = None
        elif hits and read_secs > 0:
            self.read_bps = hits * self.block_bytes / read_secs

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
        # load_parallel reads in flight; a batch holds its slot (and its place) until its copy ended
        reading, held = (
            asyncio.Semaphore(self.cfg.load_parallel),
            asyncio.Semaphore(self.cfg.load_parallel + 1),
        )
        batches: list[range] = []
        tasks: list[asyncio.Future] = []

        def launch() -> None:
            """Start the next batch's read, sized now (from the reads measured so far)."""
            lo = batches[-1].stop if batches else 0
            if lo < n:
                batches.append(range(lo, min(n, lo + self._next_batch())))
                tasks.append(
                    asyncio.ensure_future(
                        self._fetch(request, keys, first, batches[-1], parent0, reading, held)
                    )
                )

        for _ in range(self.cfg.load_parallel):
            launch()
        done, cause, used = 0, None, 0
        # CPU copies under way: (future, blocks, their hits per tier: counted once it ended well)
        copies: list[tuple[Future, int, Counter]] = []
        try:
            while used < len(tasks):
                batch, task = batches[used], tasks[used]
                read, slot, secs, read_secs = await task
                used += 1
                give = _giver(read, slot, self.staging, held)
                try:
                    ready, cause, hit_tiers = self._verified(read, slot, batch, page_ids, tiers)
                    self._measured(cause, len(ready), read_secs)
                    if not cause:
                        launch()  # its read goes on while this batch is copied
                    copy = functools.partial(self._scatter, ready, slot, not any(read.lent[: len(ready)]))
                    if not ready:
                        give()
                    elif self._copier is None:
                        pending = copy()
                        done += len(ready)
                        self._release_after(pending, give)
                        self._count_hits(hit_tiers)  # enqueued: a failure to enqueue raised above
                    else:
                        copies.append((self._copy(copy, give), len(ready), hit_tiers))
                except BaseException:
                    # Not handed on: give the batch back here (once; a give already handed on
                    # is a no-op), on CUDA after whatever a broken-off copy enqueued from it.
                    if self._copier is None:
                        self._release_after(self.transfer.last_pending(), give)
                    else:
                        give()
                    raise
                self._observe(len(ready) * self.block_bytes, tiers[batch.start], secs)
                if cause:
                    break
        except Exception as exc:  # never an exception to the engine: recompute the rest
            log.warning("event=load_failed request=%s error=%r", request.request_id, exc)
            cause = "error"
        finally:
            for t in tasks[used:]:
                t.cancel()
            try:
                ended_well, failed = await _settle(copies)  # the pages are written when load returns
            finally:  # cancelled too: reads done but not used give their slots and leases back
                got = await asyncio.gather(*tasks[used:], return_exceptions=True)
                for r in got:
                    if isinstance(r, tuple):
                        _giver(r[0], r[1], self.staging, held)()
            for _, blocks, hit_tiers in copies[:ended_well]:
                done += blocks
                self._count_hits(hit_tiers)
            if failed is not None:
                log.warning("event=load_copy_failed request=%s error=%r", request.request_id, failed)
                cause = cause or "error"
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

    def _count_hits(self, hit_tiers: Counter) -> None:
        """Count a batch's blocks as hit tokens, per tier (one update per tier and batch)."""
        for tier, k in hit_tiers.items():
            self.metrics.hit_tokens.labels(tier).inc(k * self.block_tokens)

    def _scatter(self, ready: list, slot: StagingSlot, filled: bool):
        """Copy ``ready`` (a batch's leading blocks) into their pages: from the slot the read
        ``filled`` as one stacked tensor (one copy for the batch), else block by block (lent views)."""
        if filled:
            return self.transfer.scatter_stacked(
                [p for p, _ in ready], slot.first(len(ready)), self.layer_groups
            )
        return self.transfer.scatter(ready, self.layer_groups)

    def _copy(self, copy: Callable[[], object], give: Callable[[], None]) -> Future:
        """Run ``copy`` on the copy thread; ``give`` runs on the loop once the copy ended (or was
        cancelled before it began): only then is its slot free."""
        loop = asyncio.get_running_loop()
        fut = self._copier.submit(copy)
        fut.add_done_callback(lambda _: loop.call_soon_threadsafe(give))
        return fut

    def _verified(
        self, read, slot: StagingSlot, batch: range, page_ids, tiers
    ) -> tuple[list, str | None, Counter]:
        """The batch's leading verified blocks as ``(pages, block)``; why it stopped, if it did;
        how many of them came from each tier (counted as hits once their copy ended well)."""
        ppb = self.pages_per_block
        ready, hit_tiers, cause = [], Counter(), None
        for k, (j, r) in enumerate(zip(batch, read.results)):
            if r.status is not Status.HIT:
                cause = r.status.name.lower()
                break
            if r.header is not None and r.header.payload_len != self.block_bytes:
                cause = "mismatch"  # a block of another shape under this key: never used
                break
            if read.lent[k]:
                block = _as_tensor(read.views[k]).view(self.dtype).view(self.block_shape)
            else:
                block = slot.block(k)
            ready.append((page_ids[j * ppb : (j + 1) * ppb], block))
            hit_tiers[tiers[j] or r.tier or "unknown"] += 1
        return ready, cause, hit_tiers

    def _observe(self, nbytes: int, tier: str | None, secs: float) -> None:
        self.metrics.bytes_loaded.inc(nbytes)
        if nbytes and tier:
            self.cost.observe_load(tier, nbytes, secs)
            self.metrics.tier_bandwidth.labels(tier).set(self.cost.bw(tier))

    def _release_after(self, pending, give: Callable[[], None]) -> None:
        """CUDA: give a read and its slot back once the copies reading them finished, from a
        task that waits for the copy events (now when they already did)."""
        if pending is None or pending.done():
            give()
            return

        async def later() -> None:
            try:
                await pending.wait()
            finally:
                give()

        task = asyncio.get_running_loop().create_task(later())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def close(self) -> None:
        """Wait for the copies still reading lent views or staging slots; stop the copy thread."""
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)
        if self._copier is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._copier.shutdown, True)
            await asyncio.sleep(0)  # the last copies' give-backs, scheduled from the thread


async def _settle(copies: list[tuple[Future, int, Counter]]) -> tuple[int, BaseException | None]:
    """Wait until every copy of ``copies`` (in order) ended, even when cancelled meanwhile (its
    pages and slot are busy until then); then re-raise the cancellation. Answers how many
    leading copies succeeded and the first failure, if any."""
    cancelled = False
    for fut, _, _ in copies:
        while not fut.done():
            try:
                await asyncio.shield(asyncio.wrap_future(fut))
            except asyncio.CancelledError:
                cancelled = True
            except Exception:
                break  # done, with an exception: read below
    if cancelled:
        raise asyncio.CancelledError
    for i, (fut, _, _) in enumerate(copies):
        exc = fut.exception()
        if exc is not None:
            return i, exc
    return len(copies), None


def _giver(read, slot: StagingSlot, pool: StagingPool, held: asyncio.Semaphore) -> Callable[[], None]:
    """What gives one batch back: its read's lent views to the store, its slot to the pool, its
    place among the load's batches held to the next read. Only its first call does (a batch
    is given back once, whichever path gets there first)."""
    given = []

    def give() -> None:
        if given:
            return
        given.append(True)
        try:
            read.release()
        finally:
            pool.give(slot)
            held.release()

    return give


def _as_tensor(view) -> torch.Tensor:
    """A uint8 tensor over a (read-only) lent payload view, without a copy. The copy only reads it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is read-only
        return torch.frombuffer(view, dtype=torch.uint8)
