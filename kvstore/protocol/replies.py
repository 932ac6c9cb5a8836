"""One frozen reply type per op (to_wire / from_wire)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from kvstore.lookups import MAX_CODE, tier_names
from kvstore.protocol.fields import _bools, _items, _u64, bad, codes_from_wire
from kvstore.protocol.records import (
    GetEntry,
    LeaseEntry,
    ReserveEntry,
    get_entries_from_wire,
    put_results_from_wire,
    put_results_to_wire,
)
from kvstore.results import PutResult, Status
from rdma.framing import payload_len

# ``from_wire(h, n)``: ``n`` is the number of results the request asked for (checked).


@dataclass(frozen=True)
class ExistsReply:
    """Per key, one tier code byte (kvstore.lookups: 0 absent, 1 hbm, 2 dram, 3 disk), sent
    as one bin field; checked with one length test and one ``max``."""

    rid: int
    codes: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "tiers": self.codes}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> ExistsReply:
        return cls(_u64(h.get("rid"), "rid"), codes_from_wire(h, "tiers", n, MAX_CODE))

    @property
    def tiers(self) -> tuple[str | None, ...]:
        """Per key, its tier name or None (absent)."""
        return tuple(tier_names(self.codes))


@dataclass(frozen=True)
class GetReply:
    """The HIT entries' payloads follow, in key order (``plen`` bytes, set when sending)."""

    rid: int
    entries: tuple[GetEntry, ...]
    plen: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "res": [e.to_wire() for e in self.entries]}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> GetReply:
        entries = get_entries_from_wire(_items(h, "res", n, 3), "res")
        plen = payload_len(h)
        if plen != sum(e.block.payload_len for e in entries if e.status is Status.HIT):
            raise bad("GET reply payload length does not match its headers")
        return cls(_u64(h.get("rid"), "rid"), entries, plen)


@dataclass(frozen=True)
class PutReply:
    """Per block (PUT) or handle (COMMIT): status, tier, durable, as three byte strings of one
    byte per block (:func:`~kvstore.protocol.records.put_results_to_wire`)."""

    rid: int
    results: tuple[PutResult, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, **put_results_to_wire(self.results)}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> Self:
        return cls(_u64(h.get("rid"), "rid"), put_results_from_wire(h, n))


class CommitReply(PutReply):
    pass


@dataclass(frozen=True)
class _FlagsReply:
    """One true/false per key, handle or descriptor of the request."""

    rid: int
    res: tuple[bool, ...]
    plen: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "res": list(self.res)}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> Self:
        return cls(_u64(h.get("rid"), "rid"), _bools(h, n), payload_len(h))


@dataclass(frozen=True)
class DeleteReply:
    """Per key one byte, sent as one bin field: 1 where the key was stored (for this tenant)
    and is now gone, 0 otherwise."""

    rid: int
    done: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "res": self.done}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> DeleteReply:
        return cls(_u64(h.get("rid"), "rid"), codes_from_wire(h, "res", n, 1))

    @property
    def res(self) -> tuple[bool, ...]:
        return tuple(map(bool, self.done))


class ReleaseReply(_FlagsReply):
    """True where the handle was held."""


class ReadReply(_FlagsReply):
    """True where the descriptor's bytes follow (in order; ``plen`` bytes in all)."""


class WriteReply(_FlagsReply):
    """True where the descriptor's bytes were written."""


@dataclass(frozen=True)
class LeaseReply:
    rid: int
    entries: tuple[LeaseEntry, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "res": [e.to_wire() for e in self.entries]}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> LeaseReply:
        res = _items(h, "res", n, 4)
        return cls(
            _u64(h.get("rid"), "rid"), tuple(LeaseEntry.from_wire(x, f"res[{i}]") for i, x in enumerate(res))
        )


@dataclass(frozen=True)
class ReserveReply:
    rid: int
    entries: tuple[ReserveEntry, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "res": [e.to_wire() for e in self.entries]}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> ReserveReply:
        res = _items(h, "res", n, 2)
        return cls(
            _u64(h.get("rid"), "rid"),
            tuple(ReserveEntry.from_wire(x, f"res[{i}]") for i, x in enumerate(res)),
        )


@dataclass(frozen=True)
class StatsReply:
    """The counters the caller may see (docs/protocol.md, STATS)."""

    rid: int
    stats: dict[str, Any]

    @classmethod
    def of(
        cls,
        rid: int,
        tenant: str,
        connections: int,
        counters: dict[str, int],
        node: dict[str, Any] | None = None,
        daemon: dict[str, Any] | None = None,
    ) -> StatsReply:
        """``stats.tenant``: the caller's tenant, its open connections and its ``counters``;
        beside it (only without auth: one tenant) the node's ``stats()`` map and ``daemon``."""
        stats = dict(node or {})
        if daemon is not None:
            stats["daemon"] = daemon
        stats["tenant"] = {"tenant": tenant, "connections": connections, **counters}
        return cls(rid, stats)

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "stats": self.stats}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int = 0) -> StatsReply:
        stats = h.get("stats") or {}
        if not isinstance(stats, dict):
            raise bad(f"stats must be a map, got {type(stats).__name__}")
        return cls(_u64(h.get("rid"), "rid"), stats)
