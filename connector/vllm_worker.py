"""The worker side of the vLLM connector: loads into vLLM's KV tensors, saves out of them.

- Loads (``start_loads``, before the forward): each request's planned blocks go through the
  connector's loader (batched, pipelined, verified reads; connector/loader.py) straight into
  vLLM's pages, one indexed copy per layer and batch. vLLM's first attention layer waits for
  them (``wait_loads``, from ``wait_for_layer_load``): on CPU there is nothing to overlap a
  load with but the embedding. A block that fails (miss, corrupt, mismatch, timeout, dead
  node) ends its request's load; it and the request's later blocks are reported through
  ``load_errors`` (vLLM's ``get_block_ids_with_load_errors``), so vLLM recomputes them, and
  counted. A load past its backstop is cancelled, and waited for, before it is reported.
- Saves (``save_layer`` per layer, ``finish_saves`` at the step's end): the step's completed
  prompt blocks are copied layer by layer out of vLLM's pages into one host buffer of this
  step (bounded: past ``save_queue_bytes`` in flight the step's saves are dropped and
  counted), then handed to the saver (connector/saver.py), which writes them behind. vLLM's
  pages are never read after the step, so no request's blocks are held for a save.

Runs on vLLM's model-runner thread; the store's calls run on the side's event loop.
"""

from __future__ import annotations

import logging
import math

import torch

from connector.config import ConnectorConfig
from connector.store_connector import StoreConnector
from connector.vllm_format import PageFormat
from connector.vllm_loop import LoopThread, Running
from connector.vllm_meta import BlockMove, TierkvMetadata
from connector.vllm_open import open_connector
from connector.vllm_pages import VllmPages
from connector.vllm_stats import SideStats
from engine.kv_connector import ConnectorRequest

log = logging.getLogger("tierkv.connector")


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, loads: bool, saves: bool, stats_path: str, rank: int) -> None:
        self.cfg, self.loads, self.saves = cfg, loads, saves
        self.loop = LoopThread(f"tierkv-worker-{rank}")
        self.stats = SideStats(stats_path, f"worker-tp{rank}")
        self.conn: StoreConnector | None = None
        self.pages: VllmPages | None = None
        self._layer_of: dict[str, int] = {}
        self._loading: list[tuple[BlockMove, Running]] = []
        self._errors: set[int] = set()
        self._staged: torch.Tensor | None = None
        self._staged_layers: set[int] = set()
        self._staged_ids = torch.empty(0, dtype=torch.long)  # vLLM blocks of this step's saves
        self._in_flight = 0  # bytes staged and not yet handed to the saver's queue
        self._saving: list[Running] = []

    def register(self, fmt: PageFormat, layers: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's KV tensors, by layer name in model order (one per distinct tensor)."""
        self._layer_of = {name: i for i, (name, _) in enumerate(layers)}
        self.pages = VllmPages(fmt, [t for _, t in layers])
        self.conn = open_connector(self.loop, self.cfg, self.pages, loads=self.loads)
        self.stats.write(self.conn)

    # ---- loads ----------------------------------------------------------------------------------
    def start_loads(self, meta: TierkvMetadata) -> None:
        if self.conn is None or not self.loads:
            self._errors.update(b for m in meta.loads for b in m.block_ids)  # nothing can load
            return
        for m in meta.loads:
            req = ConnectorRequest(m.req_id, m.token_ids, (), m.first * self.pages.fmt.block_size, m.record)
            self._loading.append((m, self.loop.submit(self.conn.load(req, list(m.block_ids)))))
            self.stats.counts["loads"] += 1
            self.stats.counts["load_blocks"] += len(m.block_ids)

    def wait_loads(self) -> None:
        """Wait for this step's loads; what did not load is a load error (recomputed)."""
        bs = self.pages.fmt.block_size if self.pages else 1
        for m, running in self._loading:
            # each batch has load_deadline_s: a backstop past every batch's, for a load that hangs
            backstop = self.cfg.load_deadline_s * (len(m.block_ids) + 1) + 1.0
            try:
                loaded = running.result(backstop) // bs
            except Exception as exc:  # the cache path never fails the engine: recompute
                log.warning("event=load_failed request=%s error=%r", m.req_id, exc)
                loaded = 0
            self.stats.counts["loaded_tokens"] += loaded * bs
            if loaded < len(m.block_ids):
                self._errors.update(m.block_ids[loaded:])
                self.stats.counts["load_error_blocks"] += len(m.block_ids) - loaded
        self._loading.clear()

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # ---- saves ----------------------------------------------------------------------------------
    def save_layer(self, layer_name: str, meta: TierkvMetadata) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None or not meta.saves or not self.saves or self.conn is None or not self.cfg.save:
            return
        if self._staged is None and not self._staged_layers:
            self._stage(meta)
        if self._staged is not None:
            self.pages.copy_layer(layer, self._staged_ids, self._staged)
        self._staged_layers.add(layer)

    def _stage(self, meta: TierkvMetadata) -> None:
        """This step's host buffer, or None (counted dropped) when it would pass the bound."""
        fmt = self.pages.fmt
        n = sum(len(m.block_ids) for m in meta.saves)
        need = n * fmt.block_bytes
        if self._in_flight + self.conn.saver.queued_bytes + need > self.cfg.save_queue_bytes:
            self.conn.metrics.dropped_saves.labels("queue_full").inc(n)
            return
        self._staged = torch.empty((n, *fmt.block_shape), dtype=fmt.dtype)
        self._staged_ids = torch.tensor([b for m in meta.saves for b in m.block_ids], dtype=torch.long)

    def finish_saves(self, meta: TierkvMetadata | None) -> None:
        """End of the step: hand the staged blocks to the saver (written behind)."""
        staged, layers = self._staged, len(self._staged_layers)
        self._staged, self._staged_layers = None, set()
        if staged is not None and meta is not None:
            if layers < self.pages.fmt.layers:  # a layer never passed save_kv_layer: bytes missing
                self.conn.metrics.dropped_saves.labels("incomplete").inc(staged.shape[0])
            else:
                self._in_flight += staged.numel() * staged.element_size()
                self._saving.append(self.loop.submit(self._save(meta.saves, staged)))
                self.stats.counts["save_blocks_staged"] += staged.shape[0]
        self._saving = [r for r in self._saving if not r.future.done()]
        self.stats.write(self.conn)

    async def _save(self, moves: list[BlockMove], staged: torch.Tensor) -> None:
        """Queue each request's staged blocks with the saver (the chain's keys from the
        scheduler's record, hashed here only where the namespace differs)."""
        conn, row = self.conn, 0
        try:
            for m in moves:
                n = len(m.block_ids)
                req = ConnectorRequest(m.req_id, m.token_ids, (), 0, m.record)
                keys = conn.keys_for(req, m.first + n)
                rows = [-1] * m.first + list(range(row, row + n))
                await conn.saver.save(req, rows, keys, m.first, lambda pages: staged[pages[0]])
                row += n
        except Exception as exc:  # a save that fails is a miss later, never an engine error
            log.warning("event=save_failed error=%r", exc)
            conn.metrics.dropped_saves.labels("error").inc(staged.shape[0] - row)
        finally:
            self._in_flight -= staged.numel() * staged.element_size()

    def flush(self, timeout_s: float) -> None:
        """Wait for the saves handed on so far to be written (shutdown)."""
        for r in self._saving:
            try:
                r.result(timeout_s)
            except Exception as exc:
                log.warning("event=save_failed error=%r", exc)
        self._saving.clear()
        if self.conn is not None:
            self.loop.run(self.conn.flush(timeout_s), timeout_s + 1.0)

    def shutdown(self) -> None:
        if self.conn is not None:
            try:
                self.flush(self.cfg.save_deadline_s)
                self.loop.run(self.conn.close(), self.cfg.save_deadline_s + 1.0)
            except Exception as exc:  # closing a cache never fails the engine's shutdown
                log.warning("event=connector_close_failed error=%r", exc)
            self.stats.write(self.conn)
        self.loop.stop()


def layer_tensors(names: list[str], kv_caches: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """One ``(name, tensor)`` per distinct KV tensor, in model order (layers that share
    another layer's KV are that layer's)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = []
    for name in names:
        t = kv_caches.get(name)
        if t is None:
            continue
        ident = (t.data_ptr(), tuple(t.stride()))
        if ident not in seen:
            seen.add(ident)
            out.append((name, t))
    return out


def page_shape_of(layers: list[tuple[str, torch.Tensor]]) -> tuple[int, ...]:
    """The one page shape every layer's tensor has; ValueError naming the layers otherwise."""
    shapes = {(tuple(t.shape[1:]), t.dtype, t.shape[0]) for _, t in layers}
    if len(shapes) != 1:
        raise ValueError(f"layers with different KV pages: {sorted(map(str, shapes))}")
    shape = next(iter(shapes))[0]
    return shape if math.prod(shape) else ()
