"""What a lookup finds: one tier code per key, and the frozen result that carries them.

A tier code is one byte: 0 the key is absent (or another tenant's: the same answer), 1 HBM,
2 host DRAM, 3 disk -- lower is better, so merging the answers of a key's owners is a
minimum over the non-zero codes. EXISTS replies carry these bytes as they are
(docs/protocol.md), nodes compute them in one pass over packed keys, and a
:class:`LookupResult` keeps them with its keys so a load or save of the same request needs
no second lookup and no re-hash. Imports only the standard library and kvstore.keys;
immutable and thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import KeyFormatError
from kvstore.keys import KeyBatch

TIER_NAMES = ("hbm", "dram", "disk")  # code i + 1; best first
ABSENT = 0
TIER_CODES = {name: code for code, name in enumerate(TIER_NAMES, 1)}
MAX_CODE = len(TIER_NAMES)
_NAME_OF: tuple[str | None, ...] = (None, *TIER_NAMES)


def tier_names(codes: bytes) -> list[str | None]:
    """Each code's tier name (None: absent); codes are assumed checked (<= MAX_CODE)."""
    return list(map(_NAME_OF.__getitem__, codes))


_CODES = bytes(range(MAX_CODE + 1))  # the valid code bytes


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A prompt's keys and, per key, the best tier the store holds it in (one code byte).
    ``hit_blocks``: how many leading keys are held (the prefix a load can fetch). Made by
    :meth:`of`; handed back to the store client's load and save, which use the keys and codes
    as they are (no re-hash, no second lookup)."""

    keys: KeyBatch
    tiers: bytes
    hit_blocks: int

    def __post_init__(self) -> None:
        if not isinstance(self.keys, KeyBatch) or not isinstance(self.tiers, bytes):
            raise KeyFormatError("a lookup result holds a KeyBatch and bytes of tier codes")
        if len(self.tiers) != len(self.keys) or self.tiers.translate(None, _CODES):  # one C pass
            raise KeyFormatError(f"a lookup result has one tier code (0..{MAX_CODE}) per key")
        if self.hit_blocks != self._prefix(self.tiers):
            raise KeyFormatError(f"hit_blocks {self.hit_blocks} is not the held prefix of the codes")

    @staticmethod
    def _prefix(tiers: bytes) -> int:
        at = tiers.find(b"\x00")
        return len(tiers) if at < 0 else at

    @classmethod
    def of(cls, keys: KeyBatch, tiers: bytes) -> LookupResult:
        return cls(keys, tiers, cls._prefix(tiers))

    @classmethod
    def empty(cls, keys: KeyBatch) -> LookupResult:
        """Nothing found (the answer when the store cannot be asked)."""
        return cls(keys, bytes(len(keys)), 0)

    def names(self) -> list[str | None]:
        """Per key, its tier name or None."""
        return tier_names(self.tiers)

    def __len__(self) -> int:
        return len(self.keys)
