"""The KV-connector interface (implemented by connector/ in issue 5) and its registry.

The engine calls a connector at three points, all ``async`` on the engine's event loop:

0. ``start()`` once at engine start: connections, buffers, device probes (off the request
   path).
1. ``lookup_result(token_ids, engine_keys) -> ConnectorLookup`` when a request arrives, before
   it is queued (under the connector's ``lookup_deadline_s``; a timeout or an error counts as
   0; ``engine_keys``: the engine's own keys of the prompt, :class:`EngineKeys`, or None; the
   same go to ``load`` and ``save`` as ``ConnectorRequest.engine_keys``): ``hit_tokens``, how
   many leading tokens the store holds (a multiple of ``block_tokens``), and ``found``, what
   the connector learnt (for tierkv: the prompt's keys, hashed once, and their tiers). The
   engine keeps ``found`` on the sequence and hands it back, untouched, as
   ``ConnectorRequest.lookup`` to that sequence's ``load`` and ``save``, so neither hashes the
   prompt again nor asks the store again. ``lookup(token_ids) -> int`` is ``hit_tokens`` alone.
2. ``load(request, page_ids) -> int`` when the scheduler admits a request whose reported hit
   exceeds the engine's own prefix cache: fill ``page_ids`` (holding tokens
   ``[request.first_token, request.first_token + len(page_ids) * page_size)``, block-aligned)
   and return how many tokens from ``first_token`` are valid (whole blocks, in order). The
   rest is recomputed, so a failed or partial load is never an error.
3. ``save(request, page_ids)`` once a request's prompt is computed: ``page_ids`` hold tokens
   ``[0, len(page_ids) * page_size)`` (whole blocks). The engine keeps a reference on those
   pages until ``save`` returns; copy them out first (``ctx.transfer.gather``), then send.

Pages move as one contiguous buffer per block (layout ``[layers, 2, block_tokens, kv_heads,
head_dim]``) through ``ctx.transfer`` (:class:`engine.kv_transfer.KVTransfer`): on CUDA its
copies run on a copy stream and later steps wait for them per layer, so ``load`` may return
while they are in flight; on CPU they are done when the call returns. Connectors are created
from a URL by a :class:`ConnectorRegistry`; the factory for a scheme is imported only when
that scheme is used.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from engine.errors import ConnectorError


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector gets from the engine at creation."""

    page_size: int
    kv: Any  # engine.kv_cache.KVCache: .data, .layer(i), .gather_block, .scatter_block
    namespace: Callable[[int], Any]  # block_tokens -> kvstore.keys.Namespace of this model
    model_dir: str
    device: str
    transfer: Any  # engine.kv_transfer.KVTransfer: the copy path loads and saves use


@dataclass(frozen=True)
class EngineKeys:
    """The engine's own keys of a prompt's full pages, hashed once when the request was added
    (for its prefix cache): ``keys`` a ``kvstore.keys.KeyBatch`` chained from ``namespace``,
    the id of ``ctx.namespace(page_size)``. A connector whose namespace has this id (same id:
    same chain) takes them instead of hashing the prompt again."""

    namespace: Any  # kvstore.keys.BlockKey
    keys: Any  # kvstore.keys.KeyBatch


@dataclass(frozen=True)
class ConnectorRequest:
    """A request as a connector sees it. ``page_table[i]`` holds tokens
    ``[i * page_size, (i + 1) * page_size)``; ``first_token`` is where the pages passed to
    ``load`` / ``save`` begin."""

    request_id: str
    token_ids: tuple[int, ...]
    page_table: tuple[int, ...]
    first_token: int
    lookup: Any = None  # ConnectorLookup.found of this request's lookup (None: none made)
    engine_keys: EngineKeys | None = None  # the engine's keys of the prompt (None: it has none)


@dataclass(frozen=True)
class ConnectorLookup:
    """What a connector's lookup answers: ``hit_tokens`` worth loading, and ``found``, the
    connector's own record of the lookup (opaque to the engine, which hands it back in
    ``ConnectorRequest.lookup``; None when the connector keeps nothing)."""

    hit_tokens: int
    found: Any = None


class KVConnector(ABC):
    """Base class of connectors. ``block_tokens`` must be a multiple of the page size.
    ``lookup_deadline_s`` is the connector's own deadline for one lookup: the engine waits
    for it (plus a margin, see engine/async_engine.py), never less."""

    block_tokens: int
    lookup_deadline_s: float = 1.0

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Do at engine start whatever the first request would otherwise pay for: open
        connections, allocate buffers, probe devices. Called once, on the engine's event
        loop, before any request; must not raise for a store problem (a store that is down
        at start is a miss later, not a failed start)."""

    @abstractmethod
    async def lookup(self, token_ids: Sequence[int]) -> int: ...

    async def lookup_result(
        self, token_ids: Sequence[int], engine_keys: EngineKeys | None = None
    ) -> ConnectorLookup:
        """:meth:`lookup` with the record the engine hands back to ``load`` and ``save`` (a
        connector that keeps one overrides this; the default keeps none). ``engine_keys``: the
        engine's keys of the prompt, when it has them (a connector may take them rather than
        hash the prompt again)."""
        return ConnectorLookup(await self.lookup(token_ids))

    @abstractmethod
    async def load(self, request: ConnectorRequest, page_ids: Sequence[int]) -> int: ...

    @abstractmethod
    async def save(self, request: ConnectorRequest, page_ids: Sequence[int]) -> None: ...

    def observe_prefill(self, tokens: int, seconds: float) -> None:  # noqa: B027 - optional hook
        """The engine reports a pure-prefill step: ``tokens`` computed in ``seconds`` (for a
        load-versus-recompute cost model)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (connections, buffers)."""


class MemoryConnector(KVConnector):
    """An in-process store of blocks (``memory://?block_tokens=N&fail_after=K``), keyed by
    ``kvstore.keys`` exactly as the real store is. For tests and demos: ``fail_after=K`` makes
    every load deliver only its first K blocks (then "fail"), to exercise recompute."""

    def __init__(
        self, ctx: ConnectorContext, block_tokens: int | None = None, fail_after: int | None = None
    ) -> None:
        self.ctx = ctx
        self.block_tokens = block_tokens or ctx.page_size
        if self.block_tokens % ctx.page_size:
            raise ConnectorError(
                f"block_tokens {self.block_tokens} is not a multiple of page size {ctx.page_size}"
            )
        self.pages_per_block = self.block_tokens // ctx.page_size
        self.ns = ctx.namespace(self.block_tokens)
        self.fail_after = fail_after
        self.blocks: dict[Any, tuple[tuple[int, ...], Any]] = {}
        self.loaded_blocks = self.saved_blocks = self.lookups = 0
        self.prefill_seconds = self.prefill_tokens = 0.0

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens += tokens
        self.prefill_seconds += seconds

    def _chain(self, token_ids: Sequence[int]) -> list[tuple[Any, tuple[int, ...]]]:
        bt = self.block_tokens
        keys = self.ns.block_keys(token_ids)
        return [(k, tuple(token_ids[i * bt : (i + 1) * bt])) for i, k in enumerate(keys)]

    async def lookup(self, token_ids: Sequence[int]) -> int:
        self.lookups += 1
        n = 0
        for key, toks in self._chain(token_ids):
            entry = self.blocks.get(key)
            if entry is None or entry[0] != toks:  # a collision or stale entry is a miss
                break
            n += self.block_tokens
        return n

    async def load(self, request: ConnectorRequest, page_ids: Sequence[int]) -> int:
        ppb, bt = self.pages_per_block, self.block_tokens
        chain = self._chain(request.token_ids)
        first_block = request.first_token // bt
        done = 0
        for j in range(len(page_ids) // ppb):
            if self.fail_after is not None and j >= self.fail_after:
                break
            b = first_block + j
            entry = self.blocks.get(chain[b][0]) if b < len(chain) else None
            if entry is None or entry[0] != chain[b][1]:
                break
            self.ctx.kv.scatter_block(page_ids[j * ppb : (j + 1) * ppb], entry[1])
            done += bt
            self.loaded_blocks += 1
        return done

    async def save(self, request: ConnectorRequest, page_ids: Sequence[int]) -> None:
        ppb = self.pages_per_block
        chain = self._chain(request.token_ids[: len(page_ids) * self.ctx.page_size])
        for j, (key, toks) in enumerate(chain):
            if key not in self.blocks:
                self.blocks[key] = (toks, self.ctx.kv.gather_block(page_ids[j * ppb : (j + 1) * ppb]).clone())
                self.saved_blocks += 1


def _memory_factory(url: str, ctx: ConnectorContext) -> MemoryConnector:
    q = parse_qs(urlsplit(url).query)
    bt = int(q["block_tokens"][0]) if "block_tokens" in q else None
    fail = int(q["fail_after"][0]) if "fail_after" in q else None
    return MemoryConnector(ctx, bt, fail)


def _none_factory(url: str, ctx: ConnectorContext) -> None:
    return None


# scheme -> "module:attribute" of a factory ``(url, ctx) -> KVConnector | None``; imported lazily.
BUILTIN_CONNECTORS: dict[str, str] = {
    "none": "engine.kv_connector:_none_factory",
    "memory": "engine.kv_connector:_memory_factory",
    "kvstore": "connector:create",
    "local": "connector:create",
    "etcd": "connector:create",
}


class ConnectorRegistry:
    """Named connector factories, keyed by URL scheme. A factory is a callable or a
    ``"module:attribute"`` string imported on first use."""

    def __init__(self, entries: dict[str, str | Callable] | None = None) -> None:
        self._entries: dict[str, str | Callable] = {**BUILTIN_CONNECTORS, **(entries or {})}

    def register(self, scheme: str, factory: str | Callable) -> None:
        self._entries[scheme] = factory

    def schemes(self) -> list[str]:
        return sorted(self._entries)

    def create(self, url: str, ctx: ConnectorContext) -> KVConnector | None:
        """Build the connector for ``url`` (``none`` -> None). Raises ConnectorError naming
        the URL for an unknown scheme or a factory that cannot be imported."""
        scheme = url.split("://", 1)[0] if "://" in url else url
        target = self._entries.get(scheme)
        if target is None:
            raise ConnectorError(
                f"--kv-connector {url!r}: unknown scheme {scheme!r}; known: {self.schemes()}"
            )
        if isinstance(target, str):
            mod_name, _, attr = target.partition(":")
            try:
                target = getattr(importlib.import_module(mod_name), attr)
            except (ImportError, AttributeError) as exc:
                raise ConnectorError(
                    f"--kv-connector {url!r}: cannot import {mod_name}:{attr}: {exc}"
                ) from exc
        return target(url, ctx)
