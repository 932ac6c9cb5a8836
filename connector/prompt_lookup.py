"""What the connector's lookup of one prompt found, kept for that request's load and save.

The engine keeps a :class:`PromptLookup` on its sequence (``ConnectorLookup.found``) and hands
it back in ``ConnectorRequest.lookup``: the load reads its keys and tiers, the save its keys,
so the prompt's chain is hashed once per request and the store asked once. Frozen; the keys
are one :class:`~kvstore.keys.KeyBatch`, the tiers the cost model's names of the held prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.client import LookupResult
from kvstore.keys import KeyBatch

# a tier code's name for the cost model: a daemon's DRAM is not this process's
_LOCAL = (None, "hbm", "dram", "disk")
_REMOTE = (None, "remote:hbm", "remote:dram", "remote:disk")


@dataclass(frozen=True)
class PromptLookup:
    """``namespace``: the id (raw bytes) the ``keys`` were hashed under -- a load or save under
    another (the tenant's salt learnt since) hashes again; ``keys``: every full block of the
    prompt; ``tiers``: per block of the held prefix, its tier as the cost model names it."""

    namespace: bytes
    keys: KeyBatch
    tiers: tuple[str | None, ...] = ()

    @classmethod
    def of(cls, namespace: bytes, found: LookupResult, remote: bool) -> PromptLookup:
        names = _REMOTE if remote else _LOCAL
        return cls(namespace, found.keys, tuple(map(names.__getitem__, found.tiers[: found.hit_blocks])))

    def tiers_of(self, first: int, n: int) -> list[str | None]:
        """The tiers of blocks ``first .. first + n - 1`` (None past the held prefix)."""
        got = list(self.tiers[first : first + n])
        return got + [None] * (n - len(got))
