"""The peer sessions of a member node's background passes (the repair, the orphan pass).

A pass runs inside a daemon and talks to the other members as a peer: the operator token and
the peer tenant ``*`` (every tenant's blocks are visible, docs/protocol.md). Contract of
:class:`PeerSessions`: one :class:`NodeClient` per member address, opened on first use,
dropped when the member leaves (:meth:`forget_except`), all closed by :meth:`close`; every
call under the pass's deadline. Bound to the daemon's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient

PEER_TENANT = "*"  # a HELLO asking for a peer session (docs/protocol.md)


class PeerSessions:
    """``token``: the operator token ("" without auth); ``pool_size``: connections per peer;
    ``deadline_s``: each call to a peer."""

    def __init__(self, token: str, pool_size: int, deadline_s: float) -> None:
        self.cfg = ClientConfig(
            token=token,
            tenant=PEER_TENANT,
            pool_size=pool_size,
            op_timeout_s=deadline_s,
            connect_timeout_s=1.0,
        )
        self._clients: dict[str, NodeClient] = {}

    def get(self, addr: str) -> NodeClient:
        p = self._clients.get(addr)
        if p is None:
            p = self._clients[addr] = NodeClient(addr, self.cfg)
        return p

    async def forget_except(self, members: set[str]) -> None:
        """Close the sessions of addresses no longer among ``members``."""
        for gone in set(self._clients) - members:
            await self._clients.pop(gone).close()

    async def close(self) -> None:
        await asyncio.gather(*(p.close() for p in self._clients.values()))
        self._clients.clear()


def batches(items: list, n: int) -> Iterator[list]:
    """``items`` in lists of at most ``n`` (one peer call each)."""
    for i in range(0, len(items), n):
        yield items[i : i + n]
