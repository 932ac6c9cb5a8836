"""The engine's KV connector on top of tierkv's store: three parts and what they share.

- lookup (connector/lookup.py): the prompt's chain hashed once, one store lookup, the cost
  model's cut; its record (:class:`~connector.prompt_lookup.PromptLookup`) travels with the
  request, and load and save take their keys from it (:func:`connector.lookup.chain_keys`).
- loader (connector/loader.py): batched, pipelined reads into the pages, verified, the first
  failure ends the load (the rest is recomputed).
- saver (connector/saver.py): blocks copied out at once, queued, written behind; ``flush``.

:class:`StoreConnector` owns what the parts share and nothing else: the store (``backend``,
replaceable: benchmarks hand one engine's store to another), the namespace (a tenant's salt,
learnt from the store after start), the cost model and the metrics. The parts read the store
and the namespace through accessors, so a replaced store or a learnt salt reaches all three.
All methods run on the engine's event loop; failures inside become misses and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Sequence

import torch

from connector.backends import make_backend
from connector.config import ConnectorConfig
from connector.flush import FlushResult
from connector.loader import Loader
from connector.lookup import PrefixLookup, chain_keys
from connector.metrics import ConnectorMetrics
from connector.policy import CostModel
from connector.prompt_lookup import PromptLookup
from connector.saver import Saver
from engine.kv_connector import ConnectorContext, ConnectorLookup, ConnectorRequest, EngineKeys, KVConnector
from kvstore.client import ConfigError, StoreClient
from kvstore.keys import KeyBatch

log = logging.getLogger("tierkv.connector")


class StoreConnector(KVConnector):
    def __init__(
        self,
        ctx: ConnectorContext,
        cfg: ConnectorConfig,
        backend: StoreClient | None = None,
        loads: bool = True,
    ) -> None:
        """``loads`` False: a connector that never loads (vLLM's scheduler side, which only
        looks up): no loader, no staging; ``load`` answers 0."""
        self.ctx, self.cfg = ctx, cfg
        self.block_tokens = cfg.block_tokens or ctx.page_size
        self.lookup_deadline_s = cfg.lookup_deadline_s  # the engine waits at least this long
        if self.block_tokens % ctx.page_size:
            raise ConfigError(
                f"block_tokens {self.block_tokens} is not a multiple of page size {ctx.page_size}"
            )
        ppb = self.pages_per_block = self.block_tokens // ctx.page_size
        self.base_ns = ctx.namespace(self.block_tokens)
        # A tenant's blocks live in its salted namespace. The salt is a secret the daemons hand
        # out at HELLO (docs/security.md): start() replaces this guess (the tenant's name, right
        # only for daemons without auth.salt_secret_file) with the salt they answer.
        self.ns = self.base_ns.with_tenant(cfg.tenant) if cfg.tenant else self.base_ns
        self._salt_learner: asyncio.Task | None = None
        kv = ctx.kv
        shape = self.block_shape = kv.block_shape(ppb)
        self.dtype_name = str(kv.dtype).removeprefix("torch.")
        self.block_bytes = math.prod(shape) * torch.empty((), dtype=kv.dtype).element_size()
        pin = torch.cuda.is_available() and str(ctx.device).startswith("cuda")
        self.layer_groups = cfg.layer_groups or ctx.transfer.auto_groups(ppb)
        self.backend = backend or make_backend(cfg, self.base_ns)
        self.cost = CostModel(cfg.prefill_tokens_per_s)
        self.metrics = ConnectorMetrics()
        self._export_store_counters()
        self.metrics.block_bytes.labels(self.dtype_name).set(self.block_bytes)

        def store() -> StoreClient:
            return self.backend

        def namespace():
            return self.ns

        self.saver = Saver(
            cfg, store, namespace, ctx.transfer, ppb, (shape, self.dtype_name, self.block_bytes), self.metrics
        )
        self.prefix = PrefixLookup(
            cfg, store, namespace, self.block_bytes, self.cost, self.metrics, self.saver.remember
        )
        self.loader = (
            None
            if not loads
            else Loader(
                cfg,
                store,
                ctx.transfer,
                self.block_tokens,
                ppb,
                (shape, kv.dtype, self.block_bytes),
                pin,
                self.layer_groups,
                self.cost,
                self.metrics,
            )
        )
        if self.loader is not None:
            self.loader.register_staging()

    def _export_store_counters(self) -> None:
        """The store client's own counters (health ejections, under-replicated writes, ...) on
        the connector's registry, so the engine's /metrics shows them."""
        from kvstore.client import CountersCollector

        self.metrics.registry.register(CountersCollector(lambda: self.backend.counters))

    async def start(self) -> None:
        """At engine start: open the store (local://) or the connections to every daemon
        (kvstore://, etcd://), and start the saver, so the first request pays none of it.
        Never raises for a store problem: a store that is down now is a miss later."""
        self.saver.start()
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

    def keys_for(self, request: ConnectorRequest, n_blocks: int) -> KeyBatch:
        """The keys of ``request``'s first ``n_blocks`` blocks (:func:`connector.lookup.chain_keys`)."""
        return chain_keys(request, n_blocks, self.ns)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine reports measured prefill speed (optional hook)."""
        self.cost.observe_prefill(tokens, seconds)
        self.metrics.prefill_tps.set(self.cost.prefill_tps)

    async def lookup(self, token_ids: Sequence[int]) -> int:
        return (await self.lookup_result(token_ids)).hit_tokens

    async def lookup_result(
        self, token_ids: Sequence[int], engine_keys: EngineKeys | None = None
    ) -> ConnectorLookup:
        return await self.prefix.lookup(token_ids, engine_keys)

    async def load(self, request: ConnectorRequest, page_ids: Sequence[int]) -> int:
        bt, ppb = self.block_tokens, self.pages_per_block
        first, n = request.first_token // bt, len(page_ids) // ppb
        if request.first_token % bt or n == 0 or self.loader is None:
            return 0
        keys = self.keys_for(request, first + n)  # the lookup's keys: no second hash
        found = request.lookup
        tiers = found.tiers_of(first, n) if isinstance(found, PromptLookup) else [None] * n
        return await self.loader.load(request, page_ids, keys, tiers, self.ns.id)

    async def save(self, request: ConnectorRequest, page_ids: Sequence[int]) -> None:
        if not self.cfg.save:
            return
        n = len(page_ids) // self.pages_per_block
        await self.saver.save(request, page_ids, self.keys_for(request, n))  # the lookup's keys

    async def flush(self, timeout_s: float = 30.0) -> FlushResult:
        """Wait until every save begun so far has copied its blocks out and every queued block
        was written or dropped; return how the saves since the previous flush ended (saved,
        dropped, failed; ``complete`` False on timeout). Callers that need the blocks stored
        (demo, benchmarks) must check it: ``bool(result)`` is True only when all were saved."""
        return await self.saver.flush(timeout_s)

    async def close(self) -> None:
        await self.flush(self.cfg.save_deadline_s)
        if self.loader is not None:
            await self.loader.close()  # buffers still being copied from: let those copies finish
        await self.saver.close()
        if self._salt_learner is not None:
            self._salt_learner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._salt_learner
        await self.backend.close()
