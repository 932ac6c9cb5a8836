"""Model runner: turns a scheduled batch into tensors, runs the model, returns logits for
the sequences that finished computing all their known tokens this step."""

from __future__ import annotations

import torch

from engine.attention_meta import build_metadata
from engine.kv_cache import KVCache
from engine.kv_transfer import KVTransfer
from engine.model import CausalLM
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, backend, device: str, transfer: KVTransfer) -> None:
        self.model, self.kv, self.backend, self.device = model, kv, backend, device
        self.transfer = transfer  # connector loads still copying: each layer waits for its part
        self._layers = kv.layers()

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
