"""The client's name for :mod:`kvstore.keytable` (the rank cache and the miss hints use it;
the node's tier index uses it too, so it lives beside kvstore.keys)."""

from kvstore.keytable import KeyTable, key_pairs

__all__ = ["KeyTable", "key_pairs"]
