"""Block identity: the one function every part of tierkv uses to name a block of KV.

A prompt's tokens are cut into blocks of ``namespace.block_tokens`` tokens; only full blocks
get keys. ``key_i = H(key_{i-1} || le_int32(tokens of block i))`` with ``key_{-1} = H(namespace)``.
H is xxh3_128 (default) or blake2b-128 (namespace ``hash="blake2b_128"``, for untrusted
multi-tenant use). Nothing here is seeded or process-specific: the same prompt gives the same
keys in every process, on every machine, after every restart.

A batch of keys is a :class:`KeyBatch`: one buffer of ``n × 16`` bytes, validated once, with
a :class:`BlockKey` made only where one is asked for. This module imports only the standard
library and xxhash at load (numpy only inside :meth:`KeyBatch.take` and
:meth:`KeyBatch.array`), so the engine and the connector's facade can use it cheaply.
Everything here is immutable and thread-safe.

It stays one file (~380 lines) because it is one contract, the key format of
docs/storage.md: the namespace that seeds a chain, the chain function, and the two forms a
key travels in (one :class:`BlockKey`, a :class:`KeyBatch` buffer) change together, and about
80 modules of every role import them from this one place.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, overload

import xxhash

from kvstore.errors import KeyFormatError

if TYPE_CHECKING:
    import numpy as np

KEY_FORMAT_VERSION = 1
KEY_BYTES = 16
HASHES = ("xxh3_128", "blake2b_128")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _h(hash_name: str, data: bytes) -> bytes:
    if hash_name == "xxh3_128":
        return xxhash.xxh3_128_digest(data)
    if hash_name == "blake2b_128":
        return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()
    raise KeyFormatError(f"unknown hash {hash_name!r}; expected one of {HASHES}")


@dataclass(frozen=True, slots=True)
class BlockKey:
    """A 16-byte block key. Compare, hash and store it as bytes via ``.raw``."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != KEY_BYTES:
            raise KeyFormatError(f"a block key is {KEY_BYTES} bytes, got {self.raw!r}")

    @classmethod
    def from_hex(cls, text: str) -> BlockKey:
        try:
            raw = bytes.fromhex(text)
        except ValueError as exc:
            raise KeyFormatError(f"block key {text!r} is not hex") from exc
        return cls(raw)

    @property
    def hex(self) -> str:
        return self.raw.hex()

    def __str__(self) -> str:
        return self.raw.hex()

    def __repr__(self) -> str:
        return f"BlockKey({self.raw.hex()})"


def trusted_key(raw: bytes) -> BlockKey:
    """The BlockKey of ``raw``, which the caller checked is ``bytes`` of ``KEY_BYTES``
    (a decoder that checked a whole header at once), without checking it again."""
    k = object.__new__(BlockKey)
    object.__setattr__(k, "raw", raw)
    return k


class KeyBatch(Sequence[BlockKey]):
    """``n`` block keys as one immutable buffer of ``n × 16`` bytes (key ``i`` at
    ``raw[16 i : 16 i + 16]``). Built from bytes in one check (a bytes object whose length is
    a multiple of 16, at most ``max_keys`` keys when given); no per-key object exists until
    one is indexed. Slicing and :meth:`take` give KeyBatches (copies of the bytes they
    name); ``batch[i]`` a :class:`BlockKey`. Equal and hashable by its bytes."""

    __slots__ = ("_raw", "_hash")

    def __init__(self, raw: bytes = b"", *, max_keys: int | None = None) -> None:
        if not isinstance(raw, bytes):
            raise KeyFormatError(f"a key batch is bytes, got {type(raw).__name__}")
        if len(raw) % KEY_BYTES or (max_keys is not None and len(raw) > max_keys * KEY_BYTES):
            bound = f", at most {max_keys} keys" if max_keys is not None else ""
            raise KeyFormatError(
                f"a key batch is a multiple of {KEY_BYTES} bytes{bound}; got {len(raw)} bytes"
            )
        object.__setattr__(self, "_raw", raw)
        object.__setattr__(self, "_hash", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("KeyBatch is immutable")

    @classmethod
    def of(cls, keys: Iterable[BlockKey]) -> KeyBatch:
        """The batch of ``keys`` (BlockKeys) in order; a KeyBatch is returned as it is."""
        if isinstance(keys, KeyBatch):
            return keys
        try:
            return cls(b"".join([k.raw for k in keys]))
        except AttributeError as exc:
            raise KeyFormatError(f"a key batch is made of BlockKeys: {exc}") from exc

    @property
    def raw(self) -> bytes:
        """The packed keys, ``len(self) × 16`` bytes."""
        return self._raw

    def __len__(self) -> int:
        return len(self._raw) // KEY_BYTES

    @overload
    def __getitem__(self, i: int) -> BlockKey: ...
    @overload
    def __getitem__(self, i: slice) -> KeyBatch: ...
    def __getitem__(self, i: int | slice) -> BlockKey | KeyBatch:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step == 1:
                return KeyBatch(self._raw[start * KEY_BYTES : max(start, stop) * KEY_BYTES])
            return self.take(range(start, stop, step))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"key index {i} out of range for a batch of {n}")
        i %= n
        return BlockKey(self._raw[i * KEY_BYTES : (i + 1) * KEY_BYTES])

    def __iter__(self) -> Iterator[BlockKey]:
        raw = self._raw
        for off in range(0, len(raw), KEY_BYTES):
            yield BlockKey(raw[off : off + KEY_BYTES])

    def raws(self) -> list[bytes]:
        """Each key's 16 bytes (for dict or set probes keyed by key), split in one numpy call."""
        import numpy as np

        return np.frombuffer(self._raw, dtype=f"V{KEY_BYTES}").tolist()

    def array(self) -> np.ndarray:
        """A read-only ``(n, 16)`` uint8 numpy view of the buffer (no copy)."""
        import numpy as np

        return np.frombuffer(self._raw, dtype=np.uint8).reshape(len(self), KEY_BYTES)

    def take(self, idx: Sequence[int] | np.ndarray) -> KeyBatch:
        """The keys at positions ``idx`` (ints in ``[-n, n)``, any order, repeats allowed),
        as a new batch; IndexError naming the bad position otherwise."""
        import numpy as np

        pos = np.asarray(idx, dtype=np.int64).reshape(-1)
        if not len(pos):
            return KeyBatch()
        n = len(self)
        if pos.min() < -n or pos.max() >= n:
            bad = pos[(pos < -n) | (pos >= n)][0]
            raise IndexError(f"key index {int(bad)} out of range for a batch of {n}")
        # one gather of 16-byte items (a take on V16), ten times a fancy index of (n, 16) rows
        return KeyBatch(np.frombuffer(self._raw, dtype=f"V{KEY_BYTES}").take(pos).tobytes())

    def __add__(self, other: KeyBatch) -> KeyBatch:
        if not isinstance(other, KeyBatch):
            return NotImplemented
        return KeyBatch(self._raw + other._raw)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyBatch) and self._raw == other._raw

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = hash(self._raw)
            object.__setattr__(self, "_hash", h)
        return h

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, BlockKey):
            return False
        raw, k = self._raw, key.raw
        at = raw.find(k)
        while at != -1:  # a match that straddles two keys is not a key
            if at % KEY_BYTES == 0:
                return True
            at = raw.find(k, at + 1)
        return False

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(k.hex for k in self[:2])
        return f"KeyBatch({n} keys: {head}{', ...' if n > 2 else ''})"

    def __reduce__(self):
        return (KeyBatch, (self._raw,))


def tokens_le_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes. Raises KeyFormatError for ids outside int32."""
    try:
        arr = array("i", tokens)
    except OverflowError as exc:
        raise KeyFormatError(f"token id out of int32 range in {list(tokens)[:8]}...") from exc
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte C int
        raise KeyFormatError("platform C int is not 32-bit")
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def tokens_from_le_bytes(data: bytes) -> list[int]:
    """Inverse of :func:`tokens_le_bytes`."""
    if len(data) % 4:
        raise KeyFormatError(f"token bytes length {len(data)} is not a multiple of 4")
    arr = array("i")
    arr.frombytes(data)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must match for two blocks with equal tokens to hold equal KV.

    ``model_fingerprint`` comes from :func:`model_fingerprint`; ``kv_dtype`` is a torch dtype
    name (``"bfloat16"``); ``layout`` names the payload layout (see kvstore.block);
    ``tenant_salt`` is empty for single-tenant use.
    """

    model_fingerprint: str
    kv_dtype: str
    block_tokens: int
    layout: str = "LKTHD"  # [layers, 2 (k, v), block_tokens, kv_heads, head_dim]
    tp_size: int = 1
    tp_rank: int = 0
    tenant_salt: str = ""
    hash: str = "xxh3_128"
    version: int = KEY_FORMAT_VERSION
    _root: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise KeyFormatError("namespace.model_fingerprint must not be empty")
        if not isinstance(self.block_tokens, int) or self.block_tokens <= 0:
            raise KeyFormatError(f"namespace.block_tokens must be a positive int, got {self.block_tokens!r}")
        if not (isinstance(self.tp_size, int) and self.tp_size >= 1):
            raise KeyFormatError(f"namespace.tp_size must be >= 1, got {self.tp_size!r}")
        if not (isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size):
            raise KeyFormatError(f"namespace.tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")
        if self.hash not in HASHES:
            raise KeyFormatError(f"namespace.hash {self.hash!r} is not one of {HASHES}")
        if self.version != KEY_FORMAT_VERSION:
            raise KeyFormatError(f"namespace.version {self.version} is not supported ({KEY_FORMAT_VERSION})")
        object.__setattr__(self, "_root", _h(self.hash, self.canonical()))

    def canonical(self) -> bytes:
        """The versioned canonical encoding hashed into ``key_{-1}``. Stable across releases
        of the same key-format version: fields in fixed order, sorted-key JSON, UTF-8."""
        doc = {
            "v": self.version,
            "model": self.model_fingerprint,
            "dtype": self.kv_dtype,
            "layout": self.layout,
            "block_tokens": self.block_tokens,
            "tp": [self.tp_size, self.tp_rank],
            "salt": self.tenant_salt,
            "hash": self.hash,
        }
        return b"tierkv-ns\x00" + json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @property
    def id(self) -> BlockKey:
        """``key_{-1}``: the namespace's own key; every chain starts from it."""
        return BlockKey(self._root)

    @classmethod
    def for_model(
        cls,
        model_dir: str | os.PathLike | None,
        dtype: str,
        block_tokens: int,
        *,
        layout: str = "LKTHD",
        tp_size: int = 1,
        tp_rank: int = 0,
        fingerprint: str | None = None,
    ) -> Namespace:
        """The namespace of a model's blocks: the one rule the engine (``LLMEngine.namespace``)
        and ``kvstore lookup`` both follow, so their keys agree. ``dtype``: the KV dtype the
        pages hold (a torch dtype name); ``layout``: the payload layout the engine logs at start
        (``LKTHD`` unless the KV dtype differs from the compute dtype); ``fingerprint``: instead
        of :func:`model_fingerprint` of ``model_dir`` (engines over random weights name theirs).
        No tenant: add one with :meth:`with_tenant`. Raises FileNotFoundError naming a missing
        ``config.json``, KeyFormatError naming a bad field."""
        if fingerprint is None:
            if model_dir is None:
                raise KeyFormatError("Namespace.for_model: a model folder or a fingerprint is needed")
            fingerprint = model_fingerprint(model_dir)
        return cls(fingerprint, dtype, block_tokens, layout=layout, tp_size=tp_size, tp_rank=tp_rank)

    def with_tenant(self, salt: str) -> Namespace:
        """The same namespace for another tenant (salt); blocks never cross tenants."""
        return replace(self, tenant_salt=salt)

    def next_key(self, parent: BlockKey, block: Sequence[int]) -> BlockKey:
        """The key of ``block`` (exactly ``block_tokens`` ids) following ``parent``."""
        if len(block) != self.block_tokens:
            raise KeyFormatError(f"a block has {self.block_tokens} tokens, got {len(block)}")
        return BlockKey(_h(self.hash, parent.raw + tokens_le_bytes(block)))

    def block_keys(self, tokens: Sequence[int], start_parent: BlockKey | None = None) -> list[BlockKey]:
        """Keys of every full block of ``tokens``; a partial tail block gets no key."""
        return list(self.key_batch(tokens, start_parent))

    def key_batch(self, tokens: Sequence[int], start_parent: BlockKey | None = None) -> KeyBatch:
        """:meth:`block_keys` as one :class:`KeyBatch` (the chain hashed once, no per-key
        objects): the form lookups, loads and saves carry."""
        bt = self.block_tokens
        raw = tokens_le_bytes(tokens)
        step = bt * 4
        parent = (start_parent or self.id).raw
        out = bytearray()
        h = self.hash
        for off in range(0, (len(tokens) // bt) * step, step):
            parent = _h(h, parent + raw[off : off + step])
            out += parent
        return KeyBatch(bytes(out))


def block_spans(n_tokens: int, block_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` token ranges of the full blocks of an ``n_tokens`` prompt."""
    return [(i, i + block_tokens) for i in range(0, n_tokens - n_tokens % block_tokens, block_tokens)]


def model_fingerprint(model_dir: str | os.PathLike, sample_bytes: int = 1 << 16) -> str:
    """A digest of a model folder: its ``config.json`` (canonicalised) plus, for each weight
    file (``*.safetensors``, ``*.bin``, ``*.gguf``, sorted by name), its name, size and
    ``sample_bytes`` read from its start, middle and end. Two fine-tunes of one architecture
    differ in sampled bytes, so they never share blocks. Raises FileNotFoundError naming the
    missing ``config.json``.
    """
    root = os.fspath(model_dir)
    cfg_path = os.path.join(root, "config.json")
    with open(cfg_path, "rb") as f:
        cfg = json.loads(f.read())
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode())
    weights = sorted(n for n in os.listdir(root) if n.endswith((".safetensors", ".bin", ".gguf", ".pt")))
    for name in weights:
        path = os.path.join(root, name)
        size = os.path.getsize(path)
        h.update(f"\x00{name}\x00{size}\x00".encode())
        with open(path, "rb") as f:
            for off in _sample_offsets(size, sample_bytes):
                f.seek(off)
                h.update(f.read(sample_bytes))
    return h.hexdigest()


def _sample_offsets(size: int, n: int) -> Iterable[int]:
    if size <= 3 * n:
        return (0,) if size else ()
    return (0, size // 2 - n // 2, size - n)
