"""Copies between host block buffers and the KV pages, kept off the compute path.

On CUDA every connector copy runs on one side stream (the copy stream). A load enqueues its
host-to-device copies there and returns at once with a :class:`PendingLoad` holding one CUDA
event per layer; the model runner makes the compute stream wait on layer ``l``'s event just
before layer ``l`` (:meth:`KVTransfer.step_barrier`), so the host never blocks and, when the
load is layer-wise (all blocks' layer 0, then all blocks' layer 1, ...), layer ``l + 1`` is
still arriving while layer ``l`` computes. A save copies pages out on the same stream.

On CPU the copies are plain synchronous memcpys on the calling thread: there is no second
engine to overlap them with, and a load is complete when :meth:`KVTransfer.scatter` returns.

No wait on the compute stream is needed before either direction: the engine hands a load
pages no step is using (fresh allocations; pages are freed only after the step that used
them returned to the host), and a save pages whose step already returned.

Thread-safety: ``scatter`` / ``gather`` run on the connector's threads (event loop or a
worker), ``step_barrier`` on the step thread; the pending list is guarded by a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from engine.kv_cache import KVCache


def layer_groups(num_layers: int, groups: int) -> list[range]:
    """``num_layers`` split into ``min(groups, num_layers)`` contiguous ranges of near-equal size."""
    g = max(1, min(groups, num_layers))
    cuts = [round(i * num_layers / g) for i in range(g + 1)]
    return [range(cuts[i], cuts[i + 1]) for i in range(g)]


AUTO_GROUPS = 4
AUTO_GROUP_MIN_BYTES = 4 << 20
# A staged scatter moves at most this many bytes per device staging buffer.
STAGING_BYTES = 256 << 20


class PendingLoad:
    """The copies of one load. ``events[l]`` completes when layer ``l`` of every block is in
    its pages (None on CPU: the copies are already done)."""

    def __init__(self, events: list | None) -> None:
        self.events = events

    def done(self) -> bool:
        """True once every copy finished (the host buffers may be reused). Never blocks."""
        return self.events is None or self.events[-1].query()

    async def wait(self, poll_s: float = 0.0005) -> None:
        """Until :meth:`done`, without blocking the event loop."""
        while not self.done():
            await asyncio.sleep(poll_s)


class KVTransfer:
    """The engine's one copy path for connector loads and saves (see module docstring)."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.cuda = kv.data.is_cuda
        self.stream = torch.cuda.Stream(device=kv.data.device) if self.cuda else None
        self._pending: list[PendingLoad] = []
        self._lock = threading.Lock()
        # scatters by the number of layer groups they were cut into (what loads really did)
        self.scatter_groups: Counter[int] = Counter()
        self.last_groups = 1  # the latest scatter's group count (step_groups without a pending load)

    def auto_groups(self, pages_per_block: int) -> int:
        """Layer groups a load uses when the connector is not told. Measured on an H200 with a
        32K-token Llama-3.1-8B-shaped hit from pinned DRAM (docs/benchmarks.md, "GPU"):
        256-token blocks in 4 groups 123 ms, whole 271-343 ms, 32 groups 154-179 ms. So on
        CUDA 4 groups once a group of one block is at least AUTO_GROUP_MIN_BYTES; otherwise
        (small blocks: not measured to pay; CPU: nothing to overlap with) whole blocks."""
        block = self.kv.page_bytes * pages_per_block
        return AUTO_GROUPS if self.cuda and block // AUTO_GROUPS >= AUTO_GROUP_MIN_BYTES else 1

    def scatter(
        self,
        blocks: Sequence[tuple[Sequence[int], torch.Tensor]],
        groups: int = 1,
        staged: bool | None = None,
    ) -> PendingLoad:
        """Copy each ``(page_ids, buf)`` (``buf`` in :meth:`KVCache.block_shape` layout) into
        its pages: ``groups == 1`` whole blocks; else the layers split into ``groups``
        contiguous groups (at most one per layer), every block's first group first, so a step
        computes group ``g`` while ``g + 1`` is still arriving.

        ``staged`` (default: on CUDA) moves blocks into a device staging buffer, one copy per
        block, and scatters a whole chunk of blocks into the pages with one kernel: per-block
        scatters cost more host time than the copies themselves on a GPU. On CPU each block
        is copied straight into its pages (staging would double the memcpy).

        On CUDA this only enqueues the copies: the buffers must stay untouched until the
        returned load is :meth:`PendingLoad.done`, and the next steps wait for it on the
        device. Raises ValueError / IndexError for a buffer or page id that does not fit,
        before anything was enqueued; if enqueueing fails later (CUDA out of memory for a
        staging buffer), what was enqueued is still registered, so no step reads or rewrites
        those pages before those copies finished."""
        kv = self.kv
        for pages, buf in blocks:  # all or nothing: no copy is enqueued for a bad block list
            kv.check_block(pages, buf)
        self.last_groups = len(layer_groups(kv.num_layers, groups))
        self.scatter_groups[self.last_groups] += 1
        cuda = self.cuda
        staged = cuda if staged is None else staged
        events: list = []
        load = PendingLoad(events if cuda else None)
        try:
            self._enqueue(blocks, groups, staged, events)
        finally:
            if cuda:
                # Even when enqueueing broke off (a staging allocation failed, say), the copies
                # already on the stream must finish before a step recomputes those pages: the
                # layers without an event of their own wait for a last one.
                events += [self._record()] * (kv.num_layers - len(events))
                with self._lock:
                    self._pending.append(load)
        return load

    def scatter_stacked(
        self, pages: Sequence[Sequence[int]], stacked: torch.Tensor, groups: int = 1
    ) -> PendingLoad:
        """:meth:`scatter` of blocks whose buffers are one tensor, ``stacked[i]`` block ``i``'s
        (``[nb, *block_shape]``, host): on CPU one scatter per layer group for all of them,
        not one per block; on CUDA and for scaled (fp8) caches the same as :meth:`scatter`."""
        if self.cuda or self.kv.scaled or len({len(p) for p in pages}) != 1:
            return self.scatter(list(zip(pages, stacked)), groups)
        kv, n = self.kv, len(pages[0])
        if tuple(stacked.shape) != (len(pages), *kv.block_shape(n)):
            raise ValueError(f"stacked shape {tuple(stacked.shape)} != {(len(pages), *kv.block_shape(n))}")
        idx = kv.device_index([p for block in pages for p in block]).view(len(pages), n)  # checks the ids
        self.last_groups = len(layer_groups(kv.num_layers, groups))
        self.scatter_groups[self.last_groups] += 1
        for layers in layer_groups(kv.num_layers, groups):
            kv.scatter_staged(layers, idx, stacked[:, layers.start : layers.stop])
        return PendingLoad(None)

    def _enqueue(self, blocks, groups: int, staged: bool, events: list) -> None:
        """Issue the copies of :meth:`scatter`, appending one event per layer as groups end."""
        kv, cuda = self.kv, self.cuda
        with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
            if staged:
                chunks = self._chunks(blocks)
            else:  # every block's page ids in one transfer, not one per copy
                flat = kv.device_index([p for pages, _ in blocks for p in pages])
                starts = [0]
                for pages, _ in blocks:
                    starts.append(starts[-1] + len(pages))
                indexed = [(flat[starts[i] : starts[i + 1]], buf) for i, (_, buf) in enumerate(blocks)]
            for layers in layer_groups(kv.num_layers, groups):
                if staged:
                    for idx, bufs in chunks:
                        self._scatter_chunk(layers, idx, bufs, cuda)
                else:
                    for idx, buf in indexed:
                        kv.scatter_layers(layers, idx, buf, non_blocking=cuda)
                if cuda:
                    events += [self._record()] * len(layers)

    def _chunks(self, blocks) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Runs of consecutive blocks of one page count, at most STAGING_BYTES each: per run
        its page ids as a ``[blocks, pages]`` device tensor and its buffers."""
        kv = self.kv
        out, i = [], 0
        while i < len(blocks):
            n = len(blocks[i][0])
            cap = max(1, STAGING_BYTES // (kv.page_bytes * n))
            j = i
            while j < len(blocks) and j - i < cap and len(blocks[j][0]) == n:
                j += 1
            idx = kv.device_index([p for pages, _ in blocks[i:j] for p in pages]).view(j - i, n)
            out.append((idx, [buf for _, buf in blocks[i:j]]))
            i = j
        return out

    def _scatter_chunk(self, layers: range, idx: torch.Tensor, bufs: list[torch.Tensor], cuda: bool) -> None:
        kv = self.kv
        a, b = layers.start, layers.stop
        staging = torch.empty(
            (len(bufs), b - a, *kv.block_shape(idx.shape[1])[1:]), dtype=kv.dtype, device=kv.data.device
        )
        for k, buf in enumerate(bufs):
            staging[k].copy_(buf[a:b], non_blocking=cuda)
        kv.scatter_staged(layers, idx, staging)  # one scatter for the chunk

    def last_pending(self) -> PendingLoad | None:
        """The most recent load still copying, or None. Copies run in order on one stream, so
        once it is done every earlier one is too."""
        with self._lock:
            for p in reversed(self._pending):
                if not p.done():
                    return p
        return None

    def _record(self):
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def gather(self, page_ids: Sequence[int]) -> torch.Tensor:
        """Pages ``page_ids`` as one contiguous host (CPU) ``[layers, 2, n*page_size, kv_heads,
        head_dim]`` tensor the caller owns. On CUDA the copy runs on the copy stream and this
        call blocks its thread until it finished (run it off the event loop); the compute
        stream is not waited for."""
        if not self.cuda:
            return self.kv.gather_block(page_ids)
        with torch.cuda.stream(self.stream):
            dev = self.kv.gather_block(page_ids)
            host = torch.empty(dev.shape, dtype=dev.dtype)
            host.copy_(dev)  # D2H into pageable memory: returns when the copy is done
        return host

    def step_barrier(self) -> Callable[[int], None] | None:
        """For one model step: a ``before_layer(l)`` hook making the current (compute) stream
        wait for layer ``l`` of every load not yet finished, or None when nothing is pending.
        Finished loads are dropped here. Loads that begin after this call belong to requests
        not in this step."""
        if not self.cuda:
            return None
        with self._lock:
            self._pending = [p for p in self._pending if not p.done()]
            pending = list(self._pending)
        if not pending:
            return None

        def before_layer(layer: int) -> None:
            stream = torch.cuda.current_stream()
            for p in pending:
                stream.wait_event(p.events[layer])

        return before_layer

    def step_groups(self) -> list[range]:
        """Layer groups to time one step in (ModelRunner's layer timing): cut wherever an
        unfinished load's per-layer event changes (where :meth:`step_barrier`'s hook makes the
        step wait), or, with no load unfinished (always on CPU), as the latest scatter was cut
        (one group before any). Never blocks."""
        n = self.kv.num_layers
        with self._lock:
            pending = [p for p in self._pending if not p.done()]
        if not pending:
            return layer_groups(n, self.last_groups)
        cuts = sorted(
            {0, n} | {i for p in pending for i in range(1, n) if p.events[i] is not p.events[i - 1]}
        )
        return [range(a, b) for a, b in zip(cuts, cuts[1:])]
