"""Block identity: the one function every part of tierkv uses to name a block of KV.

A prompt's tokens are cut into blocks of ``namespace.block_tokens`` tokens; only full blocks
get keys. ``key_i = H(key_{i-1} || le_int32(tokens of block i))`` with ``key_{-1} = H(namespace)``.
H is xxh3_128 (default) or blake2b-128 (namespace ``hash="blake2b_128"``, for untrusted
multi-tenant use). Nothing here is seeded or process-specific: the same prompt gives the same
keys in every process, on every machine, after every restart.

This module imports only the standard library and xxhash, so the engine can use it cheaply.
Everything here is immutable and thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from kvstore.errors import KeyFormatError

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
        return Namespace(
            self.model_fingerprint,
            self.kv_dtype,
            self.block_tokens,
            self.layout,
            self.tp_size,
            self.tp_rank,
            salt,
            self.hash,
            self.version,
        )

    def next_key(self, parent: BlockKey, block: Sequence[int]) -> BlockKey:
        """The key of ``block`` (exactly ``block_tokens`` ids) following ``parent``."""
        if len(block) != self.block_tokens:
            raise KeyFormatError(f"a block has {self.block_tokens} tokens, got {len(block)}")
        return BlockKey(_h(self.hash, parent.raw + tokens_le_bytes(block)))

    def block_keys(self, tokens: Sequence[int], start_parent: BlockKey | None = None) -> list[BlockKey]:
        """Keys of every full block of ``tokens``; a partial tail block gets no key."""
        bt = self.block_tokens
        raw = tokens_le_bytes(tokens)
        step = bt * 4
        parent = (start_parent or self.id).raw
        out: list[BlockKey] = []
        h = self.hash
        for off in range(0, (len(tokens) // bt) * step, step):
            parent = _h(h, parent + raw[off : off + step])
            out.append(BlockKey(parent))
        return out


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
