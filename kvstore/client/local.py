"""``local://PATH``: a :class:`~kvstore.client.api.StoreClient` over an in-process node.

The node (:class:`kvstore.node.store.NodeStore`: DRAM, then LMDB disk under ``PATH/disk``) is
opened on the first call or at :meth:`LocalClient.start`, in the caller's event loop. The one
read (:meth:`LocalClient.read`) leases each block in DRAM and lends its slot's bytes until it
is released (blocks on disk only are read straight into the caller's buffer);
:func:`kvstore.client.read.get_into` is that read with the lent bytes copied out. The one
lookup (:meth:`LocalClient.lookup`) is the node's tier codes over the packed keys. Writes
reserve a slot, copy the payload in and commit it: the node's own two-phase sequences, the
ones a daemon runs for its clients.

Same contract as every StoreClient (kvstore/client/api.py): a failure of the node (an I/O
error, a deadline) is a miss or a dropped write, logged, never an exception to the caller.
There are no tenants: namespaces are not salted.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstore.block import BlockHeader, check_block
from kvstore.client.api import PutReport
from kvstore.client.conn import byte_view
from kvstore.client.read import BlockRead, Filled, ReadBuffers, ReadExpects, ReadKeys, check_read
from kvstore.keys import BlockKey, KeyBatch, Namespace
from kvstore.lookups import TIER_CODES, LookupResult
from kvstore.results import Expect, GetResult, PutResult, Status

if TYPE_CHECKING:  # the node's modules load at the first call (tiers, LMDB)
    from kvstore.node.leases import Lease
    from kvstore.node.store import NodeStore

log = logging.getLogger("kvstore.client.local")
_DISK = TIER_CODES["disk"]


class LocalClient:
    """An in-process node under ``path``; sizes in bytes or size strings (``"1GiB"``).
    ConfigError naming the key for a bad size. See the module docstring."""

    in_process = True

    def __init__(
        self,
        path: str,
        dram_capacity: int = 1 << 30,
        disk_capacity: int = 8 << 30,
        disk_sync: bool = False,
        op_timeout_s: float = 5.0,
    ) -> None:
        from kvstore.config import load_store_config  # light: the node's tiers load at first use

        if not path:
            raise ValueError("local store: the path is empty")
        self.path = path
        self.op_timeout_s = op_timeout_s
        # built here, so a bad size is a ConfigError from open(), not a failed first call
        self.store_cfg = load_store_config(
            None,
            {
                "node.name": "local",
                "dram.capacity": dram_capacity,
                "disk.path": os.path.join(path, "disk"),
                "disk.capacity": disk_capacity,
                "disk.sync": disk_sync,
            },
            env={},  # the engine's environment does not configure its cache
        )
        self._counters: Counter[str] = Counter()
        self._node: NodeStore | None = None
        self._opening: asyncio.Lock | None = None

    @property
    def node(self) -> NodeStore | None:
        """The open :class:`~kvstore.node.store.NodeStore`, or None before the first call."""
        return self._node

    async def _get(self) -> NodeStore:
        if self._node is None:
            from kvstore.node.store import NodeStore  # heavy (tiers, LMDB): only when used

            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                if self._node is None:
                    self._node = await NodeStore.open(self.store_cfg)
        return self._node

    async def start(self, deadline_s: float = 0.0) -> None:
        # Opening allocates the DRAM tier and opens LMDB: seconds for a large tier. No deadline
        # of its own: start waits for it, so the first request never does.
        await self._get()

    async def tenant_namespace(self, base: Namespace, deadline_s: float | None = None) -> Namespace | None:
        return base  # an in-process node has no tenants

    def register(self, buf: Any) -> None:
        """Nothing moves one-sidedly in process."""

    def _failed(self, op: str, exc: BaseException) -> None:
        self._counters["errors"] += 1
        log.warning("event=local_%s_failed error=%r", op, exc)

    async def lookup(
        self, keys: KeyBatch | Sequence[BlockKey], deadline_s: float | None = None
    ) -> LookupResult:
        """The one lookup: per key the best tier holding it (one code, kvstore.lookups)."""
        batch = KeyBatch.of(keys)
        try:
            # the first call may open the node: it gets longer than a lookup's deadline
            node = await asyncio.wait_for(self._get(), (deadline_s or self.op_timeout_s) * 20)
            # no tenants in process: every block is visible
            return LookupResult.of(batch, await node.lookup(batch, _every))
        except Exception as exc:  # the cache path never raises to the engine
            self._failed("lookup", exc)
            return LookupResult.empty(batch)

    def read(
        self, keys: ReadKeys, bufs: ReadBuffers, expect: ReadExpects = None, deadline_s: float | None = None
    ) -> BlockRead:
        """The one read (kvstore/client/read.py): blocks in DRAM are leased and lent in place
        (read-only views of their slots, zero copy) until the read is released or its lease
        ends (four times the deadline, at least 4 s); blocks on disk only are read straight
        into their buffers (the node's checksum-verified read, CORRUPT for a bad copy) -- a
        lease would first copy each into a fresh private buffer, and the connector's staging
        buffers are reused precisely so that a load never faults in new pages. A block that
        does not match its key and expectation is MISMATCH; one longer than its buffer
        BUF_TOO_SMALL."""
        exp = check_read("read", keys, bufs, expect)
        views = [byte_view(b) for b in bufs]  # TypeError now for a buffer that cannot be filled
        deadline = deadline_s or self.op_timeout_s

        async def fill() -> Filled:
            try:
                got = await asyncio.wait_for(self._lend(keys, views, exp, max(deadline, 1.0) * 4), deadline)
            except Exception as exc:  # the cache path never raises to the engine
                self._failed("get", exc)
                n = len(keys)
                return [GetResult(Status.ERROR)] * n, [None] * n, [False] * n, None
            for r in got[0]:
                self._counters["hits" if r.status is Status.HIT else "misses"] += 1
            return got

        return BlockRead(fill)

    async def _lend(self, keys, views: list[memoryview], exp: list, ttl_s: float) -> Filled:
        node = await self._get()
        on_disk = [c == _DISK for c in await node.lookup(KeyBatch.of(keys), _every)]
        n = len(keys)
        results: list[GetResult] = [GetResult(Status.MISS)] * n
        lent_views: list[memoryview | None] = [None] * n
        lent = [False] * n
        mem = [i for i, d in enumerate(on_disk) if not d]
        leases = await node.leaser.lease([keys[i] for i in mem], ttl_s)
        held = [x for x in leases if x is not None]

        def release() -> None:
            node.state.release(held)

        try:
            for i, lease in zip(mem, leases):
                results[i] = _check_lease(keys[i], views[i], exp[i], lease)
                if results[i].status is Status.HIT:
                    lent_views[i], lent[i] = lease.view, True
            disk = [i for i, d in enumerate(on_disk) if d]
            if disk:
                got = await node.reader.read(
                    [keys[i] for i in disk], [views[i] for i in disk], [exp[i] for i in disk]
                )
                for i, r in zip(disk, got):
                    results[i] = r
                    if r.status is Status.HIT:
                        lent_views[i] = views[i][: r.header.payload_len]
        except BaseException:  # give the leases back now rather than at their TTL
            release()
            raise
        return results, lent_views, lent, release

    async def put(
        self, blocks: Sequence[tuple[BlockHeader, Any]], deadline_s: float | None = None
    ) -> PutReport:
        """Reserve a slot per block, copy its payload in, commit (the checksum is verified at
        commit: INVALID). ValueError for a payload whose length is not its header's."""
        views = [memoryview(p).cast("B") for _, p in blocks]
        for (h, _), mv in zip(blocks, views):
            if mv.nbytes != h.payload_len:
                raise ValueError(f"block {h.key}: payload is {mv.nbytes} bytes, header says {h.payload_len}")
        try:
            node = await self._get()
            results = await asyncio.wait_for(
                _reserve_copy_commit(node, blocks, views), deadline_s or self.op_timeout_s
            )
        except Exception as exc:
            self._failed("put", exc)
            results = [PutResult(Status.ERROR)] * len(blocks)
        for r in results:
            self._counters["stored" if r.status.ok else "dropped_writes"] += 1
        return PutReport.single(results)

    async def delete(self, keys: Sequence[BlockKey], deadline_s: float | None = None) -> list[bool]:
        try:
            node = await self._get()
            return await asyncio.wait_for(node.delete(keys), deadline_s or self.op_timeout_s)
        except Exception as exc:
            self._failed("delete", exc)
            return [False] * len(keys)

    async def stats(self, deadline_s: float | None = None) -> dict[str, dict[str, Any] | None]:
        try:
            return {"local": (await self._get()).inspector.stats()}
        except Exception as exc:
            self._failed("stats", exc)
            return {"local": None}

    @property
    def counters(self) -> Counter[str]:
        """This client's counts (hits, misses, stored, dropped_writes, errors)."""
        return Counter(self._counters)

    async def close(self) -> None:
        if self._node is not None:
            await self._node.close()
            self._node = None


def _check_lease(key: BlockKey, view: memoryview, exp: Expect | None, lease: Lease | None) -> GetResult:
    """One leased block's result: HIT when it matches its key and expectation and fits."""
    if lease is None:
        return GetResult(Status.MISS)
    hdr = lease.header
    if check_block(hdr, key, exp) is not Status.HIT:  # its bytes were verified when stored
        return GetResult(Status.MISMATCH, hdr, lease.tier)
    if hdr.payload_len > view.nbytes:
        return GetResult(Status.BUF_TOO_SMALL, hdr, lease.tier)
    return GetResult(Status.HIT, hdr, lease.tier)


async def _reserve_copy_commit(
    node: NodeStore, blocks: Sequence[tuple[BlockHeader, Any]], views: list[memoryview]
) -> list[PutResult]:
    """The node's two-phase write: a slot per block, the payload copied in, then commit."""
    reserved = await node.writer.reserve([h for h, _ in blocks])
    out: list[PutResult] = [PutResult(Status.ERROR)] * len(blocks)
    held = []
    try:
        for i, (mv, r) in enumerate(zip(views, reserved)):
            if isinstance(r, Status):
                out[i] = PutResult(r)
            else:
                r.view[:] = mv
                held.append((i, r))
    except BaseException:  # give every slot back now rather than at the lease TTL
        node.state.abort([r for r in reserved if not isinstance(r, Status)])
        raise
    for (i, _), res in zip(held, await node.writer.commit([r for _, r in held])):
        out[i] = res
    return out


def _every(namespace_id: bytes | None) -> bool:
    return True
