"""Network addresses: ``host:port`` (``[v6]:port`` for IPv6), parsed in one place.

Contract: :func:`parse_host_port` accepts a non-empty host, a colon and a decimal port in
1..65535, and returns the host (brackets of an IPv6 literal removed) and the port; anything
else is an :class:`~kvstore.errors.AddressError` naming the text and ``what`` it was (a node
address, an etcd endpoint, ...). It resolves nothing and opens nothing.
"""

from __future__ import annotations

from kvstore.errors import AddressError


def parse_host_port(text: str, what: str = "address") -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``; AddressError naming ``text``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise AddressError(f"{what} {text!r} is not host:port (port 1-65535)")
    return host.strip("[]"), int(port)
