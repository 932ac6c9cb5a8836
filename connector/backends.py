"""Where the connector's blocks live: the :class:`kvstore.client.StoreClient` that
``kvstore.client.open`` gives for the connector's URL (``local://`` an in-process node,
``kvstore://`` / ``etcd://`` storage daemons), built from the connector's options.

The store client keeps the store's contract: no call raises for a store problem (a failure is
a miss or a dropped write) and every call honours its deadline. :class:`Backend` is a store
that holds nothing, for an engine that shares another engine's store and must not close it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from connector.config import ConnectorConfig
from kvstore.client import GetResult, LookupResult, PutReport, PutResult, Status, StoreClient
from kvstore.client import open as open_store
from kvstore.keys import BlockKey, KeyBatch, Namespace

if TYPE_CHECKING:
    from kvstore.client import BlockRead, ReadBuffers, ReadExpects, ReadKeys


def store_url(cfg: ConnectorConfig) -> str:
    """The store URL of a connector config (its own options left out)."""
    if cfg.kind == "local":
        return f"local://{quote(cfg.target)}"  # a path may hold '?', '#' or '%'
    return f"{cfg.kind}://{cfg.target}"


def store_options(cfg: ConnectorConfig, namespace: Namespace) -> dict[str, Any]:
    """The store options of a connector config, for ``kvstore.client.open``. A daemon call's
    default deadline is the longest of the connector's (each call passes its own)."""
    if cfg.kind == "local":
        return {
            "dram_capacity": int(cfg.dram_capacity),
            "disk_capacity": int(cfg.disk_capacity),
            "disk_sync": cfg.disk_sync,
        }
    return {
        "token": cfg.token,
        "token_file": cfg.token_file,
        "tenant": cfg.tenant or None,
        "namespaces": (namespace,),
        "op_timeout_s": max(cfg.load_deadline_s, cfg.save_deadline_s),
        "replicas": cfg.replicas,
    }


def make_backend(cfg: ConnectorConfig, namespace: Namespace) -> StoreClient:
    """The connector's store for ``cfg`` (nothing opened yet). ConfigError naming the URL and
    the option when the store refuses them."""
    return open_store(store_url(cfg), **store_options(cfg, namespace))


class Backend:
    """A store that holds nothing: every read misses, every write is dropped, closing it
    closes nothing. What an engine gets in place of a store it shares with another engine."""

    in_process = False

    async def start(self, deadline_s: float) -> None:
        pass

    async def tenant_namespace(self, base: Namespace, deadline_s: float | None = None) -> Namespace | None:
        return base

    async def lookup(
        self, keys: KeyBatch | Sequence[BlockKey], deadline_s: float | None = None
    ) -> LookupResult:
        return LookupResult.empty(KeyBatch.of(keys))

    def read(
        self, keys: ReadKeys, bufs: ReadBuffers, expect: ReadExpects = None, deadline_s: float | None = None
    ) -> BlockRead:
        """Every key a miss (the arguments checked as every store checks them)."""
        from kvstore.client import filling  # the read module loads the connection code

        async def nothing(keys, bufs, exp, deadline_s) -> list[GetResult]:
            return [GetResult(Status.MISS)] * len(keys)

        return filling(nothing, keys, bufs, expect, deadline_s)

    async def put(self, blocks, deadline_s: float | None = None) -> PutReport:
        return PutReport([PutResult(Status.ERROR)] * len(blocks), [0] * len(blocks), 1)

    async def delete(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> list[bool]:
        return [False] * len(keys)

    async def stats(self, deadline_s: float | None = None) -> dict[str, dict[str, Any] | None]:
        return {}

    def register(self, buf: Any) -> None:
        pass

    @property
    def counters(self) -> Counter[str]:
        return Counter()

    async def close(self) -> None:
        pass
