"""Count-only tiers: the node's own tiers, index, eviction orders and placement, holding no
payload bytes. For simulations that replay a trace through a real :class:`NodeStore`
(bench/trace_sim.py) at the speed of its bookkeeping: no arena is written, no LMDB file.

- :class:`CountArena` backs a :class:`~kvstore.node.tiers.memory.MemoryTier` (DRAM): slots
  are handed out by the tier's slab allocator as usual, but nothing is written; reads return
  zeros. With one slab per block (every payload in ``(3/4, 1] x slab_size``) the tier holds
  exactly ``capacity / slab_size`` blocks.
- :class:`CountDiskTier` is the :class:`~kvstore.node.tiers.disk.DiskTier` (its capacity
  plan, eviction order, shares and protection as they are) with the LMDB reads and writes
  replaced by a dict of headers, run inline instead of on threads. With every block of
  ``block_bytes`` (payload + header) it holds ``capacity / block_bytes`` blocks.

Payloads read back are zeros: a block whose payload was not all zeros reads back corrupt. So
a count-only node serves writers whose payloads are zeros (the simulation's).
"""

from __future__ import annotations

from concurrent.futures import Executor, Future

from kvstore.node.tiers.disk import DiskTier
from kvstore.results import Status


class CountArena:
    """An arena of ``size`` bytes that stores nothing (a MemoryTier's ``arena``): writes are
    dropped, reads are zeros. ``view`` is None, so the tier lends private copies, as a GPU
    arena's."""

    pinned = False
    view = None

    def __init__(self, size: int) -> None:
        self.size = size
        self._zeros = bytes(0)

    def write(self, offset: int, src) -> None:
        pass

    def read(self, offset: int, nbytes: int) -> bytes:
        if len(self._zeros) < nbytes:
            self._zeros = bytes(nbytes)
        return self._zeros[:nbytes]

    def close(self) -> None:
        pass


class _Inline(Executor):
    """Runs each submitted call at once, in the caller's thread (no I/O to wait for)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the awaiting caller, as a thread pool does
            f.set_exception(exc)
        return f


class CountDiskTier(DiskTier):
    """A DiskTier holding headers in a dict and no payloads; its LMDB environment under
    ``path`` is opened (empty) and never written. Same arguments as :class:`DiskTier`."""

    def __init__(self, path: str, capacity: int, **kwargs) -> None:
        self._headers: dict[bytes, bytes] = {}
        super().__init__(path, capacity, map_size=1 << 20, sync=False, **kwargs)
        self._writer.shutdown()
        self._readers.shutdown()
        self._writer = self._readers = _Inline()

    def _read_batch(self, keys, bufs) -> list[tuple[Status, bytes | None]]:
        out: list[tuple[Status, bytes | None]] = []
        for key, buf in zip(keys, bufs):
            hdr = None if key is None else self._headers.get(key)
            if hdr is None:
                out.append((Status.MISS, None))
                continue
            n = self.payload_len(key)
            dst = memoryview(buf).cast("B")
            if dst.nbytes < n:
                out.append((Status.BUF_TOO_SMALL, hdr))
                continue
            dst[:n] = bytes(n)
            out.append((Status.HIT, hdr))
        return out

    def _read_header(self, key: bytes) -> bytes | None:
        return self._headers.get(key)

    def _read_headers(self, keys: list[bytes]) -> list[bytes | None]:
        return [self._headers.get(k) for k in keys]

    def _write_batch(self, todo, evict) -> None:
        for key in evict:
            self._headers.pop(key, None)
        for key, hdr, _payload in todo:
            self._headers[key] = bytes(hdr)

    def file_bytes(self) -> int:
        return 0

    def check(self) -> None:
        assert self._used <= self._capacity
        assert self._headers.keys() == self._index.keys()

    async def close(self) -> None:
        self.env.close()
