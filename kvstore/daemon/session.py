"""One data-port connection's state: who it is, what it may see, what it holds.

A one-sided hold (``grant``: the rkey of a memory window bound to its bytes) is marked in
transfer at the node for as long as the window exists, so the node never expires it: the
daemon revokes the window first (RELEASE, COMMIT, its deadline, the end of the connection) and
only then lets the slot go.

A session starts unauthenticated; HELLO fills ``tenant``, ``token`` and ``salt`` (kept so that
a SIGHUP that revokes the token or changes the tenant's salt can close the connection) and
``namespaces`` (namespace ids the daemon derived with the tenant's salt) and, when the
client's RDMA offer was accepted, ``verbs`` (this connection's queue pair, destroyed with the
session). Leases and reservations taken on
this connection are kept here under small integer handles (the descriptors' ``handle``) and
are released/aborted when the connection ends, so a client that dies never pins blocks; at
most ``limits.max_leases_per_conn`` of them at a time. Loop thread only.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.node.tiers.visibility import Visibility


@dataclass
class Held:
    obj: Any  # a NodeStore Lease or Reservation
    deadline: float  # monotonic; a lease past it may have been reclaimed by the node
    grant: int | None = None  # rkey of the memory window bound to its bytes (one-sided RDMA)


@dataclass(eq=False)  # identity: a session is a key of the port's tables
class Session:
    peer: str
    source: str = ""  # the peer's address without the port (admission's per-source shares)
    tenant: str | None = None
    token: str | None = None
    salt: str | None = None  # the tenant salt HELLO handed out (a SIGHUP that changes it closes)
    namespaces: frozenset[bytes] = frozenset()
    all_namespaces: bool = False  # a peer session (another node's repair): every tenant's blocks
    declared: dict[bytes, Any] = field(default_factory=dict)  # namespace id -> keys.Namespace
    derive_keys: bool = False  # writes must carry keys derived from their parent and tokens
    leases: dict[int, Held] = field(default_factory=dict)
    reservations: dict[int, Held] = field(default_factory=dict)
    verbs: Any = None  # rdma.verbs.VerbsTransport connected to the client's queue pair, or None
    windows: Any = None  # rdma.windows.Windows bound on ``verbs`` (per-lease remote access)
    busy: bool = False  # a request is being read and served (its reply may still be queued)
    active: int = 0  # the reader serving a request (1) and the reply sender sending (1)
    replies: Any = None  # kvstore.daemon.replies.ReplyQueue: the replies not yet sent
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _visibility: Visibility | None = None  # sees, built again when the namespaces change

    @property
    def sees(self) -> Visibility:
        """``sees(namespace_id)``: True when blocks of that namespace are this session's to
        see: one this tenant declared (and the daemon salted), or any for a peer session. A
        :class:`Visibility`, so a batch probe asks only this session's namespaces."""
        v = self._visibility
        if v is None or v.namespaces is not self.namespaces or v.everything != self.all_namespaces:
            v = self._visibility = Visibility(self.namespaces, self.all_namespaces)
        return v

    def allows(self, header) -> bool:
        """:meth:`sees` for ``header``'s namespace."""
        return header is not None and self.sees(header.namespace.raw)

    def may_write(self, header) -> bool:
        """:meth:`allows`, and with ``derive_keys`` (auth on) the header's key is the key its
        parent and tokens give in its namespace: a tenant can store a block only under a key
        it can derive, not under any 16 bytes it has seen (docs/security.md)."""
        if not self.allows(header):
            return False
        if self.all_namespaces or not self.derive_keys:  # a peer copies blocks a node verified
            return True
        try:
            return self.declared[header.namespace.raw].next_key(header.parent, header.tokens) == header.key
        except Exception:  # a token count that is not the namespace's block size
            return False

    def hold(self, table: dict[int, Held], obj: Any, ttl_s: float, grant: int | None = None) -> int:
        handle = next(self._ids)
        table[handle] = Held(obj, time.monotonic() + ttl_s, grant)
        return handle

    def overdue_grants(self, now: float) -> list[tuple[dict[int, Held], int, Held]]:
        """Holds with a memory window whose deadline has passed (the daemon revokes them)."""
        return [
            (table, handle, held)
            for table in (self.leases, self.reservations)
            for handle, held in table.items()
            if held.grant is not None and held.deadline < now
        ]

    def held(self, node_live: Callable[[Any], bool]) -> int:
        """How many handles this connection holds, after forgetting those the node already
        reclaimed (expired): they no longer count against the connection's limit."""
        for table in (self.leases, self.reservations):
            for handle in [h for h, x in table.items() if not node_live(x.obj)]:
                del table[handle]
        return len(self.leases) + len(self.reservations)

    def live(self, table: dict[int, Held], handle: int) -> Any | None:
        held = table.get(handle)
        # the node's own deadline wins when it is earlier: past it the node may reuse the slot
        deadline = min(held.deadline, getattr(held.obj, "expires", held.deadline)) if held else 0.0
        if held is None or deadline < time.monotonic():
            return None
        return held.obj
