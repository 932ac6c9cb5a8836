"""Membership: which storage nodes exist, from a static list or from etcd, behind one interface.

Contract: a :class:`Membership` holds the current :class:`Member` set (``members``, a tuple
sorted by address) and a ``version`` that rises on every change; ``wait_changed(version)``
returns once the version passed ``version``. ``start()`` loads the first view (a static source
never changes afterwards); ``close()`` stops watching. A source that loses its backing service
(etcd down) keeps serving its last known members: the data path never depends on it being up.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.address import parse_host_port
from kvstore.client.placement import Node
from kvstore.errors import AddressError


class MembershipError(ValueError):
    """Bad membership input (an address, a URL, a registration record), naming it."""


@dataclass(frozen=True, slots=True)
class Member:
    """One storage node: its data address (``host:port``), capacity in bytes (0: unknown, weight
    1), zone, name and admin address (``host:port`` of its admin HTTP port; "" when unknown)."""

    addr: str
    capacity: int = 0
    zone: str = ""
    name: str = ""
    admin: str = ""

    def __post_init__(self) -> None:
        try:
            parse_host_port(self.addr, "member address")
        except AddressError as exc:
            raise MembershipError(str(exc)) from exc
        if self.capacity < 0:
            raise MembershipError(f"member {self.addr}: capacity must be >= 0, got {self.capacity}")

    @property
    def node(self) -> Node:
        """The placement view: weight in GiB of capacity (1 when unknown)."""
        return Node(self.addr, self.capacity / (1 << 30) if self.capacity else 1.0, self.zone)

    def to_json(self) -> str:
        return json.dumps(
            {
                "addr": self.addr,
                "capacity": self.capacity,
                "zone": self.zone,
                "name": self.name,
                "admin": self.admin,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Member:
        """Parse a registration record; MembershipError naming the record when it is bad."""
        try:
            doc = json.loads(text)
            return cls(
                addr=str(doc["addr"]),
                capacity=int(doc.get("capacity", 0)),
                zone=str(doc.get("zone", "")),
                name=str(doc.get("name", "")),
                admin=str(doc.get("admin", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise MembershipError(f"bad member record {text!r}: {exc}") from exc


class Membership:
    """The interface (and the shared change-notification machinery)."""

    def __init__(self) -> None:
        self._members: tuple[Member, ...] = ()
        self.version = 0
        self._changed = asyncio.Condition()

    @property
    def members(self) -> tuple[Member, ...]:
        return self._members

    async def start(self, wait_s: float = 2.0) -> None:
        """Load the first view, waiting up to ``wait_s`` for it. Never raises for an
        unreachable service (the view stays empty until it answers)."""

    async def close(self) -> None:
        """Stop watching; ``members`` keeps its last value."""

    async def wait_changed(self, version: int, timeout_s: float | None = None) -> int:
        """Wait until ``self.version > version`` (or the timeout); return the current version."""

        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: self.version > version)

        try:
            await asyncio.wait_for(wait(), timeout_s)
        except TimeoutError:
            pass
        return self.version

    def _set(self, members: Sequence[Member]) -> None:
        new = tuple(sorted(members, key=lambda m: m.addr))
        if new == self._members:
            return
        self._members = new
        self.version += 1
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


class StaticMembership(Membership):
    """A fixed list (the config's, or ``kvstore://a,b,c``); never changes."""

    def __init__(self, members: Sequence[Member | str]) -> None:
        super().__init__()
        ms = [m if isinstance(m, Member) else Member(m) for m in members]
        if not ms:
            raise MembershipError("a static membership needs at least one node address")
        if len({m.addr for m in ms}) != len(ms):
            raise MembershipError(f"duplicate node address in {[m.addr for m in ms]}")
        self._members = tuple(sorted(ms, key=lambda m: m.addr))
        self.version = 1
