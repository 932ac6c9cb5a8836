"""One frozen reply type per op (to_wire / from_wire)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Self, TypeVar

import numpy as np

from kvstore.block import BlockHeader
from kvstore.lookups import MAX_CODE, tier_names
from kvstore.protocol.fields import _bools, _items, _u64, bad, codes_from_wire, decode_header
from kvstore.protocol.records import LeaseEntry, ReserveEntry, put_results_from_wire, put_results_to_wire
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


# what a GET answers per key: the payload follows (HIT), nothing held (MISS), or the caller's
# buffer is too small for it (BUF_TOO_SMALL: its header says how large)
GET_STATUSES = frozenset({Status.HIT, Status.MISS, Status.BUF_TOO_SMALL})
_GET_CODES = bytes(sorted(GET_STATUSES))
_END = np.dtype("<u4")


@dataclass(frozen=True)
class GetReply:
    """A GET's answer as columns, one byte per key each: ``codes`` (its status: HIT, MISS or
    BUF_TOO_SMALL) and ``tiers`` (the tier it is read from, kvstore.lookups' code; 0 for a
    MISS); ``headers``, every header sent, back to back (the stored block's encoding), key
    ``i``'s from the end of key ``i - 1``'s to ``ends[i]`` (``ends``: one u32 LE per key; an
    empty span is no header: a MISS). The HIT payloads follow, in key order (``plen`` bytes).
    ``blocks``: each key's header decoded (None without one), filled by :meth:`from_wire`
    (the reader's one decode), () on the sending side."""

    rid: int
    codes: bytes
    tiers: bytes
    headers: bytes
    ends: bytes
    plen: int = 0
    blocks: tuple[BlockHeader | None, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def of(
        cls, rid: int, n: int, at: Sequence[int], codes: bytes, headers: Sequence[bytes], tiers: bytes
    ) -> GetReply:
        """The reply to ``n`` keys of which those at positions ``at`` (ascending) have a header:
        ``codes``, ``headers`` and ``tiers`` (codes) in the same order; every other key is a MISS."""
        st = np.full(n, int(Status.MISS), np.uint8)
        tier = np.zeros(n, np.uint8)
        lens = np.zeros(n, _END)
        if len(at):
            st[at] = np.frombuffer(codes, np.uint8)
            tier[at] = np.frombuffer(tiers, np.uint8)
            lens[at] = [len(h) for h in headers]
        return cls(
            rid, st.tobytes(), tier.tobytes(), b"".join(headers), np.cumsum(lens, dtype=_END).tobytes()
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "ok": True,
            "st": self.codes,
            "tier": self.tiers,
            "hdrs": self.headers,
            "hend": self.ends,
        }

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> GetReply:
        """Every column checked (lengths, codes, spans), every header decoded once (a malformed
        one is refused naming it, ``hdrs[i]``), a HIT or BUF_TOO_SMALL with a header and a
        tier, a MISS with neither, ``plen`` the HIT headers' payload lengths summed."""
        codes = codes_from_wire(h, "st", n, max(Status))
        if codes.translate(None, _GET_CODES):
            at = next(i for i, c in enumerate(codes) if c not in _GET_CODES)
            raise bad(f"st[{at}] is {codes[at]}: a GET answers HIT, MISS or BUF_TOO_SMALL")
        tiers = codes_from_wire(h, "tier", n, MAX_CODE)
        raw, ends = h.get("hdrs"), h.get("hend")
        if not isinstance(raw, bytes):
            raise bad(f"hdrs must be bin (the headers back to back), got {type(raw).__name__}")
        if not isinstance(ends, bytes) or len(ends) != 4 * n:
            raise bad(f"hend must be bin of {4 * n} bytes (u32 little-endian per key), got {ends!r:.80}")
        stops = np.frombuffer(ends, _END).tolist()
        blocks: list[BlockHeader | None] = []
        start, plen = 0, 0
        for i, (code, tier, stop) in enumerate(zip(codes, tiers, stops)):
            if stop < start or stop > len(raw):
                raise bad(f"hend[{i}] is {stop}: spans must grow within hdrs ({len(raw)} bytes)")
            b = decode_header(raw[start:stop], f"hdrs[{i}]") if stop > start else None
            if (b is None) != (code == Status.MISS) or (tier == 0) != (code == Status.MISS):
                raise bad(f"key {i}: status {code} with {'no ' if b is None else ''}header and tier {tier}")
            if code == Status.HIT:
                plen += b.payload_len
            blocks.append(b)
            start = stop
        if start != len(raw):
            raise bad(f"hdrs has {len(raw) - start} bytes past the last header")
        if payload_len(h) != plen:
            raise bad("GET reply payload length does not match its headers")
        return cls(_u64(h.get("rid"), "rid"), codes, tiers, raw, ends, plen, tuple(blocks))

    def hits(self) -> list[int]:
        """The positions of the HIT keys (their payloads follow, in this order)."""
        return [i for i, c in enumerate(self.codes) if c == Status.HIT]


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


_Entry = TypeVar("_Entry", LeaseEntry, ReserveEntry)


@dataclass(frozen=True)
class _EntriesReply(Generic[_Entry]):
    """One record per key (``ENTRY``, a short positional list of ``WIDTH`` items at most)."""

    ENTRY: ClassVar[type[LeaseEntry] | type[ReserveEntry]]
    WIDTH: ClassVar[int]
    rid: int
    entries: tuple[_Entry, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "res": [e.to_wire() for e in self.entries]}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> Self:
        res = _items(h, "res", n, cls.WIDTH)
        entries = tuple(cls.ENTRY.from_wire(x, f"res[{i}]") for i, x in enumerate(res))
        return cls(_u64(h.get("rid"), "rid"), entries)


class LeaseReply(_EntriesReply[LeaseEntry]):
    """``entries``: a :class:`LeaseEntry` per key."""

    ENTRY, WIDTH = LeaseEntry, 4


class ReserveReply(_EntriesReply[ReserveEntry]):
    """``entries``: a :class:`ReserveEntry` per key."""

    ENTRY, WIDTH = ReserveEntry, 2


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
