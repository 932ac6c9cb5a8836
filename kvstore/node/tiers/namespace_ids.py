"""Small reference-counted ids for the namespaces a tier's blocks belong to: what each
tier's index (kvstore.node.tiers.index) packs into an entry in place of the 16-byte namespace
id, and the bytes held per namespace and per owner that the tenant shares and the stats read."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable

from kvstore.node.tiers.owners import NamespaceOwners


class NamespaceIds:
    """Small ids for the namespaces a tier's blocks belong to (a node holds a few: one per
    model, dtype and block size). Id 0 is "no namespace". Reference-counted, so an id whose
    last block is gone is reused: blocks written under ever new namespaces cannot grow it
    past the number of blocks held. The bytes of each id are summed per owner too (its
    tenant, see kvstore.node.tiers.owners; the namespace itself until a HELLO claims it): the
    unit of the tenant shares, read in O(1)."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}
        self._ns: list[bytes | None] = [None]
        self._refs: list[int] = [0]  # blocks holding each id (id 0 counted too, never freed)
        self._bytes: list[int] = [0]  # bytes of the blocks holding each id
        self._owner: list[Hashable] = [None]  # each id's owner (see owner_of)
        self._owner_bytes: dict[Hashable, int] = {}  # owner -> bytes of its blocks (tenant shares)
        self._free: list[int] = []
        self.owners: NamespaceOwners | None = None  # set by NamespaceOwners.watch's caller

    def acquire(self, ns: bytes | None, nbytes: int = 0) -> int:
        """The id of ``ns`` (one more block, of ``nbytes``, holds it); 0 for None."""
        if ns is None:
            i = 0
        else:
            i = self._ids.get(ns)  # type: ignore[assignment]
            if i is None:
                owner = self.owners.owner(ns) if self.owners is not None else ns
                if self._free:
                    i = self._free.pop()
                    self._ns[i] = ns
                    self._owner[i] = owner
                else:
                    i = len(self._ns)
                    self._ns.append(ns)
                    self._refs.append(0)
                    self._bytes.append(0)
                    self._owner.append(owner)
                self._ids[ns] = i
        self._refs[i] += 1
        self._bytes[i] += nbytes
        self._add_owner_bytes(self._owner[i], nbytes)
        return i

    def release(self, i: int, nbytes: int = 0) -> None:
        """One block holding id ``i`` (of ``nbytes``) is gone."""
        self._bytes[i] -= nbytes
        self._add_owner_bytes(self._owner[i], -nbytes)
        self._refs[i] -= 1
        if i and self._refs[i] == 0:
            del self._ids[self._ns[i]]  # type: ignore[arg-type]
            self._ns[i] = None
            self._owner[i] = None
            self._free.append(i)

    def _add_owner_bytes(self, owner: Hashable, nbytes: int) -> None:
        left = self._owner_bytes.get(owner, 0) + nbytes
        if left:
            self._owner_bytes[owner] = left
        else:  # an owner with no bytes here takes no entry (fresh namespaces cannot grow it)
            self._owner_bytes.pop(owner, None)

    def retag(self, ns: bytes, owner: Hashable) -> None:
        """Count ``ns``'s bytes under ``owner`` from now on (a HELLO claimed it)."""
        i = self._ids.get(ns)
        if i is None or self._owner[i] == owner:
            return
        self._add_owner_bytes(self._owner[i], -self._bytes[i])
        self._owner[i] = owner
        self._add_owner_bytes(owner, self._bytes[i])

    def holds(self, ns: bytes) -> bool:
        """Whether a block here holds ``ns``."""
        return ns in self._ids

    def id_of(self, ns: bytes) -> int | None:
        return self._ids.get(ns)

    def refs(self, i: int) -> int:
        return self._refs[i]

    def owner_of(self, i: int) -> Hashable:
        return self._owner[i]

    def owner_usage(self, owner: Hashable) -> int:
        """Bytes of the blocks of every namespace ``owner`` holds (one lookup)."""
        return self._owner_bytes.get(owner, 0)

    def get(self, i: int) -> bytes | None:
        return self._ns[i]

    def ids_where(self, accept: Callable[[bytes | None], bool]) -> frozenset[int]:
        """The ids whose namespace ``accept`` takes (0, "no namespace", asked as None): one
        call per id. :meth:`LruIndex.probe` asks only a :class:`Visibility`'s own namespaces."""
        return frozenset(i for i, ns in enumerate(self._ns) if accept(ns))

    def all_held_in(self, ids: frozenset[int]) -> bool:
        """Whether every block here holds an id of ``ids`` (no block holds any other id)."""
        refs = self._refs
        return sum(refs[i] for i in ids) == sum(refs)

    def count(self) -> int:
        """How many ids exist (in use or free), 0 included: ids are ``range(count())``."""
        return len(self._ns)

    def usage_summary(self, top: int) -> dict:
        """Bounded, whatever the namespaces held: the ``top`` namespaces by bytes (hex id ->
        bytes; blocks with none: ""), the rest summed (``namespaces_other``: count, bytes),
        and bytes per tenant (``tenants``; namespaces no HELLO claimed summed as
        ``unclaimed_bytes``). Its cost is one pass over the ids, on the loop."""
        held = [(ns, i) for ns, i in self._ids.items()]
        best = heapq.nlargest(top, held, key=lambda item: self._bytes[item[1]])
        namespaces = {ns.hex(): self._bytes[i] for ns, i in best}
        if self._bytes[0]:
            namespaces[""] = self._bytes[0]
        tenants: dict[str, int] = {}
        unclaimed = 0
        for owner, nbytes in self._owner_bytes.items():
            if isinstance(owner, str):
                tenants[owner] = nbytes
            elif owner is not None:
                unclaimed += nbytes
        shown = sum(self._bytes[i] for _, i in best)
        return {
            "namespaces": namespaces,
            "namespaces_other": {
                "count": len(held) - len(best),
                "bytes": sum(self._bytes) - self._bytes[0] - shown,
            },
            "tenants": tenants,
            "unclaimed_bytes": unclaimed,
        }

    def __len__(self) -> int:
        return len(self._ids)
