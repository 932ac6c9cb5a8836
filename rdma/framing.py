"""The frame format of the data port: ``[u32 big-endian header length][msgpack map][payload]``.

The header's ``plen`` says how many payload bytes follow (framing's only field; absent means
none). This module encodes and checks headers; :class:`rdma.channel.SocketChannel` moves them
and the payload bytes on a socket. It knows framing, never the store's ops or fields.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from rdma.transport import TransportError

LEN = struct.Struct(">I")  # the header length prefix
_PLEN = "plen"  # the header field that says how many payload bytes follow (framing's only one)


def payload_len(header: dict[str, Any]) -> int:
    """The payload bytes that follow a frame header (checked by :func:`decode_header`)."""
    return header.get(_PLEN, 0)


class FrameError(TransportError):
    """A peer sent a frame we cannot accept. ``code`` is the wire error code (see
    docs/protocol.md): ``bad_frame``, ``too_large``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def encode_header(header: dict[str, Any], plen: int) -> bytes:
    """Length prefix and msgpack body of ``header``, with ``plen`` set when a payload follows."""
    if plen:
        header = {**header, _PLEN: plen}
    body = msgpack.packb(header, use_bin_type=True)
    return LEN.pack(len(body)) + body


def header_length(prefix: bytes | bytearray, max_header: int, max_frame: int) -> int:
    """The header length a 4-byte ``prefix`` announces. FrameError ``too_large`` over either
    limit (checked before any header byte is read), ``bad_frame`` for zero."""
    (hlen,) = LEN.unpack(prefix)
    if hlen > max_header or hlen > max_frame:
        raise FrameError(
            "too_large", f"header length {hlen} exceeds the maximum {min(max_header, max_frame)}"
        )
    if hlen == 0:
        raise FrameError("bad_frame", "empty header")
    return hlen


class _TooMany(Exception):
    pass


def decode_header(raw: bytes | bytearray, max_frame: int, max_objects: int | None = None) -> dict[str, Any]:
    """The header map in ``raw`` (``hlen`` bytes). FrameError ``bad_frame`` for garbage, a
    non-map or a bad ``plen``; ``too_large`` when header and payload exceed ``max_frame``, or
    (with ``max_objects``) when the header holds more msgpack objects than that: decoding
    stops there, so a header of tiny objects (empty maps: ~64 bytes of memory per wire byte)
    costs at most ``max_objects`` of them in time and memory. Every length is bounded by the
    header's own (a string, array or map can never be longer than the bytes that carry it)."""
    n = len(raw)
    hooks: dict[str, Any] = {}
    if max_objects is not None:
        count = [0]

        def counted(obj):  # every object is an element of a map or array, but the root
            count[0] += len(obj)
            if count[0] > max_objects:
                raise _TooMany
            return obj

        hooks = {"object_hook": counted, "list_hook": counted}
    cap = n if max_objects is None else min(n, max_objects)
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True, max_str_len=n, max_bin_len=n,
            max_array_len=cap, max_map_len=cap, max_ext_len=n, **hooks,
        )  # fmt: skip
    except _TooMany:
        raise FrameError("too_large", f"header holds more than {max_objects} objects") from None
    except Exception as exc:  # msgpack raises several unrelated types
        if "exceeds max" in str(exc):  # a length over the bounds above
            raise FrameError("too_large", f"header holds more than {max_objects} objects") from None
        raise FrameError("bad_frame", f"header is not valid msgpack: {type(exc).__name__}") from exc
    if not isinstance(header, dict):
        raise FrameError("bad_frame", f"header is a {type(header).__name__}, not a map")
    plen = header.get(_PLEN, 0)
    if not isinstance(plen, int) or isinstance(plen, bool) or plen < 0:
        raise FrameError("bad_frame", f"plen must be a non-negative integer, got {plen!r}")
    if len(raw) + plen > max_frame:
        raise FrameError("too_large", f"frame of {len(raw) + plen} bytes exceeds the maximum {max_frame}")
    return header
