"""Model runner: turns a scheduled batch into tensors, runs the model, returns logits for
the sequences that finished computing all their known tokens this step."""

from __future__ import annotations

import torch

from engine.attention_meta import build_metadata
from engine.decode_graphs import DecodeGraphConfig, DecodeGraphs
from engine.kv_cache import KVCache
from engine.kv_transfer import KVTransfer
from engine.model import CausalLM
from engine.sequence import Sequence

# Largest decode batch CUDA graphs are captured for (buckets 1, 2, 4, ... up to it).
GRAPH_MAX_BATCH = 256


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        backend,
        device: str,
        transfer: KVTransfer,
        decode_graphs: DecodeGraphConfig | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        """``decode_graphs``: run decode-only steps on static buffers (engine/decode_graphs.py)
        as configured. Without it, ``cuda_graphs`` turns on CUDA graphs where they apply: a
        CUDA KV cache and a backend with fixed decode plans (Triton); off everywhere else."""
        self.model, self.kv, self.backend, self.device = model, kv, backend, device
        self.transfer = transfer  # connector loads still copying: each layer waits for its part
        self._layers = kv.layers()
        if decode_graphs is None and cuda_graphs and kv.data.is_cuda and hasattr(backend, "decode_plans"):
            max_context = min(model.rope_cos.shape[0], kv.num_pages * kv.page_size)
            decode_graphs = DecodeGraphConfig(GRAPH_MAX_BATCH, max_context, capture=True)
        self.graphs = DecodeGraphs(model, kv, backend, decode_graphs) if decode_graphs else None

    def run(self, items: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """Compute ``n`` tokens of each ``(seq, n)`` (its next uncomputed ones), writing their
        K/V into the seq's pages. Returns the sequences that now need a sample and their logits."""
        ids: list[int] = []
        pos: list[int] = []
        qlens, clens, tables = [], [], []
        logits_idx: list[int] = []
        to_sample: list[Sequence] = []
        for seq, n in items:
            start = seq.num_computed
            ids += seq.tokens[start : start + n]
            pos += range(start, start + n)
            qlens.append(n)
            clens.append(start + n)
            tables.append(seq.page_table)
            if start + n == len(seq.tokens):
                logits_idx.append(len(ids) - 1)
                to_sample.append(seq)
        g = self.graphs
        if g is not None and len(ids) == len(items) == len(to_sample) and g.fits(len(items), max(clens)):
            return to_sample, g.run(ids, pos, tables, self.transfer.step_barrier())
        meta = build_metadata(qlens, clens, tables, self.kv.page_size, self.device)
        dev = self.device
        logits = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            self._layers,
            meta,
            self.backend,
            torch.tensor(logits_idx, dtype=torch.int64, device=dev),
            self.transfer.step_barrier(),
        )
        return to_sample, logits
