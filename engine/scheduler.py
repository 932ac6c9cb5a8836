"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running decodes first (one token each, so a long prefill never stalls streams),
then running prefills continue in chunks, then waiting requests are admitted (prefix-cache
hit pages referenced, pages for the first chunk allocated). When a decode cannot get a page
the youngest running request is preempted by recompute: its pages are released (full ones
stay in the prefix cache, so the recompute mostly hits) and it goes back to the queue front.

Connector hook: a waiting request whose ``external_hit_tokens`` (from the connector's lookup)
exceed the local hit gets pages for that span and moves to ``to_load`` (status LOADING); the
engine loads them and calls :meth:`finish_load` with the tokens actually loaded. Anything not
loaded is recomputed, so a failed load is never an error.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status
from engine.timeline import Timeline


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(
        self,
        bm: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        timeline: Timeline | None = None,
    ) -> None:
        self.bm = bm
        self.timeline = timeline or Timeline()
        self.max_tokens, self.max_seqs = max_num_batched_tokens, max_num_seqs
        self.connector_block_pages = 0  # pages per connector block; 0: no connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []
        self.to_load: list[tuple[Sequence, int, list[int]]] = []  # (seq, first token, pages)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.queued_at = time.perf_counter()
        self.waiting.append(seq)

    def _admitted(self, seq: Sequence) -> None:
        if seq.queued_at is not None:  # the first admission after add (not after preemption)
            self.timeline.observe("queue", time.perf_counter() - seq.queued_at)
            seq.queued_at = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def _max_hit_pages(self, seq: Sequence) -> int:
        # Leave at least one token to compute: the step that computes it yields the logits.
        return (len(seq.tokens) - 1) // self.bm.page_size

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_tokens
        bm = self.bm
        for seq in [s for s in self.running if s.remaining == 1]:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            while not bm.can_take((), bm.pages_needed(len(seq.page_table), seq.num_computed + 1)):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            seq.page_table += bm.take((), bm.pages_needed(len(seq.page_table), seq.num_computed + 1))
            batch.items.append((seq, 1))
            budget -= 1
        for seq in [s for s in self.running if s.remaining > 1]:
            if budget == 0:
                break
            chunk = self._fit(seq, min(seq.remaining, budget), len(seq.page_table))
            if chunk:
                seq.page_table += bm.take((), bm.pages_needed(len(seq.page_table), seq.num_computed + chunk))
                batch.items.append((seq, chunk))
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_seqs:
            seq = self.waiting[0]
            hit = bm.match_prefix(seq.tokens, self._max_hit_pages(seq), seq.prompt_keys)
            hit_tokens = len(hit) * bm.page_size
            bp = self.connector_block_pages
            ext = 0
            if bp:
                ext = min(seq.external_hit_tokens, (self._max_hit_pages(seq) // bp) * bp * bm.page_size)
            if ext > hit_tokens:
                # Loads are whole connector blocks: keep only the block-aligned part of the
                # local hit so the load never writes into a shared cached page.
                hit = hit[: len(hit) - len(hit) % bp]
                hit_tokens = len(hit) * bm.page_size
                n_new = ext // bm.page_size - len(hit)
                if not bm.can_take(hit, n_new):
                    break
                new = bm.take(hit, n_new)
                self.waiting.popleft()
                seq.page_table = hit + new
                seq.num_computed = hit_tokens
                bm.hit_tokens_total += hit_tokens
                seq.status = Status.LOADING
                self._admitted(seq)
                self.loading.append(seq)
                self.to_load.append((seq, hit_tokens, new))
                continue
            chunk = min(len(seq.tokens) - hit_tokens, budget)
            need = bm.pages_needed(len(hit), hit_tokens + chunk)
            if not bm.can_take(hit, need):
                # Take a smaller first chunk if some pages are free; otherwise wait.
                room = bm.num_available - sum(1 for p in hit if p in bm.lru)
                chunk = min(chunk, room * bm.page_size)
                if chunk <= 0:
                    break
                need = bm.pages_needed(len(hit), hit_tokens + chunk)
            self.waiting.popleft()
            seq.page_table = hit + bm.take(hit, need)
            seq.num_computed = hit_tokens
            bm.hit_tokens_total += hit_tokens
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit_tokens
            seq.status = Status.RUNNING
            self._admitted(seq)
            self.running.append(seq)
            batch.items.append((seq, chunk))
            budget -= chunk
        if not batch.items and self.running:
            # Every running prefill is stuck without pages: free the youngest to unblock
            # (it re-queues at the front; the older ones get its pages next step).
            self._preempt(self.running[-1], batch)
        return batch

    def _fit(self, seq: Sequence, chunk: int, have: int) -> int:
        """Largest chunk <= ``chunk`` whose pages are available now."""
        ps = self.bm.page_size
        room = self.bm.num_available
        limit = (have + room) * ps - seq.num_computed
        return max(0, min(chunk, limit))

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.bm.release(seq.page_table)
        seq.page_table, seq.page_keys, seq.num_computed = [], [], 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def finish_load(self, seq: Sequence, first_token: int, loaded_tokens: int) -> None:
        """A connector load into ``seq``'s pages finished with ``loaded_tokens`` valid tokens
        from ``first_token`` (0 on failure). The rest of the span is recomputed in place."""
        ps = self.bm.page_size
        loaded = max(0, min(loaded_tokens, len(seq.page_table) * ps - first_token))
        loaded -= loaded % ps
        seq.num_computed = first_token + loaded
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed
        self.bm.hit_tokens_total += loaded
        self.bm.register(seq.tokens, seq.page_table, seq.page_keys, seq.num_computed, seq.prompt_keys)
        self.loading.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish a request: release its pages (full ones stay cached) and drop it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.loading:
            self.loading.remove(seq)
        if seq.page_table:
            self.bm.release(seq.page_table)
        seq.page_table = []
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def live_tables(self) -> list[list[int]]:
        return [s.page_table for s in (*self.running, *self.loading) if s.page_table]
