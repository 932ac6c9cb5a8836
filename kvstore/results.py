"""Per-key results of the store's batched operations, shared by tiers, node, daemon and client.

Every batched call returns one result per input key, in input order; a failure of one key
never fails the batch. :class:`Status` (kvstore/status.py) and :class:`Expect`
(kvstore/block.py, beside the check that uses it) are re-exported here, where callers look
for a read's vocabulary.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvstore.block import BlockHeader, Expect
from kvstore.keys import BlockKey
from kvstore.status import Status

__all__ = ["BlockInfo", "Expect", "GetResult", "GetResults", "PutResult", "Status"]


@dataclass(frozen=True, slots=True)
class GetResult:
    status: Status
    header: BlockHeader | None = None
    tier: str | None = None


_STATUS_OF_CODE = tuple(Status(c) for c in range(max(Status) + 1))


class GetResults(Sequence[GetResult]):
    """One read's results as one object: ``codes`` (one status byte per key, the wire's
    codes), ``tiers`` (per key), ``hit_bytes`` (payload bytes of the HITs) and each key's
    header on demand. ``results[i]`` is key ``i``'s :class:`GetResult`, made when it is
    indexed (a batch of 2,048 blocks needs no record per block until someone asks), so it
    is used as the list of GetResults it stands for, and equals one."""

    __slots__ = ("codes", "tiers", "hit_bytes", "_starts", "_headers")

    def __init__(
        self,
        codes: bytes,
        tiers: Sequence[str | None],
        header: Callable[[int], BlockHeader | None],
        hit_bytes: int,
    ) -> None:
        self.codes = codes
        self.tiers = tiers
        self.hit_bytes = hit_bytes
        self._starts = [0]  # where each joined part's header lookup begins
        self._headers = [header]

    @classmethod
    def of(cls, results: Sequence[GetResult]) -> GetResults:
        """The results of a read that made one record per key (returned as they are if
        they are a GetResults already)."""
        if isinstance(results, GetResults):
            return results
        rs = list(results)
        hit_bytes = sum(r.header.payload_len for r in rs if r.status is Status.HIT and r.header is not None)
        return cls(
            bytes(int(r.status) for r in rs), tuple(r.tier for r in rs), lambda i: rs[i].header, hit_bytes
        )

    @classmethod
    def failed(cls, status: Status, n: int) -> GetResults:
        """``n`` keys that all got ``status`` (a failed call), without a header or tier."""
        return cls(bytes([int(status)]) * n, (None,) * n, _no_header, 0)

    @classmethod
    def join(cls, parts: Sequence[GetResults]) -> GetResults:
        """``parts`` one after the other, as one."""
        if len(parts) == 1:
            return parts[0]
        out = cls(b"".join(p.codes for p in parts), [t for p in parts for t in p.tiers], _no_header, 0)
        out._starts, out._headers, at = [], [], 0
        for p in parts:
            out._starts += [at + s for s in p._starts]
            out._headers += p._headers
            out.hit_bytes += p.hit_bytes
            at += len(p)
        return out

    def count_of(self, status: Status) -> int:
        """How many keys got ``status``."""
        return self.codes.count(int(status))

    def header(self, i: int) -> BlockHeader | None:
        k = bisect.bisect_right(self._starts, i) - 1
        return self._headers[k](i - self._starts[k])

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return GetResult(_STATUS_OF_CODE[self.codes[i]], self.header(i), self.tiers[i])

    def __iter__(self) -> Iterator[GetResult]:
        return map(self.__getitem__, range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"GetResults({list(self)!r})"


def _no_header(i: int) -> None:
    return None


@dataclass(frozen=True, slots=True)
class PutResult:
    status: Status
    tier: str | None = None
    durable: bool = False  # True once the block is committed (and synced, if configured) on disk


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What the node knows of a block without reading it (for listings and the admin API)."""

    key: BlockKey
    namespace: BlockKey
    tiers: tuple[str, ...]
    payload_len: int
    num_tokens: int
    created: float
    last_access: float
    leases: int
    pinned: bool
