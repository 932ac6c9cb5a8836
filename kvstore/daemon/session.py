"""One data-port connection's state: who it is, what it may see, what it holds.

A session starts unauthenticated; HELLO fills ``tenant`` and ``namespaces`` (namespace ids the
daemon derived with the tenant's salt) and, when the client's RDMA offer was accepted,
``verbs`` (this connection's queue pair, destroyed with the session). Leases and reservations
taken on this connection are kept here under small integer handles (the descriptors'
``handle``) and are released/aborted when the connection ends, so a client that dies never
pins blocks. Loop thread only.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Held:
    obj: Any  # a NodeStore Lease or Reservation
    deadline: float  # monotonic; a lease past it may have been reclaimed by the node


@dataclass
class Session:
    peer: str
    tenant: str | None = None
    namespaces: frozenset[bytes] = frozenset()
    leases: dict[int, Held] = field(default_factory=dict)
    reservations: dict[int, Held] = field(default_factory=dict)
    verbs: Any = None  # rdma.verbs.VerbsTransport connected to the client's queue pair, or None
    busy: bool = False
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def allows(self, header) -> bool:
        """True when ``header``'s namespace is one this tenant declared (and the daemon salted)."""
        return header is not None and header.namespace.raw in self.namespaces

    def hold(self, table: dict[int, Held], obj: Any, ttl_s: float) -> int:
        handle = next(self._ids)
        table[handle] = Held(obj, time.monotonic() + ttl_s)
        return handle

    def live(self, table: dict[int, Held], handle: int) -> Any | None:
        held = table.get(handle)
        # the node's own deadline wins when it is earlier: past it the node may reuse the slot
        deadline = min(held.deadline, getattr(held.obj, "expires", held.deadline)) if held else 0.0
        if held is None or deadline < time.monotonic():
            return None
        return held.obj
