"""What one connection may see: the namespaces its tenant declared (or every one, for a peer
session: another node's repair). A callable, ``namespace id -> bool``, as every tenant check
asks it; :meth:`~kvstore.node.tiers.index.LruIndex.probe` also reads ``namespaces`` itself, so
a batch's check costs the connection's few namespaces, not one call per namespace the tier
holds (another tenant's thousands of namespaces cost it nothing)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Visibility:
    namespaces: frozenset[bytes] = frozenset()
    everything: bool = False  # a peer session: every tenant's blocks

    def __call__(self, namespace_id: bytes | None) -> bool:
        return namespace_id is not None and (self.everything or namespace_id in self.namespaces)
