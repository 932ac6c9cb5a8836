"""tierkv's store: keys, block format, tiers, node, daemon, client. Kept import-light:
``import kvstore.keys`` costs only xxhash."""

__version__ = "0.1.0"
