"""What every store client offers: the :class:`StoreClient` protocol and its write report.

:func:`kvstore.client.open` returns a StoreClient for a URL: ``local://PATH`` (an in-process
node, :mod:`kvstore.client.local`), ``kvstore://host:port[,host:port]`` (storage daemons,
a static list) or ``etcd://host:port/CLUSTER`` (daemons found through etcd), both the
replicated :class:`kvstore.client.cluster.ClusterClient`. The connector and the CLI use only
this protocol, so they never learn which store is behind it.

Contract (every implementation): batched per-key calls, one result per key in input order.
No call raises for a store problem (a node down, a timeout, a refused request): a failure is a
miss (tier code 0 / a non-HIT status), a dropped write, or ``False``, counted in ``counters``.
Every call honours its deadline (``deadline_s``; None: the client's default). Caller bugs (a
buffer list of the wrong length, a payload that does not match its header) raise
ValueError/TypeError at once. Bound to the event loop of the first call.

This module imports nothing heavy: the facade re-exports it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, overload, runtime_checkable

from kvstore.block import BlockHeader
from kvstore.keys import BlockKey, KeyBatch, Namespace
from kvstore.lookups import LookupResult
from kvstore.results import PutResult

if TYPE_CHECKING:
    from kvstore.client.read import (  # its module imports the connection code
        BlockRead,
        ReadBuffers,
        ReadExpects,
        ReadKeys,
    )


@dataclass(frozen=True)
class PutReport(Sequence[PutResult]):
    """What one ``put`` did; also the sequence of its per-block results (``report[i]``).

    ``results[i]``: block ``i``'s best result (STORED or EXISTS when a copy is held now);
    ``copies[i]``: how many nodes took or already held it; ``wanted``: the copies the store
    keeps of a block (``replicas``, fewer when the cluster has fewer members; 1 in process);
    ``node_failures``: node writes that failed (one per block per node); ``redirected``: block
    writes sent past a failed owner."""

    results: list[PutResult]
    copies: list[int]
    wanted: int
    node_failures: int = 0
    redirected: int = 0

    @classmethod
    def single(cls, results: list[PutResult]) -> PutReport:
        """The report of a store that keeps one copy (one node, in process)."""
        return cls(results, [1 if r.status.ok else 0 for r in results], 1)

    @overload
    def __getitem__(self, i: int) -> PutResult: ...
    @overload
    def __getitem__(self, i: slice) -> list[PutResult]: ...
    def __getitem__(self, i):
        return self.results[i]

    def __len__(self) -> int:
        return len(self.results)

    @property
    def stored(self) -> int:
        """Blocks held by at least one node."""
        return sum(1 for c in self.copies if c > 0)

    @property
    def dropped(self) -> int:
        """Blocks stored nowhere: the caller's data is lost for this write."""
        return sum(1 for c in self.copies if c == 0)

    @property
    def under_replicated(self) -> int:
        """Blocks stored, on fewer than ``wanted`` nodes (repair adds the rest later)."""
        return sum(1 for c in self.copies if 0 < c < self.wanted)


@runtime_checkable
class StoreClient(Protocol):
    """One store, local or remote, behind batched per-key calls (see the module docstring).

    ``in_process``: True when the blocks live in this process (tier names are the node's own,
    and :meth:`read` lends DRAM slots in place); False for daemons (their tiers are another
    machine's).
    """

    in_process: bool

    async def start(self, deadline_s: float) -> None:
        """Open what the first call would otherwise open (the store, the connections to every
        node), within ``deadline_s``. Never raises for a store problem."""
        ...

    async def tenant_namespace(self, base: Namespace, deadline_s: float | None = None) -> Namespace | None:
        """``base`` salted as the store salts this client's tenant; None when the store cannot
        say now. A store without tenants answers ``base``."""
        ...

    async def lookup(
        self, keys: KeyBatch | Sequence[BlockKey], deadline_s: float | None = None
    ) -> LookupResult:
        """The one lookup: per key the best tier holding it (visible to this client) as one
        frozen result -- a tier code per key (kvstore.lookups; 0 where not held), ``names()``
        the tier names, and ``hit_blocks``, how many leading keys are held. A caller keeps it
        with its request and loads or saves those keys without hashing them again."""
        ...

    def read(
        self, keys: ReadKeys, bufs: ReadBuffers, expect: ReadExpects = None, deadline_s: float | None = None
    ) -> BlockRead:
        """The one read: ``async with store.read(keys, bufs, expect) as r`` -- per key a result
        and, for a HIT, a view of its payload: lent store memory (in process: a leased DRAM
        slot, ``r.lent[i]``) or ``bufs[i]`` filled (daemons, the local disk); lent views are
        valid until the block exits (or ``r.release()``). See kvstore/client/read.py, whose
        ``get_into(store, keys, bufs, ...)`` is this read with every payload in ``bufs``."""
        ...

    async def put(
        self, blocks: Sequence[tuple[BlockHeader, Any]], deadline_s: float | None = None
    ) -> PutReport:
        """Store ``(header, payload)`` blocks; the report says what was stored and dropped."""
        ...

    async def delete(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> list[bool]:
        """Remove blocks; True where a copy was removed."""
        ...

    async def stats(self, deadline_s: float | None = None) -> dict[str, dict[str, Any] | None]:
        """Per node (its address, or ``local``): its STATS document, None when unreachable."""
        ...

    def register(self, buf: Any) -> None:
        """Register a staging buffer once so reads and writes through it may move bytes
        one-sidedly (RDMA); a no-op where nothing can (in process, TCP)."""
        ...

    @property
    def counters(self) -> Counter[str]:
        """What this client counted (hits, misses, dropped writes, timeouts, ...)."""
        ...

    async def close(self) -> None:
        """Release everything; later calls are misses."""
        ...
