"""One transfer of the data port: bytes moving to or from held slots, under a deadline.

Contract: :meth:`Transfers.moving` marks the held items (leases or reservations) in transfer
for the whole move (they cannot expire and be reused underneath), tells the move which are
still live (it must touch only those), and bounds the move by ``limits.transfer_timeout_s``.
Past it the move is cancelled (a copy burst in a worker thread is waited for first: nothing
touches a slot after that) and :class:`Stalled` closes the connection; the items are given
back to the node's expiry in every case. Event loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from kvstore.config import LimitsSection
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.node.leases import Lease, PackedLease, Reservation
from kvstore.node.store import NodeStore


class Stalled(ConnectionError):
    """A transfer passed its deadline: the connection is closed without a reply (the stream
    is mid-frame)."""


class Transfers:
    """Given the node whose slots move, the port's limits and metrics."""

    def __init__(self, node: NodeStore, limits: LimitsSection, metrics: DaemonMetrics) -> None:
        self.node = node
        self.limits = limits
        self.metrics = metrics

    async def moving(
        self,
        held: Sequence[Lease | PackedLease | Reservation],
        move: Callable[[list[bool]], Awaitable[object]],
    ) -> list[bool]:
        """Run ``move`` (bytes to or from the slots of ``held``) as one transfer; see the
        module docstring. Returns which items were live."""
        live = self.node.state.begin_transfer(held)
        try:
            async with asyncio.timeout(self.limits.transfer_timeout_s):
                await move(live)  # in this task: a move whose bytes are there never yields
        except TimeoutError as exc:
            self.metrics.timeouts.labels("transfer").inc()
            raise Stalled("transfer deadline passed") from exc
        finally:
            self.node.state.end_transfer([x for x, ok in zip(held, live) if ok])
        return live
