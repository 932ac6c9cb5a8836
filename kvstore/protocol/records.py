"""Per-key result records of GET, LEASE, RESERVE and PUT/COMMIT replies, and a GET reply's
entries as columns (:class:`GetColumns`, what a client receives a batch into)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvstore.block import BlockHeader
from kvstore.errors import BlockFormatError
from kvstore.lookups import ABSENT, TIER_CODES, TIER_NAMES
from kvstore.protocol.fields import _desc, _items, _str, _u64, bad, decode_header, status_from_wire
from kvstore.protocol.header_columns import HeaderColumns
from kvstore.results import PutResult, Status
from rdma.framing import payload_len
from rdma.transport import RemoteDescriptor

_STATUS_BY_CODE = tuple(Status(c) for c in range(max(Status) + 1))  # wire code -> Status


@dataclass(frozen=True)
class GetEntry:
    """One key of a GET reply. ``header`` is the block's encoded header exactly as the node
    holds it (nil for a MISS); ``block`` is its decoded form, filled by :meth:`from_wire` (the
    reader's one decode) and None on the sending side."""

    status: Status
    header: bytes | None = None
    tier: str | None = None
    block: BlockHeader | None = field(default=None, compare=False, repr=False)

    def to_wire(self) -> list:
        return [int(self.status), self.header, self.tier]

    @classmethod
    def from_wire(cls, item: list, name: str) -> GetEntry:
        """``item``: ``[status, header|nil, tier|nil]`` (its length checked by the caller)."""
        status = status_from_wire(item[0], f"{name} status")
        raw, tier = item[1], _str(item[2], f"{name} tier", nil=True)
        block = None if raw is None else decode_header(raw, f"{name} header")
        if status is Status.HIT and block is None:
            raise bad(f"{name}: HIT without a header")
        return cls(status, raw, tier, block)


def get_entries_from_wire(items: list, field: str) -> tuple[GetEntry, ...]:
    """:meth:`GetEntry.from_wire` of each ``[status, header, tier]`` of a GET reply's
    ``field`` (each a list of 3, checked by the caller), a reply of 2,048 blocks in one pass:
    the usual entry (a status code, a tier name or nil, header bytes) checked inline and made
    without the frozen ``__init__`` (no per-field ``object.__setattr__``), every other one by
    :meth:`GetEntry.from_wire`, which names what is wrong. The same checks, the same records."""
    out = []
    new, statuses, decode = object.__new__, _STATUS_BY_CODE, BlockHeader.decode
    for i, (code, raw, tier) in enumerate(items):
        if type(code) is not int or not 0 <= code < len(statuses) or not (tier is None or type(tier) is str):
            out.append(GetEntry.from_wire([code, raw, tier], f"{field}[{i}]"))
            continue
        status = statuses[code]
        if raw is None:
            if status is Status.HIT:
                raise bad(f"{field}[{i}]: HIT without a header")
            block = None
        elif type(raw) is bytes:
            try:
                block = decode(raw)
            except BlockFormatError as exc:
                raise bad(f"{field}[{i}] header: {exc}") from exc
        else:
            block = decode_header(raw, f"{field}[{i}] header")  # names the type
        e = new(GetEntry)
        e.__dict__.update(status=status, header=raw, tier=tier, block=block)
        out.append(e)
    return tuple(out)


_PLEN_WRONG = "GET reply payload length does not match its headers"


class GetColumns:
    """A GET reply (``h``, answering ``n`` keys) as columns, not a record per entry:
    ``codes`` (one status byte per entry), ``tiers`` (name or None), ``headers``
    (:class:`~kvstore.protocol.header_columns.HeaderColumns`: keys, parents, checksums and payload
    lengths as arrays, each header decoded only when asked for), ``plen`` and ``rid``.

    It accepts and refuses exactly what ``GetReply.from_wire`` does (tests/client/
    test_fetch_columns.py): the usual reply (int status codes, str/nil tiers, bytes headers)
    is checked in bulk; any other, and any reply the bulk checks refuse, goes through
    :func:`get_entries_from_wire`, which raises the error naming the first bad entry."""

    __slots__ = ("rid", "codes", "tiers", "headers", "plen")

    def __init__(self, h: dict, n: int) -> None:
        items = _items(h, "res", n, 3)
        self.plen = payload_len(h)
        try:
            self._bulk(items)
        except _NotUsual:
            self._entries(get_entries_from_wire(items, "res"))
        hit_bytes = int(self.headers.payload_lens[self.hits()].sum())
        if self.plen != hit_bytes:
            raise bad(_PLEN_WRONG)
        self.rid = _u64(h.get("rid"), "rid")

    def _bulk(self, items: list) -> None:
        codes, raws, tiers = zip(*items) if items else ((), (), ())
        if not set(map(type, codes)) <= {int} or not set(map(type, tiers)) <= {str, type(None)}:
            raise _NotUsual
        if codes and not 0 <= min(codes) <= max(codes) < len(_STATUS_BY_CODE):
            raise _NotUsual
        self.codes = bytes(codes)
        self.tiers = tiers
        if None in raws and any(raws[i] is None for i in self.hits().tolist()):
            raise _NotUsual  # a HIT without a header: the per-entry decode names it

        def one(i: int, raw: object) -> BlockHeader:
            if type(raw) is not bytes:
                raise _NotUsual
            try:
                return BlockHeader.decode(raw)
            except BlockFormatError as exc:
                raise _NotUsual from exc

        self.headers = HeaderColumns.of(raws, one)

    def _entries(self, entries: tuple[GetEntry, ...]) -> None:
        self.codes = bytes(int(e.status) for e in entries)
        self.tiers = tuple(e.tier for e in entries)
        self.headers = HeaderColumns([e.header for e in entries])
        for i, e in enumerate(entries):
            if e.block is not None:
                self.headers.put(i, e.block)

    def hits(self) -> np.ndarray:
        """Indices of the HIT entries (their payloads follow the reply, in this order)."""
        return np.flatnonzero(np.frombuffer(self.codes, np.uint8) == Status.HIT)


class _NotUsual(Exception):
    """A reply the bulk decode does not take: the per-entry decode decides."""


@dataclass(frozen=True)
class LeaseEntry(GetEntry):
    """One key of a LEASE reply: a :class:`GetEntry` and the descriptor of the held bytes
    (None: not held; a one-sided HIT without one is a block to GET inline)."""

    desc: RemoteDescriptor | None = None

    def to_wire(self) -> list:
        return [*super().to_wire(), self.desc.to_wire() if self.desc is not None else None]

    @classmethod
    def from_wire(cls, item: list, name: str) -> LeaseEntry:
        g = GetEntry.from_wire(item[:3], name)
        return cls(g.status, g.header, g.tier, g.block, _desc(item[3], f"{name} descriptor", nil=True))


@dataclass(frozen=True)
class ReserveEntry:
    """One header of a RESERVE reply: ``desc`` of a reserved slot (status None), or the
    ``status`` it got (EXISTS, NO_SPACE, INVALID, ...), or neither: PUT that block inline."""

    status: Status | None = None
    desc: RemoteDescriptor | None = None

    def to_wire(self) -> list:
        st = int(self.status) if self.status is not None else None
        return [st, self.desc.to_wire() if self.desc is not None else None]

    @classmethod
    def from_wire(cls, item: list, name: str) -> ReserveEntry:
        st = None if item[0] is None else status_from_wire(item[0], f"{name} status")
        desc = _desc(item[1], f"{name} descriptor", nil=True)
        if st is not None and desc is not None:
            raise bad(f"{name}: a status and a descriptor")
        return cls(st, desc)


# the tier of a PUT/COMMIT result as one byte (docs/protocol.md): 0 none, then these
# the tier byte of a PUT reply is the lookup tier code (kvstore.lookups: one table for both)
PUT_TIERS: tuple[str | None, ...] = (None, *TIER_NAMES)
_PUT_TIER_CODE = {None: ABSENT, **TIER_CODES}
_STATUSES = frozenset(int(s) for s in Status)
# every (status, tier, durable) byte triple's result, made once: a reply of n blocks becomes
# its results by one C-level map over its three byte strings, not n constructions
_PUT_RESULT_OF = {
    (int(st), t, d): PutResult(st, PUT_TIERS[t], bool(d))
    for st in Status
    for t in range(len(PUT_TIERS))
    for d in (0, 1)
}


def put_results_to_wire(results: tuple[PutResult, ...]) -> dict[str, bytes]:
    """``st``, ``tier``, ``dur``: one byte per block each (status code, tier code, 0/1)."""
    return {
        "st": bytes(int(r.status) for r in results),
        "tier": bytes(_PUT_TIER_CODE.get(r.tier, 0) for r in results),
        "dur": bytes(bool(r.durable) for r in results),
    }


def put_results_from_wire(h: dict, n: int) -> tuple[PutResult, ...]:
    """The inverse of :func:`put_results_to_wire`, each field checked (length ``n``, codes)."""
    cols = []
    for name, ok in (("st", _STATUSES), ("tier", range(len(PUT_TIERS))), ("dur", (0, 1))):
        v = h.get(name)
        if not isinstance(v, bytes) or len(v) != n:
            raise bad(
                f"{name} must be {n} bytes, got {type(v).__name__} of {len(v) if isinstance(v, bytes) else '?'}"
            )
        bad_codes = set(v) - set(ok)
        if bad_codes:
            raise bad(f"{name}[{v.index(min(bad_codes))}]: unknown code {min(bad_codes)}")
        cols.append(v)
    st, tier, dur = cols
    return tuple(map(_PUT_RESULT_OF.__getitem__, zip(st, tier, dur)))
