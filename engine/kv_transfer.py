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
from collections.abc import Callable, Sequence

import torch

from engine.kv_cache import KVCache

# A layer-wise load issues one copy per block per layer; below this many bytes per copy the
# launch cost outweighs the overlap it buys, so "auto" loads whole blocks instead.
LAYERWISE_MIN_SLICE_BYTES = 256 << 10


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

    def layer_slice_bytes(self, pages_per_block: int) -> int:
        """Bytes one layer of one block moves (the unit of a layer-wise copy)."""
        return (
            KVCache.bytes_per_page(
                1, self.kv.page_size, self.kv.num_kv_heads, self.kv.head_dim, self.kv.dtype
            )
            * pages_per_block
        )

    def layerwise_pays(self, pages_per_block: int) -> bool:
        """Whether ``layerwise = "auto"`` loads layer by layer: CUDA, and slices large enough."""
        return self.cuda and self.layer_slice_bytes(pages_per_block) >= LAYERWISE_MIN_SLICE_BYTES

    def scatter(self, blocks: Sequence[tuple[Sequence[int], torch.Tensor]], layerwise: bool) -> PendingLoad:
        """Copy each ``(page_ids, buf)`` (``buf`` in :meth:`KVCache.block_shape` layout) into
        its pages. On CUDA this only enqueues the copies: the buffers must stay untouched until
        the returned load is :meth:`PendingLoad.done`, and the next steps wait for it on the
        device. May raise ValueError / IndexError for a buffer or page id that does not fit
        (before anything was enqueued for that block)."""
        kv = self.kv
        for pages, buf in blocks:  # all or nothing: no copy is enqueued for a bad block list
            kv.check_block(pages, buf)
        events = []
        cuda = self.cuda
        with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
            # every block's page ids in one transfer, not one per copy
            flat = kv.device_index([p for pages, _ in blocks for p in pages])
            starts = [0]
            for pages, _ in blocks:
                starts.append(starts[-1] + len(pages))
            indexed = [(flat[starts[i] : starts[i + 1]], buf) for i, (_, buf) in enumerate(blocks)]
            if layerwise:
                for layer in range(kv.num_layers):
                    for idx, buf in indexed:
                        kv.scatter_layer(layer, idx, buf, non_blocking=cuda)
                    if cuda:
                        events.append(self._record())
            else:
                for idx, buf in indexed:
                    kv.scatter_block(idx, buf, non_blocking=cuda)
                if cuda:
                    events = [self._record()] * kv.num_layers
        if not cuda:
            return PendingLoad(None)
        load = PendingLoad(events)
        with self._lock:
            self._pending.append(load)
        return load

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
