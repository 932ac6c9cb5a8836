"""Decode steps on fixed-size static buffers, replayed as CUDA graphs.

A decode-only step of ``B`` sequences is padded to the smallest bucket ``bb >= B`` (1, 2, 4,
..., ``max_batch``). Its inputs are copied into static buffers (token ids, positions, K/V
slots, block tables, context lengths) and the model runs on views of them with a fixed launch
plan from the attention backend (``decode_plans``), so every step of that bucket launches the
same kernels on the same addresses: on CUDA the forward is captured once per bucket as a CUDA
graph and replayed (no Python per layer); with ``capture=False`` the very same static-buffer
forward runs eagerly (the CPU path, and what the tests exercise). Padding rows compute a token
at position 0 whose K/V go to the KV cache's scratch page; their logits are dropped.

Only backends that offer ``decode_plans`` (the Triton backend) take this path; greedy sampling
stays an argmax on the device (``engine/sampling.py``), read back once per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention_meta import AttnMetadata
from engine.errors import ConfigError
from engine.kv_cache import KVCache
from engine.model import CausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeGraphConfig:
    """``max_batch``: largest bucket (bigger decode steps run the ordinary path);
    ``max_context``: tokens a sequence may hold (sizes the block-table buffer and the fixed
    key splits); ``capture``: CUDA graphs (CUDA only) or the same buffers run eagerly."""

    max_batch: int
    max_context: int
    capture: bool

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_context < 1:
            raise ConfigError(
                f"decode graphs need max_batch >= 1 and max_context >= 1, got {self.max_batch}, {self.max_context}"
            )

    @property
    def buckets(self) -> tuple[int, ...]:
        b, out = 1, []
        while b < self.max_batch:
            out.append(b)
            b *= 2
        return (*out, self.max_batch)


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: KVCache, backend, cfg: DecodeGraphConfig) -> None:
        if not hasattr(backend, "decode_plans"):
            raise ConfigError(f"attention backend {backend.name!r} has no fixed decode plan for graphs")
        if cfg.capture and not kv.data.is_cuda:
            raise ConfigError("decode graph capture needs the KV cache on a CUDA device")
        self.model, self.kv, self.backend, self.cfg = model, kv, backend, cfg
        self.layers = kv.layers()
        dev = kv.data.device
        n, ps = cfg.max_batch, kv.page_size
        self.width = -(-cfg.max_context // ps)  # block-table columns
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((n, self.width), dtype=torch.int32, device=dev)
        self.ctx = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)
        self._metas: dict[int, AttnMetadata] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.steps = 0  # decode steps this path ran (tests, metrics)
        self.capture_failures = 0

    def capture_all(self) -> None:
        """Capture every bucket now (at start, off the request path); a no-op without capture."""
        for bb in self.cfg.buckets:
            if self.cfg.capture and bb not in self._graphs and self.capture_failures == 0:
                self._capture(bb)

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.cfg.buckets if b >= batch), None)

    def fits(self, batch: int, max_context: int) -> bool:
        return self.bucket(batch) is not None and max_context <= self.cfg.max_context

    def run(
        self,
        ids: list[int],
        positions: list[int],
        tables: list[list[int]],
        before_layer=None,
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` of one decode-only step (``fits`` must hold): token ``ids[i]``
        at ``positions[i]`` of the sequence with pages ``tables[i]``."""
        b = len(ids)
        bb = self.bucket(b)
        if self.cfg.capture and bb not in self._graphs and self.capture_failures == 0:
            self._capture(bb)
        self._fill(ids, positions, tables, bb)
        if before_layer is not None:  # loads still copying: wait for all layers up front
            for layer in range(len(self.layers)):
                before_layer(layer)
        self.steps += 1
        if bb in self._graphs:
            graph, out = self._graphs[bb]
            graph.replay()
            return out[:b]
        return self._forward(bb)[:b]

    def _fill(self, ids, positions, tables, bb: int) -> None:
        """Copy a step's inputs into the buffers; rows ``len(ids) .. bb`` become padding."""
        b, ps = len(ids), self.kv.page_size
        pad = bb - b
        scratch = self.kv.scratch_page
        slots = [t[p // ps] * ps + p % ps for t, p in zip(tables, positions)]
        slots += [scratch * ps + i % ps for i in range(pad)]
        bt = torch.zeros((bb, self.width), dtype=torch.int32)
        for i, (t, p) in enumerate(zip(tables, positions)):
            n = p // ps + 1  # pages holding tokens 0 .. p (the table may run ahead)
            bt[i, :n] = torch.tensor(t[:n], dtype=torch.int32)
        bt[b:, 0] = scratch
        self.ids[:bb].copy_(torch.tensor(list(ids) + [0] * pad, dtype=torch.int64))
        self.pos[:bb].copy_(torch.tensor(list(positions) + [0] * pad, dtype=torch.int64))
        self.slots[:bb].copy_(torch.tensor(slots, dtype=torch.int64))
        self.ctx[:bb].copy_(torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32))
        self.tables[:bb].copy_(bt)

    def _meta(self, bb: int) -> AttnMetadata:
        meta = self._metas.get(bb)
        if meta is None:
            meta = self._metas[bb] = AttnMetadata(
                slot_mapping=self.slots[:bb],
                query_lens=[1] * bb,
                context_lens=[self.cfg.max_context] * bb,  # bounds only: the plan is fixed
                block_tables=self.tables[:bb],
                cu_query=self.cu[: bb + 1],
                context_lens_t=self.ctx[:bb],
                max_query_len=1,
                max_context_len=self.cfg.max_context,
                page_size=self.kv.page_size,
            )
            meta.plans.update(self.backend.decode_plans(bb, self.cfg.max_context, self.kv.data.device))
        return meta

    def _forward(self, bb: int) -> torch.Tensor:
        return self.model(
            self.ids[:bb], self.pos[:bb], self.layers, self._meta(bb), self.backend, self.rows[:bb]
        )

    def _capture(self, bb: int) -> None:
        """Capture bucket ``bb`` on all-padding inputs (the warm-up runs compile the kernels;
        they write only the scratch page). A failure is logged and counted, and decode steps
        then run these buffers eagerly."""
        self._fill([], [], [], bb)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(bb)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(bb)
            self._pool = graph.pool()
            self._graphs[bb] = (graph, out)
        except Exception as exc:  # capture is an optimisation: never fail the step over it
            self.capture_failures += 1
            log.warning("event=decode_graph_capture_failed bucket=%d error=%r", bb, exc)
