"""Tombstones: the keys a node deleted, who deleted them and when, so a copy coming back from a
node that was away while they were deleted is not taken in again (docs/cluster.md, "Evictions
that stick").

Contract: :class:`Tombstones` holds, per deleted key, a :class:`Tombstone`: when (wall clock),
by whom (the tenant whose session deleted it; ``*`` for the operator's admin routes) and why
(``delete``: a DELETE of keys; ``evict``: a namespace eviction). They are kept **per tenant**:
each tenant's (the deleter's) at most ``per_tenant``, the oldest of *its own* going first when
it has more, so one tenant's churn never ends another's tombstone (issue 34). A key's tombstone
also ends when the key is written again by a client (:meth:`discard`: a fresh write revives
it) or when it is older than ``max_age_s``. Memory: at most ``per_tenant`` entries per tenant
that deleted something (the token file's tenants and the operator).

With a ``path`` (a side file beside the node's LMDB environment) every change is appended to
that file (:data:`_HEAD` then the tenant's name: 16-byte key, 8-byte time, cause code, name
length; time 0 revives the key) and replayed at open, so tombstones outlive a restart, kill -9
included; the file is rewritten when it holds more than twice the live records. The file of
the version before (``tombstones.bin``, 24-byte records without a deleter) is taken in at open
as the unnamed tenant's and removed. Without a path (no disk tier: a restart forgets every
block anyway) they are in memory only. A file that cannot be read or has a torn last record
keeps what it could read (logged); one that cannot be written turns tombstones in-memory only
(logged once). Never raises for an I/O problem. The daemon's peer PUT
(kvstore/daemon/block_ops.py) refuses another node's repair push of a copy older than the
tombstone with DELETED (:meth:`refuses`); the repair then drops that copy, writing no tombstone
of its own (kvstore/member/repair.py).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvstore.node")
_HEAD = struct.Struct("<16sdBH")  # key, time (0: revived), cause code, tenant name length
_LEGACY = struct.Struct("<16sd")  # the version before: key, time
FILE_NAME = "tombstones-v2.bin"
LEGACY_FILE_NAME = "tombstones.bin"
CAUSES = ("delete", "evict")  # codes 1 and 2 in the file


@dataclass(frozen=True, slots=True)
class Tombstone:
    at: float  # wall clock of the delete
    tenant: str  # who deleted: the session's tenant ("" without auth), "*" for admin routes
    cause: str  # one of CAUSES


class Tombstones:
    def __init__(
        self,
        path: str | os.PathLike | None = None,
        per_tenant: int = 1 << 16,
        max_age_s: float = 7 * 86400.0,
    ) -> None:
        if per_tenant < 1 or not max_age_s > 0:
            raise ValueError(f"tombstones: per_tenant >= 1 and max_age_s > 0, got {per_tenant}, {max_age_s}")
        self.per_tenant = per_tenant
        self.max_age_s = max_age_s
        self.path = Path(path) if path is not None else None
        self._of: dict[bytes, Tombstone] = {}
        self._order: dict[str, OrderedDict[bytes, float]] = {}  # per tenant: key -> time, oldest first
        self._records = 0  # records in the file
        self._file = None
        if self.path is not None:
            self._load()
            self._rewrite()

    @classmethod
    def beside(
        cls, directory: str | os.PathLike | None, per_tenant: int = 1 << 16, max_age_s: float = 7 * 86400.0
    ) -> Tombstones:
        """Tombstones kept in ``directory`` (the disk tier's LMDB directory), or in memory only
        when None or empty (no disk tier)."""
        return cls(Path(directory) / FILE_NAME if directory else None, per_tenant, max_age_s)

    def __len__(self) -> int:
        self._expire()
        return len(self._of)

    def __contains__(self, key: bytes) -> bool:
        return self.get(key) is not None

    def get(self, key: bytes) -> Tombstone | None:
        """``key``'s live tombstone (who deleted it, when, why), or None."""
        t = self._of.get(key)
        return t if t is not None and time.time() - t.at < self.max_age_s else None

    def deleted_at(self, key: bytes) -> float | None:
        """When this node deleted ``key`` (wall clock), None without a live tombstone."""
        t = self.get(key)
        return t.at if t is not None else None

    def refuses(self, key: bytes, created: float) -> bool:
        """Whether a peer's copy of ``key`` written at ``created`` (its header's wall clock)
        predates this node's delete of it: then the copy is what was deleted, and it is not
        taken in again. A copy written after the delete (the key stored again elsewhere) is."""
        t = self.deleted_at(key)
        return t is not None and t >= created

    def by_tenant(self) -> dict[str, int]:
        """Live tombstones per deleting tenant."""
        self._expire()
        return {tenant: len(keys) for tenant, keys in self._order.items() if keys}

    def add(self, keys: Iterable[bytes], tenant: str = "", cause: str = "delete") -> None:
        """Tombstone ``keys`` (16-byte raw keys), now, as deleted by ``tenant`` for ``cause``;
        past ``per_tenant`` of that tenant's, its oldest go."""
        code = CAUSES.index(cause) + 1  # ValueError for a cause that is not one
        now = time.time()
        stone = Tombstone(now, tenant, cause)
        name = tenant.encode()
        order = self._order.setdefault(tenant, OrderedDict())
        recs = []
        for k in keys:
            self._forget(k)
            self._of[k] = stone
            order[k] = now
            recs.append(_HEAD.pack(k, now, code, len(name)) + name)
        self._trim(tenant)
        self._append(recs)

    def discard(self, keys: Iterable[bytes]) -> None:
        """``keys`` were written again: they are alive."""
        recs = [_HEAD.pack(k, 0.0, 0, 0) for k in keys if self._forget(k)]
        self._append(recs)

    # ------------------------------------------------------------ bounds and the side file

    def _forget(self, key: bytes) -> bool:
        t = self._of.pop(key, None)
        if t is None:
            return False
        self._order[t.tenant].pop(key, None)
        return True

    def _expire(self) -> None:
        cut = time.time() - self.max_age_s
        for order in self._order.values():
            while order:
                k, t = next(iter(order.items()))
                if t >= cut:
                    break
                del order[k]
                del self._of[k]

    def _trim(self, tenant: str) -> None:
        self._expire()
        order = self._order[tenant]
        while len(order) > self.per_tenant:
            k, _ = order.popitem(last=False)
            del self._of[k]

    def _load(self) -> None:
        assert self.path is not None
        entries: dict[bytes, Tombstone] = {}
        legacy = self.path.with_name(LEGACY_FILE_NAME)
        for k, t in _read_legacy(legacy):
            entries.pop(k, None)
            if t:
                entries[k] = Tombstone(t, "", "delete")
        for k, t in _read(self.path):
            entries.pop(k, None)
            if t is not None:
                entries[k] = t
        for k, t in sorted(entries.items(), key=lambda kv: kv[1].at):
            self._of[k] = t
            self._order.setdefault(t.tenant, OrderedDict())[k] = t.at
        for tenant in list(self._order):
            self._trim(tenant)

    def _rewrite(self) -> None:
        """The file holds exactly the live tombstones (written aside, then renamed)."""
        if self.path is None:
            return
        if self._file is not None:
            self._file.close()
            self._file = None
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(b"".join(_record(k, t) for k, t in self._of.items()))
            os.replace(tmp, self.path)
            self.path.with_name(LEGACY_FILE_NAME).unlink(missing_ok=True)  # taken in at open
            self._file = open(self.path, "ab")  # noqa: SIM115 -- kept open; closed in close()
        except OSError as exc:
            log.warning("event=tombstones_not_persisted path=%s error=%r", self.path, exc)
            self.path = None
            return
        self._records = len(self._of)

    def _append(self, recs: list[bytes]) -> None:
        if not recs or self._file is None:
            return
        try:
            self._file.write(b"".join(recs))
            self._file.flush()  # in the OS's hands: survives a kill -9 of the daemon
        except OSError as exc:
            log.warning("event=tombstones_not_persisted path=%s error=%r", self.path, exc)
            self._file = None
            return
        self._records += len(recs)
        if self._records > 2 * len(self._of) + 4096:
            self._rewrite()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _record(key: bytes, t: Tombstone) -> bytes:
    name = t.tenant.encode()
    return _HEAD.pack(key, t.at, CAUSES.index(t.cause) + 1, len(name)) + name


def _bytes_of(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""
    except OSError as exc:
        log.warning("event=tombstones_unreadable path=%s error=%r", path, exc)
        return b""


def _read(path: Path) -> Iterable[tuple[bytes, Tombstone | None]]:
    """The records of ``path`` in order: (key, its tombstone, or None where revived)."""
    data, at = _bytes_of(path), 0
    while at < len(data):
        if at + _HEAD.size > len(data):
            break
        k, t, code, n = _HEAD.unpack_from(data, at)
        end = at + _HEAD.size + n
        if end > len(data):
            break
        name = data[at + _HEAD.size : end].decode(errors="replace")
        at = end
        yield k, (Tombstone(t, name, CAUSES[code - 1]) if t and 1 <= code <= len(CAUSES) else None)
    if at < len(data):
        log.warning("event=tombstones_torn_record path=%s bytes=%d", path, len(data) - at)


def _read_legacy(path: Path) -> Iterable[tuple[bytes, float]]:
    data = _bytes_of(path)
    whole = len(data) - len(data) % _LEGACY.size
    if whole != len(data):
        log.warning("event=tombstones_torn_record path=%s bytes=%d", path, len(data) - whole)
    return _LEGACY.iter_unpack(data[:whole])
