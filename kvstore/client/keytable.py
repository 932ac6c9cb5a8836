"""The client's name for :mod:`kvstore.node.keytable`. The rank cache, the miss hints and the
node's tier index share that one key table; it lives in the node package because the client
already depends on the node package (never the other way round)."""

from kvstore.node.keytable import KeyTable, key_pairs

__all__ = ["KeyTable", "key_pairs"]
