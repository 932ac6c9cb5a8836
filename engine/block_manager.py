"""Page pool with reference counts and the HBM prefix cache (tier 0).

Every page is in exactly one state: *free* (no content worth keeping), *cached* (refcount 0,
holds a full page of a known prefix, evictable in LRU order) or *in use* (refcount > 0). A
full, computed page is named by the same chained key the store uses
(``kvstore.keys.Namespace.next_key`` with ``block_tokens == page_size``), so a new request
reuses every full cached page of its prefix. Allocation is check-then-commit: a call either
gets all it asked for or changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from kvstore.keys import BlockKey, Namespace


class PoolIntegrityError(AssertionError):
    """The pool's bookkeeping is inconsistent (a bug, never a user error)."""


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, namespace: Namespace | None) -> None:
        """``namespace`` (``block_tokens == page_size``) keys the prefix cache; None disables it."""
        if namespace is not None and namespace.block_tokens != page_size:
            raise ValueError(f"namespace.block_tokens {namespace.block_tokens} != page_size {page_size}")
        self.num_pages, self.page_size, self.namespace = num_pages, page_size, namespace
        self.refcount = [0] * num_pages
        self.page_key: list[BlockKey | None] = [None] * num_pages
        self.page_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self.free_pages: deque[int] = deque(range(num_pages))
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages, oldest first
        self.cache: dict[BlockKey, int] = {}
        self.hit_tokens_total = 0
        self.evictions = 0

    # ---- queries ------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Pages an allocation can take now (free + evictable cached)."""
        return len(self.free_pages) + len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_available

    def pages_needed(self, have: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - have)

    def prompt_keys(self, tokens: Sequence[int]) -> list[BlockKey]:
        """Keys of every full page of ``tokens`` in one batched pass ([] without a cache)."""
        return self.namespace.block_keys(tokens) if self.namespace is not None else []

    def match_prefix(
        self, tokens: Sequence[int], max_pages: int, known: Sequence[BlockKey] = ()
    ) -> list[int]:
        """Cached pages holding the longest prefix of ``tokens`` (at most ``max_pages`` pages).
        ``known`` holds keys of its first pages already computed (:meth:`prompt_keys`); the
        rest are hashed here. Takes no references. A key hit whose stored tokens differ is a
        miss."""
        if self.namespace is None or max_pages <= 0:
            return []
        ps = self.page_size
        out: list[int] = []
        parent = self.namespace.id
        for i in range(min(max_pages, len(tokens) // ps)):
            block = tuple(tokens[i * ps : (i + 1) * ps])
            key = known[i] if i < len(known) else self.namespace.next_key(parent, block)
            page = self.cache.get(key)
            if page is None or self.page_tokens[page] != block:
                break
            out.append(page)
            parent = key
        return out

    # ---- check-then-commit --------------------------------------------------------------
    def can_take(self, shared: Iterable[int], num_new: int) -> bool:
        """Whether referencing ``shared`` cached pages and allocating ``num_new`` fresh ones
        fits: shared pages sitting in the LRU stop being available once referenced."""
        in_lru = sum(1 for p in shared if p in self.lru)
        return num_new <= self.num_available - in_lru

    def take(self, shared: Sequence[int], num_new: int) -> list[int]:
        """Reference ``shared`` and allocate ``num_new`` pages; returns the new pages. Raises
        MemoryError (and changes nothing) when :meth:`can_take` is false."""
        if not self.can_take(shared, num_new):
            raise MemoryError(f"need {num_new} pages, {self.num_available} available")
        for p in shared:
            if self.refcount[p] == 0:
                self.lru.pop(p, None)
            self.refcount[p] += 1
        new = []
        for _ in range(num_new):
            if self.free_pages:
                p = self.free_pages.popleft()
            else:
                p, _ = self.lru.popitem(last=False)  # evict the least recently used
                del self.cache[self.page_key[p]]
                self.page_key[p] = self.page_tokens[p] = None
                self.evictions += 1
            self.refcount[p] = 1
            new.append(p)
        return new

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise PoolIntegrityError(f"incref of page {p} with refcount {self.refcount[p]}")
            self.refcount[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page. Pages reaching zero become cached (if keyed) or
        free. Released in reverse so a sequence's tail is evicted before its prefix."""
        for p in reversed(pages):
            if self.refcount[p] <= 0:
                raise PoolIntegrityError(f"release of page {p} with refcount {self.refcount[p]}")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                if self.page_key[p] is not None:
                    self.lru[p] = None
                else:
                    self.free_pages.append(p)

    def register(
        self,
        tokens: Sequence[int],
        page_table: Sequence[int],
        keys: list[BlockKey],
        num_computed: int,
        known: Sequence[BlockKey] = (),
    ) -> None:
        """Name every newly full, computed page of a sequence in the prefix cache. ``keys``
        is the sequence's key list, extended in place; ``known`` keys of its first pages
        already computed (not hashed again). A key already cached (another sequence computed
        the same prefix) leaves this page unnamed; it is freed normally."""
        if self.namespace is None:
            return
        ps = self.page_size
        full = min(num_computed // ps, len(page_table))
        parent = keys[-1] if keys else self.namespace.id
        for i in range(len(keys), full):
            block = tuple(tokens[i * ps : (i + 1) * ps])
            key = known[i] if i < len(known) else self.namespace.next_key(parent, block)
            keys.append(key)
            parent = key
            page = page_table[i]
            if key not in self.cache and self.page_key[page] is None:
                self.cache[key] = page
                self.page_key[page] = key
                self.page_tokens[page] = block

    # ---- integrity ----------------------------------------------------------------------
    def check(self, live_tables: Iterable[Sequence[int]] | None = None) -> None:
        """Raise PoolIntegrityError unless every page is in exactly one state, the cache map
        and page keys agree, and (given every live page table and extra holder) refcounts
        equal the number of references."""
        free, lru = set(self.free_pages), set(self.lru)
        if len(free) != len(self.free_pages):
            raise PoolIntegrityError("duplicate page in free list")
        if free & lru:
            raise PoolIntegrityError(f"pages both free and cached: {sorted(free & lru)[:8]}")
        for p in range(self.num_pages):
            rc = self.refcount[p]
            states = (p in free) + (p in lru) + (rc > 0)
            if rc < 0 or states != 1:
                raise PoolIntegrityError(f"page {p}: refcount {rc}, free={p in free}, cached={p in lru}")
            if p in free and self.page_key[p] is not None:
                raise PoolIntegrityError(f"free page {p} still has a key")
            if p in lru and self.page_key[p] is None:
                raise PoolIntegrityError(f"cached page {p} has no key")
        for key, p in self.cache.items():
            if self.page_key[p] != key:
                raise PoolIntegrityError(f"cache maps {key} to page {p} holding {self.page_key[p]}")
        if sum(k is not None for k in self.page_key) != len(self.cache):
            raise PoolIntegrityError("a keyed page is missing from the cache map")
        if live_tables is not None:
            counts = [0] * self.num_pages
            for table in live_tables:
                for p in table:
                    counts[p] += 1
            if counts != self.refcount:
                bad = [p for p in range(self.num_pages) if counts[p] != self.refcount[p]][:8]
                raise PoolIntegrityError(f"refcounts disagree with live page tables at pages {bad}")

    def forget(self, keys: Iterable[BlockKey]) -> None:
        """Drop these keys' unreferenced cached pages (they become free); others stay."""
        for key in keys:
            p = self.cache.get(key)
            if p is not None and p in self.lru:
                del self.cache[key]
                del self.lru[p]
                self.page_key[p] = self.page_tokens[p] = None
                self.free_pages.append(p)

    def reset_cache(self) -> None:
        """Forget every cached (unreferenced) page: they become free."""
        for p in list(self.lru):
            del self.cache[self.page_key[p]]
            self.page_key[p] = self.page_tokens[p] = None
            self.free_pages.append(p)
        self.lru.clear()
