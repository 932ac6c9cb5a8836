"""Typed errors raised at tierkv's edges. Each names the input that was wrong.

Inside the cache path these never reach the engine: failures there become misses and counters.
"""


class TierKVError(Exception):
    """Base of every error tierkv raises on purpose."""


class ConfigError(TierKVError, ValueError):
    """A configuration key is unknown or its value is bad; the message names the key."""


class KeyFormatError(TierKVError, ValueError):
    """Bad input to block-key construction (length, namespace field, token range)."""


class BlockFormatError(TierKVError, ValueError):
    """A block header or payload cannot be decoded or does not describe its payload."""


class TierError(TierKVError):
    """A tier cannot be opened or used as configured (path, device, size)."""


class AddressError(TierKVError, ValueError):
    """A network address is not ``host:port``; the message names it and where it came from."""
