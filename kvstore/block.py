"""The block format: a msgpack header beside a raw payload.

Payload: the KV of all layers of one block, contiguous, layout
``[layers, 2 (k, v), block_tokens, kv_heads, head_dim]`` in the model's KV dtype. The header
names the block (key, parent key, namespace id), carries its token ids, describes the payload
(dtype, shape, length) and its xxh3_64 checksum. Headers are immutable; everything here is
thread-safe.

Every reader judges a block with :func:`check_block` before using it -- the one place the
key, the reader's :class:`Expect` (parent key, token ids) and the checksum are compared: a
collision or a stale copy is MISMATCH, a corrupt one CORRUPT. The node's own reads, its disk
reads, the daemon's client (each block of a GET reply), the descriptor path and the in-process
client all call it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import xxhash

from kvstore.errors import BlockFormatError
from kvstore.keys import KEY_BYTES, BlockKey, tokens_from_le_bytes, tokens_le_bytes, trusted_key
from kvstore.status import Status

BLOCK_FORMAT_VERSION = 1
MAX_HEADER_BYTES = 1 << 20

# Item sizes of the dtypes a payload may hold (torch names).
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def checksum(payload) -> int:
    """xxh3_64 of a payload (bytes-like, no copy)."""
    return xxhash.xxh3_64_intdigest(payload)


def payload_hasher() -> xxhash.xxh3_64:
    """The streaming form of :func:`checksum` (same digest): a receive hashes each run of a
    payload as it lands, while the bytes are in the receiving core's cache (~5x faster than a
    pass over them once the whole batch is in)."""
    return xxhash.xxh3_64()


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The header of one stored block. Construct with :func:`make_header` or :meth:`decode`."""

    key: BlockKey
    parent: BlockKey
    namespace: BlockKey
    token_bytes: bytes  # little-endian int32 token ids
    dtype: str
    shape: tuple[int, ...]
    payload_len: int
    checksum: int
    created: float
    version: int = BLOCK_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.version != BLOCK_FORMAT_VERSION:
            raise BlockFormatError(f"block format version {self.version} is not {BLOCK_FORMAT_VERSION}")
        if self.dtype not in DTYPE_SIZES:
            raise BlockFormatError(f"unknown payload dtype {self.dtype!r}")
        if len(self.token_bytes) % 4 or not self.token_bytes:
            raise BlockFormatError(
                f"token bytes length {len(self.token_bytes)} is not a positive multiple of 4"
            )
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise BlockFormatError(f"bad payload shape {self.shape!r}")
        expect = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if self.payload_len != expect:
            raise BlockFormatError(
                f"payload_len {self.payload_len} does not match shape {self.shape} of {self.dtype} ({expect})"
            )
        if not 0 <= self.checksum < 2**64:
            raise BlockFormatError(f"checksum {self.checksum!r} is not a u64")

    @property
    def tokens(self) -> list[int]:
        return tokens_from_le_bytes(self.token_bytes)

    @property
    def num_tokens(self) -> int:
        return len(self.token_bytes) // 4

    def encode(self) -> bytes:
        """The msgpack encoding stored beside the payload and sent on the wire."""
        return msgpack.packb(self.wire_map(), use_bin_type=True)

    def wire_map(self) -> dict[str, object]:
        """The encoded map, its fields in their order (what :meth:`encode` packs; the layout
        in which it is written)."""
        return {
            "v": self.version,
            "key": self.key.raw,
            "parent": self.parent.raw,
            "ns": self.namespace.raw,
            "tokens": self.token_bytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "len": self.payload_len,
            "xxh3": self.checksum,
            "created": self.created,
        }

    @classmethod
    def decode(cls, data) -> BlockHeader:
        """Parse an encoded header. Raises BlockFormatError on anything malformed."""
        if len(data) > MAX_HEADER_BYTES:
            raise BlockFormatError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise BlockFormatError(f"header is not valid msgpack: {exc}") from exc
        if type(d) is not dict:
            raise BlockFormatError("header is not a map")
        fast = _well_formed(d)
        return fast if fast is not None else cls._checked(d)

    @classmethod
    def _checked(cls, d: dict) -> BlockHeader:
        """The field-by-field decode: the same checks as the fast path, naming what fails."""
        try:
            return cls(
                key=BlockKey(_bin(d["key"])),
                parent=BlockKey(_bin(d["parent"])),
                namespace=BlockKey(_bin(d["ns"])),
                token_bytes=_bin(d["tokens"]),
                dtype=_typed(d["dtype"], str, "dtype"),
                shape=tuple(_int(x, "shape") for x in _typed(d["shape"], list, "shape")),
                payload_len=_int(d["len"], "len"),
                checksum=_int(d["xxh3"], "xxh3"),
                created=float(_typed(d["created"], (int, float), "created")),
                version=_int(d["v"], "v"),
            )
        except BlockFormatError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise BlockFormatError(f"header field missing or mistyped: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class Expect:
    """What a reader expects of a block beside its key; either field may be None (unchecked)."""

    parent: BlockKey | None = None
    token_bytes: bytes | None = None


def check_block(
    header: BlockHeader, key: BlockKey, expect: Expect | None = None, digest: int | None = None
) -> Status:
    """What a reader must conclude about the block ``header`` describes, received for ``key``:
    MISMATCH when it is another block (another key, or not the parent key or token ids
    ``expect`` gives: a hash collision or a stale entry), else CORRUPT when ``digest`` (the
    payload's :func:`checksum`, computed by the receiver) is not the header's, else HIT.
    ``digest`` None: the payload was verified where it lies (a node's own memory copy, checked
    when it was stored), only the identity is judged."""
    if header.key.raw != key.raw:
        return Status.MISMATCH
    if expect is not None:
        if expect.parent is not None and header.parent.raw != expect.parent.raw:
            return Status.MISMATCH
        if expect.token_bytes is not None and header.token_bytes != expect.token_bytes:
            return Status.MISMATCH
    if digest is not None and digest != header.checksum:
        return Status.CORRUPT
    return Status.HIT


_FIELDS = ("v", "key", "parent", "ns", "tokens", "dtype", "shape", "len", "xxh3", "created")
_U64 = 1 << 64
_new = object.__new__
_set = object.__setattr__


def _well_formed(d: dict) -> BlockHeader | None:
    """A header map as :meth:`BlockHeader.encode` writes it, decoded in a few C-level checks
    (a client decodes one per block received: 2,048 of them for a 512 MiB prefix of 256 KiB
    blocks); None when anything differs from that, for :meth:`BlockHeader._checked` to name.
    Checks exactly what ``__post_init__`` and the checked path do: every field present and of
    exactly its encoded type (no bool for an int), keys 16 bytes, the version, a known dtype,
    token bytes a positive multiple of 4, a shape of ints >= 0 whose size is ``len``, a u64
    checksum."""
    try:
        v, key, parent, ns, toks, dtype, shape, plen, xxh, created = map(d.__getitem__, _FIELDS)
    except KeyError:
        return None
    if not (
        type(key) is bytes
        and type(parent) is bytes
        and type(ns) is bytes
        and len(key) == len(parent) == len(ns) == KEY_BYTES
        and type(toks) is bytes
        and type(dtype) is str
        and type(shape) is list
        and type(plen) is int
        and type(xxh) is int
        and type(v) is int
        and (type(created) is float or type(created) is int)
    ):
        return None
    size = DTYPE_SIZES.get(dtype)
    dims = tuple(shape)
    if (
        v != BLOCK_FORMAT_VERSION
        or size is None
        or not toks
        or len(toks) % 4
        or not all(type(x) is int and x >= 0 for x in dims)
        or math.prod(dims) * size != plen
        or not 0 <= xxh < _U64
    ):
        return None
    h = _new(BlockHeader)
    _set(h, "key", trusted_key(key))
    _set(h, "parent", trusted_key(parent))
    _set(h, "namespace", trusted_key(ns))
    _set(h, "token_bytes", toks)
    _set(h, "dtype", dtype)
    _set(h, "shape", dims)
    _set(h, "payload_len", plen)
    _set(h, "checksum", xxh)
    _set(h, "created", float(created))
    _set(h, "version", v)
    return h


def _bin(v) -> bytes:
    if not isinstance(v, bytes):
        raise BlockFormatError(f"expected bytes, got {type(v).__name__}")
    return v


def _typed(v, types, name: str):
    # exactly the types encode() writes: no bool for an int, no digits in a string, no float
    # truncated to an int (nor an infinite one, which int() raises OverflowError on)
    if type(v) not in (types if isinstance(types, tuple) else (types,)):
        raise BlockFormatError(f"header field {name!r}: {type(v).__name__} {v!r:.40} is not the field's type")
    return v


def _int(v, name: str) -> int:
    return _typed(v, int, name)


def make_header(
    *,
    key: BlockKey,
    parent: BlockKey,
    namespace: BlockKey,
    tokens: Sequence[int] | bytes,
    dtype: str,
    shape: Sequence[int],
    payload,
    created: float | None = None,
) -> BlockHeader:
    """Build the header of ``payload`` (bytes-like), computing its checksum."""
    tb = tokens if isinstance(tokens, bytes) else tokens_le_bytes(tokens)
    mv = memoryview(payload).cast("B")
    return BlockHeader(
        key=key,
        parent=parent,
        namespace=namespace,
        token_bytes=tb,
        dtype=dtype,
        shape=tuple(int(d) for d in shape),
        payload_len=mv.nbytes,
        checksum=checksum(mv),
        created=time.time() if created is None else created,
    )


__all__ = [
    "BLOCK_FORMAT_VERSION",
    "KEY_BYTES",
    "BlockHeader",
    "Expect",
    "check_block",
    "checksum",
    "make_header",
]
