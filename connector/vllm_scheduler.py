"""The scheduler side of the vLLM connector: how much of a prompt tierkv holds beyond vLLM's
own prefix cache, and which blocks each step loads and saves.

- The store is asked once per request (vLLM may ask again for a request it could not
  schedule: the first answer is kept), under ``lookup_deadline_s`` (+ 1 s backstop); a failed
  or late lookup is 0 external tokens. Only full blocks count, and never the prompt's last
  token (vLLM must compute at least one).
- Keys are tierkv's chained keys of the prompt's tokens under the worker's namespace (its page
  format arrives by vLLM's handshake, before any request); until it is known every answer is 0.
- ``kv_consumer`` only loads, ``kv_producer`` only saves (its lookups are never made).
- Saves: each step, the prompt's full blocks computed by the end of the step that are not
  known to be stored (held at lookup, or planned by an earlier step or request): blocks that
  vLLM's own prefix cache holds are saved too, as they may be an earlier turn's decoded tokens.

Runs on vLLM's scheduler thread; the store's calls run on the side's event loop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from connector.config import ConnectorConfig
from connector.lookup import chain_keys
from connector.prompt_lookup import PromptLookup
from connector.store_connector import StoreConnector
from connector.vllm_format import PageFormat
from connector.vllm_loop import LoopThread
from connector.vllm_meta import BlockMove, TierkvMetadata
from connector.vllm_open import open_connector
from connector.vllm_pages import VllmPages
from connector.vllm_stats import SideStats
from engine.kv_connector import ConnectorLookup, ConnectorRequest
from kvstore.keys import KeyBatch

log = logging.getLogger("tierkv.connector")

_KNOWN_MAX = 1 << 16


@dataclass
class _Tracked:
    """A request the scheduler side follows: its prompt, vLLM blocks, prompt blocks handed to
    the worker to save, and its keys (once hashed)."""

    prompt: list[int]
    block_ids: list[int]
    saved: int
    record: PromptLookup | None


class SchedulerSide:
    def __init__(
        self, cfg: ConnectorConfig, block_size: int, loads: bool, saves: bool, stats_path: str
    ) -> None:
        self.cfg, self.bs = cfg, block_size
        self.loads, self.saves = loads, saves
        self.loop = LoopThread("tierkv-scheduler")
        self.conn: StoreConnector | None = None
        self.stats = SideStats(stats_path, "scheduler")
        self._lookups: dict[str, ConnectorLookup] = {}
        self._asked: dict[str, tuple[int, int]] = {}  # req -> (first block, blocks) last answered
        self._planned: dict[str, BlockMove] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._known: OrderedDict[bytes, None] = OrderedDict()  # keys stored or planned
        self._auth_said = False

    def set_format(self, fmt: PageFormat) -> None:
        """The worker's (tensor-parallel rank 0's) page format: open the store for it."""
        if self.conn is None:
            self.conn = open_connector(self.loop, self.cfg, VllmPages(fmt), loads=False)
            self._say_auth()
            self.stats.write(self.conn)

    def _say_auth(self) -> None:
        """Once per engine: a store that refuses our token serves only misses; say why."""
        if not self._auth_said and self.conn is not None and self.conn.backend.counters.get("auth_refused"):
            self._auth_said = True
            log.warning(
                "tierkv: the store refused this vLLM's token (tenant %r): every lookup is a miss and "
                "nothing is saved; check token / token_file in kv_connector_extra_config",
                self.cfg.tenant,
            )

    # ---- vLLM's scheduler calls --------------------------------------------------------------
    def matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` to load for ``request`` (see module docstring)."""
        if not self.loads or self.conn is None:
            return 0
        rid = request.request_id
        found = self._lookups.get(rid)
        if found is None:
            found = self._lookup(list(request.prompt_token_ids or ()))
            self._lookups[rid] = found
        first, hit = num_computed_tokens // self.bs, found.hit_tokens // self.bs
        self._asked[rid] = (first, max(0, hit - first))
        return max(0, hit - first) * self.bs

    def _lookup(self, prompt: list[int]) -> ConnectorLookup:
        cap = max(0, len(prompt) - 1) // self.bs * self.bs  # vLLM computes at least one token
        self.stats.counts["lookup_requests"] += 1
        if cap == 0:
            return ConnectorLookup(0)
        try:
            found = self.loop.run(self.conn.lookup_result(prompt[:cap]), self.cfg.lookup_deadline_s + 1.0)
        except Exception as exc:  # the cache path never fails the engine: a miss
            log.warning("event=lookup_failed error=%r", exc)
            self.stats.counts["lookup_errors"] += 1
            found = ConnectorLookup(0)
        self._say_auth()
        self.stats.counts["held_tokens"] += found.hit_tokens
        self.stats.write(self.conn)
        return found

    def after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the load of the blocks vLLM allocated for the external tokens."""
        rid = request.request_id
        first, n = self._asked.pop(rid, (0, 0))
        n = min(n, num_external_tokens // self.bs)
        if n <= 0:
            return
        self.stats.counts["external_tokens"] += n * self.bs
        prompt = request.prompt_token_ids
        record = self._lookups[rid].found
        self._planned[rid] = BlockMove(
            rid,
            tuple(prompt[: (first + n) * self.bs]),
            tuple(block_ids[first : first + n]),
            first,
            record if isinstance(record, PromptLookup) else None,
        )

    def build_meta(self, out) -> TierkvMetadata:
        """This step's loads (planned at allocation) and saves (blocks the step completes)."""
        meta = TierkvMetadata(loads=list(self._planned.values()))
        self._planned.clear()
        for rid in out.finished_req_ids:
            self.forget(rid)
        for new in out.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or ())
            found = self._lookups.get(new.req_id)
            record = found.found if found is not None and isinstance(found.found, PromptLookup) else None
            # from block 0: blocks vLLM's prefix cache holds may have been decoded tokens of an
            # earlier turn (never saved); those known stored are skipped (_known)
            t = _Tracked(prompt, list(new.block_ids[0]), 0, record)
            if record is not None:
                self._remember(record.keys[: len(record.tiers)])  # held by the store
            self._tracked[new.req_id] = t
            self._save(meta, new.req_id, t, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id])
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._tracked.get(rid)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                t.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                t.block_ids.extend(new_ids[0])
            self._save(meta, rid, t, cached.num_computed_tokens[i] + out.num_scheduled_tokens[rid])
        if meta.loads or meta.saves:
            self.stats.counts["steps_with_transfers"] += 1
        self.stats.write(self.conn)
        return meta

    def _save(self, meta: TierkvMetadata, rid: str, t: _Tracked, computed_after: int) -> None:
        upto = min(computed_after, len(t.prompt)) // self.bs
        if not self.saves or self.conn is None or upto <= t.saved:
            return
        t.record = self._keyed(t, rid)
        first, keys = t.saved, t.record.keys
        while first < upto and keys[first].raw in self._known:  # stored, or planned already
            first += 1
        t.saved = upto
        if first == upto:
            return
        self._remember(keys[first:upto])
        meta.saves.append(
            BlockMove(rid, tuple(t.prompt[: upto * self.bs]), tuple(t.block_ids[first:upto]), first, t.record)
        )
        self.stats.counts["save_blocks_planned"] += upto - first

    def _keyed(self, t: _Tracked, rid: str) -> PromptLookup:
        """``t``'s record with the keys of every full block of its prompt: the lookup's (which
        stop before the prompt's last token) chained on (connector.lookup.chain_keys)."""
        ns, rec = self.conn.ns, t.record
        full = len(t.prompt) // self.bs
        if rec is not None and rec.namespace == ns.id.raw and len(rec.keys) >= full:
            return rec
        keys = chain_keys(ConnectorRequest(rid, tuple(t.prompt), (), 0, rec), full, ns)
        tiers = rec.tiers if rec is not None and rec.namespace == ns.id.raw else ()
        return PromptLookup(ns.id.raw, keys, tiers)

    def _remember(self, keys: KeyBatch) -> None:
        """``keys`` are stored or on their way: a bounded LRU (a forgotten key costs one
        redundant save, which the saver's own set or the store's EXISTS then stops)."""
        self._known.update(dict.fromkeys(keys.raws()))
        for _ in range(len(self._known) - _KNOWN_MAX):
            self._known.popitem(last=False)

    def forget(self, rid: str) -> None:
        for d in (self._lookups, self._asked, self._planned, self._tracked):
            d.pop(rid, None)

    def shutdown(self) -> None:
        if self.conn is not None:
            try:
                self.loop.run(self.conn.close(), self.cfg.save_deadline_s + 1.0)
            except Exception as exc:  # closing a cache never fails the engine's shutdown
                log.warning("event=connector_close_failed error=%r", exc)
            self.stats.write(self.conn)
        self.loop.stop()
