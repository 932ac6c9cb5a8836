"""Clients of the store, reached through one facade: ``kvstore.client.open(url, **options)``
returns a :class:`StoreClient` (kvstore/client/api.py) for ``local://``, ``kvstore://`` or
``etcd://`` (kvstore/client/facade.py). The connector and the CLI import only this package
(and :mod:`kvstore.keys`); the names below are re-exported for them.

Every store has one lookup (``lookup``: tier codes per key) and one read (``read``:
kvstore/client/read.py, whose ``get_into`` is that read with the bytes in the caller's
buffers). Behind it: one node (node.py over pool.py and conn.py, the descriptor path in
leased.py and rdma.py), the in-process node (local.py), the replicated cluster (cluster.py
with placement, membership, health, lookups, reads, writes, read repair) and etcd membership.

Nothing heavy is imported here: each name loads its module on first use (PEP 562), so
``import kvstore.client`` costs the daemon and the CLI nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_EXPORTS = {
    "open": "kvstore.client.facade",
    "SCHEMES": "kvstore.client.facade",
    "members": "kvstore.client.facade",
    "CountersCollector": "kvstore.client.counter_metrics",
    "StoreClient": "kvstore.client.api",
    "PutReport": "kvstore.client.api",
    "BlockRead": "kvstore.client.read",
    "get_into": "kvstore.client.read",
    "filling": "kvstore.client.read",
    "ReadKeys": "kvstore.client.read",
    "ReadBuffers": "kvstore.client.read",
    "ReadExpects": "kvstore.client.read",
    "LookupResult": "kvstore.lookups",
    "Status": "kvstore.results",
    "GetResult": "kvstore.results",
    "PutResult": "kvstore.results",
    "Expect": "kvstore.results",
    "BlockHeader": "kvstore.block",
    "make_header": "kvstore.block",
    "ConfigError": "kvstore.errors",
    "AddressError": "kvstore.errors",
    "parse_host_port": "kvstore.address",
    "Size": "kvstore.config",
    "parse_size": "kvstore.config",
    "coerce": "kvstore.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Unknown names raise AttributeError, so `from kvstore.client import rdma` still imports
    # the submodule.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore.client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
