"""What the cluster client's reads and writes are given: the :class:`Route` protocol.

:class:`~kvstore.client.cluster.ClusterClient` owns the node clients, their health and the
placement view; its read path (kvstore/client/reads.py) and write path
(kvstore/client/writes.py) are objects it owns, each given this protocol (implemented by the
ClusterClient) plus its config and counters in its constructor, so neither reaches into state
it was not handed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from kvstore.client.node import NodeClient
from kvstore.client.placement import Node
from kvstore.keys import KeyBatch


class Route(Protocol):
    @property
    def nodes(self) -> Mapping[str, NodeClient]:
        """Every member's node client, by address (down ones included)."""
        ...

    async def healthy_view(self, deadline_s: float | None = None) -> list[Node]:
        """The healthy members now (loads the first membership view when nobody did)."""
        ...

    def ranks(self, keys: KeyBatch) -> list[tuple[str, ...]]:
        """Per key, the healthy view's addresses in its rendezvous order (owners first)."""
        ...

    def standby(self) -> list[Node]:
        """The members out of the healthy view only for being slow, whose connection is up
        (writes use them when the view has fewer than ``replicas`` nodes)."""
        ...

    def healthy(self, addr: str) -> bool:
        """Whether ``addr`` is used now (not marked down)."""
        ...

    async def connect(self, addrs: Iterable[str], deadline_s: float) -> None:
        """Open the connections of those ``addrs`` never reached, within ``deadline_s``."""
        ...

    async def timed(self, addr: str, op: str, aw: Awaitable) -> Any:
        """Await one node call to ``addr`` and feed its time (and GET bytes) to health."""
        ...

    async def fan(
        self, groups: dict[str, list[int]], call: Callable[[NodeClient, list[int]], Awaitable], op: str = ""
    ) -> Iterable[tuple[str, Any]]:
        """``call(node, indices)`` on every node of ``groups`` at once, each timed into health;
        ``(addr, result)`` pairs."""
        ...
