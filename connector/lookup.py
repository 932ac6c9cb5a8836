"""The connector's lookup: how much of a prompt the store holds, and what is worth loading.

Contract. :meth:`PrefixLookup.lookup` takes a prompt's tokens (and, when the engine has them,
its own keys of the prompt's pages) and answers a :class:`~engine.kv_connector.ConnectorLookup`:

- the chain is hashed at most once per request: the engine's keys are taken as they are when
  they were hashed under the connector's namespace (same id: same chain), else the prompt is
  hashed here, once, into one :class:`~kvstore.keys.KeyBatch`;
- one store lookup of the batch under ``lookup_deadline_s``; a slow or failed lookup is a miss
  (counted under ``fallbacks{cause="lookup_timeout"}``), never an exception;
- ``hit_tokens``: the longest held prefix, cut by ``policy`` and the cost model to what is
  worth loading (a multiple of ``block_tokens``);
- ``found``: a :class:`~connector.prompt_lookup.PromptLookup` (keys and tiers) that the engine
  keeps on the sequence and hands back to load and save, so that neither hashes nor asks again
  (:func:`chain_keys`). Keys the store holds are handed to ``on_held`` (the saver's set of
  known-stored blocks), so a save does not send them again.

Runs on the engine's event loop; reads the store and the namespace through the accessors the
connector gives it (the connector owns both: a replaced store or a learnt salt reaches here).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from connector.config import ConnectorConfig
from connector.metrics import ConnectorMetrics
from connector.policy import CostModel
from connector.prompt_lookup import PromptLookup
from engine.kv_connector import ConnectorLookup, ConnectorRequest, EngineKeys
from kvstore.client import StoreClient
from kvstore.keys import KeyBatch, Namespace

log = logging.getLogger("tierkv.connector")


def chain_keys(request: ConnectorRequest, n_blocks: int, ns: Namespace) -> KeyBatch:
    """The keys of ``request``'s first ``n_blocks`` blocks under ``ns``: its lookup's (the chain
    hashed once), else the engine's own when they are ``ns``'s, and only blocks past those
    hashed here, from the last known key on. A request with neither (the tenant's salt learnt
    since, no lookup made, another namespace) is hashed here whole."""
    bt = ns.block_tokens
    known = _known_keys(request.lookup, request.engine_keys, ns)
    have = len(known)
    if have >= n_blocks:
        return known[:n_blocks]
    more = request.token_ids[have * bt : n_blocks * bt]
    return known + ns.key_batch(more, known[have - 1] if have else None)


def _known_keys(found: Any, engine_keys: EngineKeys | None, ns: Namespace) -> KeyBatch:
    if isinstance(found, PromptLookup) and found.namespace == ns.id.raw:
        return found.keys
    return engine_keys.keys if _same_namespace(engine_keys, ns) else KeyBatch()


def _same_namespace(engine_keys: EngineKeys | None, ns: Namespace) -> bool:
    return engine_keys is not None and engine_keys.namespace == ns.id


class PrefixLookup:
    """See the module docstring. ``store`` and ``namespace`` are the connector's accessors."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        store: Callable[[], StoreClient],
        namespace: Callable[[], Namespace],
        block_bytes: int,
        cost: CostModel,
        metrics: ConnectorMetrics,
        on_held: Callable[[KeyBatch], None],
    ) -> None:
        self.cfg = cfg
        self.store, self.namespace = store, namespace
        self.block_bytes = block_bytes
        self.cost, self.metrics = cost, metrics
        self.on_held = on_held

    async def lookup(
        self, token_ids: Sequence[int], engine_keys: EngineKeys | None = None
    ) -> ConnectorLookup:
        self.metrics.lookups.inc()
        ns = self.namespace()
        bt = ns.block_tokens
        if _same_namespace(engine_keys, ns) and len(engine_keys.keys) == len(token_ids) // bt:
            keys = engine_keys.keys  # the engine's hash of this chain: not hashed again
        else:
            keys = ns.key_batch(token_ids)  # the one hash of this prompt's chain
        if not len(keys):
            return ConnectorLookup(0)
        store = self.store()
        try:
            found = await asyncio.wait_for(
                store.lookup(keys, self.cfg.lookup_deadline_s), self.cfg.lookup_deadline_s
            )
        except Exception as exc:  # a slow or failed lookup is a miss
            log.debug("event=lookup_failed error=%r", exc)
            self.metrics.fallbacks.labels("lookup_timeout").inc()
            return ConnectorLookup(0, PromptLookup(ns.id.raw, keys))
        held = np.flatnonzero(np.frombuffer(found.tiers, dtype=np.uint8))
        if len(held):
            self.on_held(keys.take(held))
        record = PromptLookup.of(ns.id.raw, found, remote=not store.in_process)
        hit = found.hit_blocks
        if hit == 0:
            return ConnectorLookup(0, record)
        tiers = list(record.tiers)
        for t in set(tiers):
            self.metrics.lookup_hit_tokens.labels(t).inc(bt * tiers.count(t))
        if self.cfg.policy == "never":
            return ConnectorLookup(0, record)
        if self.cfg.policy == "always":
            return ConnectorLookup(hit * bt, record)
        d = self.cost.decide(tiers, self.block_bytes, bt)
        log.debug(
            "event=load_decision hit_blocks=%d load_blocks=%d est_load_s=%.4f est_recompute_s=%.4f prefill_tps=%.0f",
            d.hit_blocks,
            d.load_blocks,
            d.load_s,
            d.recompute_s,
            self.cost.prefill_tps,
        )
        if d.load_blocks < hit:
            self.metrics.policy_skipped_tokens.inc((hit - d.load_blocks) * bt)
        return ConnectorLookup(d.load_blocks * bt, record)
