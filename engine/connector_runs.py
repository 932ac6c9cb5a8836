"""The KV connector's calls for one :class:`~engine.async_engine.AsyncEngine`: a request's
lookup, its loads and its save, each run as a task on the engine's event loop that reports
its end as an event (``post``) the engine loop applies between two steps. A connector that
fails or is slow costs a miss or a recompute, never an error (engine/kv_connector.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from engine.kv_connector import ConnectorLookup, ConnectorRequest, KVConnector
from engine.llm import LLMEngine
from engine.sequence import Sequence

log = logging.getLogger("engine")
CALLS = ("lookup", "load", "save")


class ConnectorRuns:
    """``post`` takes each event: ``("lookup", seq, found)``, ``("loaded", seq, first, n,
    t0)``, ``("saved", sid)``. ``lookup_timeout_s``: the engine's backstop over the
    connector's own lookup deadline."""

    def __init__(
        self,
        engine: LLMEngine,
        connector: KVConnector,
        lookup_timeout_s: float,
        post: Callable[[tuple], None],
    ) -> None:
        self.engine = engine
        self.connector = connector
        self.lookup_timeout_s = lookup_timeout_s
        self._post = post
        # per call (lookup, load, save): the ones that failed or timed out -- a lookup then
        # counts as a miss, a load that filled fewer tokens than its pages hold has the rest
        # recomputed, a save stored nothing. Exported as tierkv_engine_connector_failures.
        self.failures: Counter[str] = Counter(dict.fromkeys(CALLS, 0))

    def cached_locally(self, seq: Sequence) -> bool:
        """Whether the engine's own prefix cache holds every connector block the scheduler
        could load for ``seq``: then a lookup is a round trip for nothing. Read while a step
        may run (the prefix cache only gains entries during a step, and an eviction before
        admission only turns the hit into recompute)."""
        eng = self.engine
        ps, bt = eng.config.page_size, self.connector.block_tokens
        useful = (len(seq.prompt_tokens) - 1) // ps * ps // bt * bt  # as Scheduler caps a load
        if useful == 0:
            return True
        return len(eng.bm.match_prefix(seq.tokens, useful // ps, seq.prompt_keys)) * ps >= useful

    async def lookup(self, seq: Sequence) -> None:
        t0 = time.perf_counter()
        try:
            found = await asyncio.wait_for(
                self.connector.lookup_result(seq.prompt_tokens, seq.engine_keys), self.lookup_timeout_s
            )
        except Exception as exc:  # a slow or failing store is a miss, never an error
            log.warning("event=connector_lookup_failed request=%s error=%r", seq.request_id, exc)
            found = ConnectorLookup(0)
            self.failures["lookup"] += 1
        self.engine.timeline.observe("lookup", time.perf_counter() - t0)
        self._post(("lookup", seq, found))

    async def load(self, seq: Sequence, first: int, pages: list[int]) -> None:
        t0 = time.perf_counter()
        req = ConnectorRequest(
            seq.request_id,
            tuple(seq.tokens),
            tuple(seq.page_table),
            first,
            seq.connector_lookup,
            seq.engine_keys,
        )
        try:
            n = await self.connector.load(req, pages)
        except Exception as exc:  # the rest becomes recompute
            log.warning("event=connector_load_failed request=%s error=%r", seq.request_id, exc)
            n = 0
        if n < len(pages) * self.engine.config.page_size:
            self.failures["load"] += 1
        self._post(("loaded", seq, first, n, t0))

    async def save(self, sid: int, seq: Sequence, tokens: tuple[int, ...], pages: list[int]) -> None:
        req = ConnectorRequest(seq.request_id, tokens, tuple(pages), 0, seq.connector_lookup, seq.engine_keys)
        try:
            await self.connector.save(req, pages)
        except Exception as exc:
            log.warning("event=connector_save_failed request=%s error=%r", seq.request_id, exc)
            self.failures["save"] += 1
        finally:
            self._post(("saved", sid))
