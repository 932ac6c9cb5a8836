"""The engine's KV connector on top of tierkv's store.

- ``lookup``: the prompt's chain hashed once into a :class:`~kvstore.keys.KeyBatch`, one
  store lookup of it under a deadline; the longest prefix present, cut by the cost model to
  what is worth loading. Its record (:class:`~connector.prompt_lookup.PromptLookup`: keys and
  tiers) travels with the request: the engine hands it back to ``load`` and ``save``, which
  take their keys and tiers from it (no second hash, no second lookup).
- ``load``: GETs of whole blocks (one buffer per block, all layers) into staging buffers,
  pipelined in batches; each block is verified before use (key, parent, token ids, checksum —
  by the node or the client) and scattered into the engine's pages. The first block that fails
  for any reason (miss, corrupt, mismatch, timeout, dead node) ends the load: it and every block
  after it are recomputed. Never wrong output.
- ``save``: copies new full blocks out of the pages at once and queues them; a background task
  writes them, so the request never waits. Blocks known to be stored are not sent again; a full
  queue drops writes (counted) rather than stall inference.

All methods run on the engine's event loop; failures inside become misses and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from connector.backends import make_backend
from connector.config import ConnectorConfig
from connector.flush import FlushResult, SaveTally
from connector.metrics import ConnectorMetrics
from connector.policy import CostModel
from connector.prompt_lookup import PromptLookup
from engine.kv_connector import ConnectorContext, ConnectorLookup, ConnectorRequest, KVConnector
from kvstore.client import ConfigError, Expect, Status, StoreClient, make_header
from kvstore.keys import KeyBatch, tokens_le_bytes

log = logging.getLogger("tierkv.connector")

_KNOWN_STORED_MAX = 1 << 16
_GATHER_BYTES = 64 << 20  # a save copies out up to this much per hop to a worker thread (CUDA)


class StoreConnector(KVConnector):
    def __init__(
        self, ctx: ConnectorContext, cfg: ConnectorConfig, backend: StoreClient | None = None
    ) -> None:
        self.ctx, self.cfg = ctx, cfg
        self.block_tokens = cfg.block_tokens or ctx.page_size
        self.lookup_deadline_s = cfg.lookup_deadline_s  # the engine waits at least this long
        if self.block_tokens % ctx.page_size:
            raise ConfigError(
                f"block_tokens {self.block_tokens} is not a multiple of page size {ctx.page_size}"
            )
        self.pages_per_block = self.block_tokens // ctx.page_size
        base_ns = ctx.namespace(self.block_tokens)
        self.base_ns = base_ns
        # A tenant's blocks live in its salted namespace. The salt is a secret the daemons hand
        # out at HELLO (docs/security.md): start() replaces this guess (the tenant's name, right
        # only for daemons without auth.salt_secret_file) with the salt they answer.
        self.ns = base_ns.with_tenant(cfg.tenant) if cfg.tenant else base_ns
        self._salt_learner: asyncio.Task | None = None
        kv = ctx.kv
        self.block_shape = kv.block_shape(self.pages_per_block)
        self.dtype = kv.dtype
        self.dtype_name = str(kv.dtype).removeprefix("torch.")
        self.block_bytes = math.prod(self.block_shape) * torch.empty((), dtype=kv.dtype).element_size()
        self.pin = torch.cuda.is_available() and str(ctx.device).startswith("cuda")
        self.transfer = ctx.transfer
        self.layer_groups = cfg.layer_groups or self.transfer.auto_groups(self.pages_per_block)
        self._releasing: set[asyncio.Task] = set()
        self.backend = backend or make_backend(cfg, base_ns)
        self.cost = CostModel(cfg.prefill_tokens_per_s)
        self.metrics = ConnectorMetrics()
        self._export_store_counters()
        self.metrics.block_bytes.labels(self.dtype_name).set(self.block_bytes)
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._queue: asyncio.Queue | None = None
        self._queued_bytes = 0
        self._space: asyncio.Event | None = None
        self._saver: asyncio.Task | None = None
        self._inflight_saves = 0
        self._saving = 0  # save() calls still copying blocks out
        self._saves_idle = asyncio.Event()
        self._saves_idle.set()
        self._tally = SaveTally()  # how saves ended since the last flush()
        # Staging for loads that cannot read in place, allocated and touched once here: a fresh
        # buffer costs a page fault per 4 KiB on its first fill, which a load should not pay.
        self._staging: list[torch.Tensor] = [
            torch.zeros(self.block_bytes, dtype=torch.uint8, pin_memory=self.pin)
            for _ in range(cfg.load_batch_blocks * cfg.load_parallel)
        ]
        self._register_staging()

    def _register_staging(self) -> None:
        """Offer the staging buffers to the store once, so loads into them may move bytes
        one-sidedly (RDMA); a no-op for a store without a device. A refusal costs only that."""
        try:
            for t in self._staging:
                self.backend.register(t.numpy())
        except Exception as exc:  # the cache path never fails the engine
            log.warning("event=staging_register_failed error=%r", exc)

    def _export_store_counters(self) -> None:
        """The store client's own counters (health ejections, under-replicated writes, ...) on
        the connector's registry, so the engine's /metrics shows them."""
        from kvstore.client import CountersCollector

        self.metrics.registry.register(CountersCollector(lambda: self.backend.counters))

    async def start(self) -> None:
        """At engine start: open the store (local://) or the connections to every daemon
        (kvstore://, etcd://), and start the saver, so the first request pays none of it.
        Never raises for a store problem: a store that is down now is a miss later."""
        self._start_saver()
        deadline = max(self.cfg.lookup_deadline_s, self.cfg.load_deadline_s)
        try:
            await self.backend.start(deadline)
            learned = await self._learn_namespace(deadline)
        except Exception as exc:  # the cache path never fails the engine
            log.warning("event=connector_start_failed error=%r", exc)
            learned = False
        if not learned and self._salt_learner is None:
            # No daemon answered yet: keep asking in the background. Until then keys are
            # computed under the guess, and a store that salts otherwise answers misses.
            self._salt_learner = asyncio.create_task(self._learn_namespace_until_known(deadline))

    async def _learn_namespace(self, deadline_s: float) -> bool:
        """Ask the store how it salts this tenant's namespace; True once it has answered."""
        ns = await self.backend.tenant_namespace(self.base_ns, deadline_s)
        if ns is None:
            return False
        if ns != self.ns:
            log.info("event=connector_namespace_learned")
        self.ns = ns
        return True

    async def _learn_namespace_until_known(self, deadline_s: float, every_s: float = 2.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                if await self._learn_namespace(deadline_s):
                    return
            except Exception as exc:  # the cache path never fails the engine
                log.warning("event=connector_namespace_unknown error=%r", exc)

    def _start_saver(self) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._space = asyncio.Event()
            self._saver = asyncio.create_task(self._save_loop(), name="kv-connector-saver")

    # ------------------------------------------------------------------ helpers
    def _keys_for(self, request: ConnectorRequest, n_blocks: int) -> KeyBatch:
        """The keys of ``request``'s first ``n_blocks`` blocks: its lookup's (the chain hashed
        once), and only blocks past those hashed here, from the last key on. A request without
        a lookup of the current namespace (the tenant's salt learnt since, or no lookup made)
        is hashed here whole."""
        bt = self.block_tokens
        found = request.lookup
        if not isinstance(found, PromptLookup) or found.namespace != self.ns.id.raw:
            return self.ns.key_batch(request.token_ids[: n_blocks * bt])
        have = len(found.keys)
        if have >= n_blocks:
            return found.keys[:n_blocks]
        more = request.token_ids[have * bt : n_blocks * bt]
        return found.keys + self.ns.key_batch(more, found.keys[have - 1] if have else None)

    def _remember(self, d: OrderedDict, key: bytes, value, limit: int) -> None:
        d[key] = value
        d.move_to_end(key)
        while len(d) > limit:
            d.popitem(last=False)

    def _remember_stored(self, raws: list[bytes]) -> None:
        """``raws`` are stored: one C-level update (a key known already keeps its place)."""
        d = self._stored
        d.update(dict.fromkeys(raws))
        for _ in range(len(d) - _KNOWN_STORED_MAX):
            d.popitem(last=False)

    def _buffer(self) -> torch.Tensor:
        if self._staging:
            return self._staging.pop()
        return torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.pin)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine reports measured prefill speed (optional hook)."""
        self.cost.observe_prefill(tokens, seconds)
        self.metrics.prefill_tps.set(self.cost.prefill_tps)

    # ------------------------------------------------------------------ lookup
    async def lookup(self, token_ids: Sequence[int]) -> int:
        return (await self.lookup_result(token_ids)).hit_tokens

    async def lookup_result(self, token_ids: Sequence[int]) -> ConnectorLookup:
        self.metrics.lookups.inc()
        ns = self.ns
        keys = ns.key_batch(token_ids)  # the one hash of this prompt's chain
        if not len(keys):
            return ConnectorLookup(0)
        try:
            found = await asyncio.wait_for(
                self.backend.lookup(keys, self.cfg.lookup_deadline_s), self.cfg.lookup_deadline_s
            )
        except Exception as exc:  # a slow or failed lookup is a miss
            log.debug("event=lookup_failed error=%r", exc)
            self.metrics.fallbacks.labels("lookup_timeout").inc()
            return ConnectorLookup(0, PromptLookup(ns.id.raw, keys))
        held = np.flatnonzero(np.frombuffer(found.tiers, dtype=np.uint8))
        if len(held):
            self._remember_stored(keys.take(held).raws())
        record = PromptLookup.of(ns.id.raw, found, remote=not self.backend.in_process)
        hit = found.hit_blocks
        if hit == 0:
            return ConnectorLookup(0, record)
        tiers = list(record.tiers)
        for t in set(tiers):
            self.metrics.lookup_hit_tokens.labels(t).inc(self.block_tokens * tiers.count(t))
        if self.cfg.policy == "never":
            return ConnectorLookup(0, record)
        if self.cfg.policy == "always":
            return ConnectorLookup(hit * self.block_tokens, record)
        d = self.cost.decide(tiers, self.block_bytes, self.block_tokens)
        log.debug(
            "event=load_decision hit_blocks=%d load_blocks=%d est_load_s=%.4f est_recompute_s=%.4f prefill_tps=%.0f",
            d.hit_blocks,
            d.load_blocks,
            d.load_s,
            d.recompute_s,
            self.cost.prefill_tps,
        )
        if d.load_blocks < hit:
            self.metrics.policy_skipped_tokens.inc((hit - d.load_blocks) * self.block_tokens)
        return ConnectorLookup(d.load_blocks * self.block_tokens, record)

    # ------------------------------------------------------------------ load
    async def load(self, request: ConnectorRequest, page_ids: Sequence[int]) -> int:
        bt, ppb = self.block_tokens, self.pages_per_block
        first = request.first_token // bt
        n = len(page_ids) // ppb
        if request.first_token % bt or n == 0:
            return 0
        chain = self._keys_for(request, first + n)  # the lookup's keys: no second hash
        keys = chain[first:]
        n = min(n, len(keys))
        found = request.lookup
        tiers = found.tiers_of(first, n) if isinstance(found, PromptLookup) else [None] * n
        t0 = time.perf_counter()
        done = 0
        cause = None
        batches = [
            range(i, min(i + self.cfg.load_batch_blocks, n)) for i in range(0, n, self.cfg.load_batch_blocks)
        ]
        sem = asyncio.Semaphore(self.cfg.load_parallel)
        held: dict[int, Callable[[], None]] = {}  # batch start -> gives its buffers back

        async def fetch(batch: range):
            """GET one batch: (payload buffers, results, seconds, in place). Zero-copy views
            of the store's slots when it shares this process, else staging buffers; either
            way ``held[batch start]`` gives them back."""
            async with sem:
                exp = []
                for j in batch:
                    g = first + j
                    parent = chain[g - 1] if g > 0 else self.ns.id
                    exp.append(Expect(parent, tokens_le_bytes(request.token_ids[g * bt : (g + 1) * bt])))
                bkeys = [keys[j] for j in batch]
                ts = time.perf_counter()
                got = (
                    await self.backend.get_views(bkeys, exp, self.cfg.load_deadline_s)
                    if self.backend.in_process
                    else None
                )
                if got is not None:
                    res, views, release = got
                    held[batch[0]] = release
                    return [_as_tensor(v) for v in views], res, time.perf_counter() - ts, True
                b = [self._buffer() for _ in batch]
                held[batch[0]] = lambda: self._staging.extend(b)
                res = await self.backend.get_into(
                    bkeys, [t.numpy() for t in b], exp, self.cfg.load_deadline_s
                )
                return b, res, time.perf_counter() - ts, False

        # Verified blocks wait here for their copy into the pages. Blocks read in place (the
        # store's own slots) are copied all at once at the end; blocks in staging buffers (a
        # daemon's, or the local disk's) batch by batch, so the next batch's GET overlaps this
        # one's copy and the staging buffers come back for later batches. Either way in layer
        # groups: the step after the load computes group g while group g + 1 still arrives
        # (earlier batches' copies finished while later GETs were on the wire).
        ready: list[tuple[Sequence[int], torch.Tensor]] = []
        releases: list[Callable[[], None]] = []
        copied = 0  # blocks whose copy was enqueued (complete on CPU)

        def copy_ready(groups: int) -> None:
            nonlocal copied
            if ready:
                pending = self.transfer.scatter(ready, groups)
                copied += len(ready)
                ready.clear()
            else:
                pending = None
            if releases:
                self._release_after(pending, list(releases))
                releases.clear()

        tasks = [asyncio.ensure_future(fetch(batch)) for batch in batches]
        try:
            # No deadline on the whole load: each GET batch has its own (load_deadline_s), so a
            # dead or hung node costs at most one deadline while a slow-but-moving load goes on.
            for batch, task in zip(batches, tasks):
                b, res, secs, in_place = await task
                nbytes = 0
                for j, buf, r in zip(batch, b, res):
                    if r.status is not Status.HIT:
                        cause = r.status.name.lower()
                        break
                    if r.header is not None and r.header.payload_len != self.block_bytes:
                        cause = "mismatch"  # a block of another shape under this key: never used
                        break
                    block = buf[: self.block_bytes].view(self.dtype).view(self.block_shape)
                    ready.append((page_ids[j * ppb : (j + 1) * ppb], block))
                    nbytes += self.block_bytes
                    self.metrics.hit_tokens.labels(tiers[j] or r.tier or "unknown").inc(bt)
                releases.append(held.pop(batch[0]))
                if not in_place:
                    copy_ready(self.layer_groups)
                self.metrics.bytes_loaded.inc(nbytes)
                if nbytes and tiers[batch[0]]:
                    self.cost.observe_load(tiers[batch[0]], nbytes, secs)
                    self.metrics.tier_bandwidth.labels(tiers[batch[0]]).set(self.cost.bw(tiers[batch[0]]))
                if cause:
                    break
            copy_ready(self.layer_groups)
        except Exception as exc:  # never an exception to the engine: recompute the rest
            log.warning("event=load_failed request=%s error=%r", request.request_id, exc)
            cause = "error"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            releases.extend(held.values())
            self._release_after(None, releases)  # after the copies already enqueued, see below
        done = copied
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

    def _release_after(self, pending, releases: list[Callable[[], None]]) -> None:
        """Give buffers back once the copies reading them finished: now on CPU (or with
        nothing copied), else from a task that polls the copy events. Copies are enqueued in
        order on one stream, so any copy enqueued before this call is covered by waiting for
        the last pending load."""
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

    # ------------------------------------------------------------------ save
    async def save(self, request: ConnectorRequest, page_ids: Sequence[int]) -> None:
        if not self.cfg.save:
            return
        self._saving += 1  # flush() waits for saves still copying out, not only the queue
        self._saves_idle.clear()
        try:
            await self._save(request, page_ids)
        finally:
            self._saving -= 1
            if not self._saving:
                self._saves_idle.set()

    async def _save(self, request: ConnectorRequest, page_ids: Sequence[int]) -> None:
        bt, ppb = self.block_tokens, self.pages_per_block
        n = len(page_ids) // ppb
        keys = self._keys_for(request, n)  # the lookup's keys: no second hash
        self._start_saver()
        deadline = time.monotonic() + self.cfg.save_deadline_s
        parent = self.ns.id
        gathered: dict[int, torch.Tensor] = {}
        for j, key in enumerate(keys):
            if key.raw not in self._stored:
                # Bounded in bytes: wait for the saver to make room (the engine holds these
                # pages meanwhile, inference goes on), and drop the rest past the deadline.
                while (
                    self._queued_bytes and self._queued_bytes + self.block_bytes > self.cfg.save_queue_bytes
                ):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._space.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._space.wait(), left)
                if self._queued_bytes and self._queued_bytes + self.block_bytes > self.cfg.save_queue_bytes:
                    n_drop = sum(1 for k in keys[j:] if k.raw not in self._stored)
                    self.metrics.dropped_saves.labels("queue_full").inc(n_drop)
                    self._tally.add("dropped", "queue_full", n_drop)
                    break
                if j not in gathered:
                    gathered = await self._gather_from(j, keys, page_ids)
                block = gathered.pop(j)
                payload = block.view(torch.uint8).reshape(-1).numpy()
                h = make_header(
                    key=key,
                    parent=parent,
                    namespace=self.ns.id,
                    tokens=request.token_ids[j * bt : (j + 1) * bt],
                    dtype=self.dtype_name,
                    shape=self.block_shape,
                    payload=payload,
                )
                self._queue.put_nowait((h, payload))
                self._queued_bytes += self.block_bytes
                self._remember(self._stored, key.raw, None, _KNOWN_STORED_MAX)  # in flight counts as stored
                if j % 8 == 7:
                    await asyncio.sleep(0)  # long prompts: let the saver and the engine loop run
            parent = key
        self.metrics.save_queue.set(self._queue.qsize())

    async def _gather_from(self, j: int, keys: KeyBatch, page_ids: Sequence[int]) -> dict[int, torch.Tensor]:
        """Copy out block ``j`` and the next not-yet-stored blocks, up to _GATHER_BYTES (at
        least one block): on CUDA in one hop to a worker thread (the copies block their
        thread), not one hop per block."""
        ppb = self.pages_per_block
        most = max(1, _GATHER_BYTES // self.block_bytes)
        idx = [i for i in range(j, len(keys)) if i == j or keys[i].raw not in self._stored][:most]

        def gather() -> dict[int, torch.Tensor]:
            return {i: self.transfer.gather(page_ids[i * ppb : (i + 1) * ppb]) for i in idx}

        return await asyncio.to_thread(gather) if self.transfer.cuda else gather()

    async def _save_loop(self) -> None:
        q = self._queue
        while True:
            batch = [await q.get()]
            while not q.empty() and len(batch) < 16:
                batch.append(q.get_nowait())
            self._inflight_saves = len(batch)
            try:
                report = await self.backend.put(batch, self.cfg.save_deadline_s)
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
            self._inflight_saves = 0
            self._queued_bytes -= len(batch) * self.block_bytes
            self._space.set()
            for _ in batch:
                q.task_done()
            self.metrics.save_queue.set(q.qsize())

    async def flush(self, timeout_s: float = 30.0) -> FlushResult:
        """Wait until every save begun so far has copied its blocks out and every queued block
        was written or dropped; return how the saves since the previous flush ended (saved,
        dropped, failed; ``complete`` False on timeout). Callers that need the blocks stored
        (demo, benchmarks) must check it: ``bool(result)`` is True only when all were saved."""

        async def drained() -> None:
            await self._saves_idle.wait()
            if self._queue is not None:
                await self._queue.join()

        try:
            await asyncio.wait_for(drained(), timeout_s)
            complete = True
        except TimeoutError:
            complete = False
        return self._tally.take(complete)

    async def close(self) -> None:
        await self.flush(self.cfg.save_deadline_s)
        if self._releasing:  # buffers still being copied from: let those copies finish
            await asyncio.gather(*self._releasing, return_exceptions=True)
        for task in (self._saver, self._salt_learner):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.backend.close()


def _as_tensor(view) -> torch.Tensor | None:
    """A uint8 tensor over a (read-only) payload view, without a copy. The scatter only reads it."""
    if view is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is read-only
        return torch.frombuffer(view, dtype=torch.uint8)
