"""The descriptor ops of the data port: LEASE/READ/RELEASE and RESERVE/WRITE/COMMIT.

These are the RDMA-shaped halves of GET and PUT (docs/protocol.md): the node hands out
descriptors of leased or reserved slots. By default a descriptor is an offset in the held
payload and the READ/WRITE ops move the bytes over TCP. With ``rdma: true`` (only on a
connection whose HELLO set up a queue pair) it is the slot's address in the registered DRAM
slab and the rkey of a memory window bound to exactly those bytes on this connection's queue
pair (rdma/windows.py; the slab's own key grants nothing remotely), revoked at RELEASE,
COMMIT, the hold's deadline or the end of the connection, before the slot is let go; the
client moves the bytes one-sidedly; a block whose bytes are not in
the slab then gets no descriptor (and no hold): the client moves it with GET/PUT instead.
Over TCP too, a reservation with no host slot (disk or GPU tier: it would need a private
buffer) gets no descriptor and no hold, so no buffer exists before its bytes arrive; a RESERVE
header whose payload_len is over ``server.max_frame`` is a bad_request.
Leases and reservations live in the connection's :class:`~kvstore.daemon.session.Session` and
end with it; a connection holds at most ``limits.max_leases_per_conn`` of them, and a LEASE
ttl is at most ``limits.max_lease_ttl_s``. The bytes of disk-only blocks a tenant's LEASEs hold
(private copies, or promotions into DRAM) are at most ``server.max_frame`` per connection and
``limits.max_leased_disk_bytes_per_tenant`` over all its connections: past either, the block
answers MISS (the tenant's own block: this reveals nothing about another's), so an idle lease
pins at most its tenant's share. A LEASE checks the tenant before any work on a block (the
node's Leaser, ``sees``), and a RESERVE makes no room (nothing is evicted for bytes that may
never come) and answers BUSY for a key another tenant holds, as PUT does. READ and WRITE move bytes only under a live
lease/reservation, marked in transfer for the move (kvstore/daemon/transfer.py: it cannot
expire meanwhile). Owned by :class:`~kvstore.daemon.dataport.DataServer`, which gives it what
it uses in its constructor and calls :meth:`DescriptorOps.unwindow` and
:meth:`DescriptorOps.expire_windows` for a session's holds; event loop thread only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from kvstore import protocol as P
from kvstore.config import LimitsSection
from kvstore.daemon.block_ops import stored_header
from kvstore.daemon.logs import RateLimitedLog
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.slab_rdma import SlabRdma, slab_descriptor
from kvstore.daemon.transfer import Transfers
from kvstore.node.store import NodeStore
from kvstore.results import PutResult, Status
from rdma.transport import RemoteDescriptor, TransportError


class DescriptorOps:
    """``rdma``: the node's registered slab (None: TCP only); ``tenant_stats`` is the port's
    per-tenant counters (shared, written here); ``bad`` logs a peer's failures, rate-limited."""

    def __init__(
        self,
        node: NodeStore,
        metrics: DaemonMetrics,
        transfers: Transfers,
        limits: LimitsSection,
        tenant_stats: dict[str, Counter[str]],
        lease_ttl: float,
        rdma: SlabRdma | None,
        bad: RateLimitedLog,
        max_frame: int,
    ) -> None:
        self.node = node
        self.metrics = metrics
        self.transfers = transfers
        self.limits = limits
        self.tenant_stats = tenant_stats
        self.lease_ttl = lease_ttl
        self.rdma = rdma
        self._bad = bad
        self.max_frame = max_frame

    def ops(self) -> dict[str, Callable]:
        """The handlers by op name: ``await handler(ch, sess, request, plen)``, ``request`` the
        op's typed request (kvstore/protocol/requests.py) and ``plen`` the payload bytes that follow."""
        return {
            P.LeaseRequest.OP: self._op_lease,
            P.ReleaseRequest.OP: self._op_release,
            P.ReadRequest.OP: self._op_read,
            P.ReserveRequest.OP: self._op_reserve,
            P.WriteRequest.OP: self._op_write,
            P.CommitRequest.OP: self._op_commit,
        }

    def _room_for(self, sess, n: int) -> None:
        """bad_request when ``n`` more handles would pass the connection's limit."""
        held = sess.held(self.node.state.is_live)
        cap = self.limits.max_leases_per_conn
        if held + n > cap:
            raise P.bad(f"this connection holds {held} leases/reservations; at most {cap} (release some)")

    def _one_sided(self, sess, want: bool) -> bool:
        """The request's ``rdma`` flag; bad_request when the connection has no queue pair."""
        if want and (sess.verbs is None or self.rdma is None):
            raise P.bad("rdma: this connection has no RDMA queue pair (HELLO set none up)")
        return want

    async def _describe(
        self, sess, table, held, ttl, one_sided: bool, write: bool = False
    ) -> RemoteDescriptor | None:
        """Hold ``held`` (a Lease or Reservation) under a new handle and describe its bytes: an
        offset descriptor (TCP), or with ``one_sided`` their address in the registered slab and
        the rkey of a memory window bound to exactly them (read access for a lease, write for
        a reservation) on this connection's queue pair; None, holding nothing, when one-sided
        access was asked for and the bytes are not in the slab or the window cannot be bound
        (the client then moves them inline)."""
        if not one_sided:
            return RemoteDescriptor(sess.hold(table, held, ttl), 0, held.header.payload_len)
        place = slab_descriptor(self.rdma.slab, 0, held)
        if place is None or sess.windows is None:
            return None
        # a window is a transfer: marked before the grant's await, so the hold cannot lapse
        # (and its slot be reused) while the window is bound; one already lapsed gets none
        if not self.node.state.begin_transfer([held])[0]:
            return None
        try:
            rkey = await sess.windows.grant(self.rdma.slab, place.addr, place.length, write)
        except TransportError as exc:
            self.node.state.end_transfer([held])
            self.metrics.rdma_accept_failures.inc()
            self._bad.info("window_failed", peer=sess.peer, error=exc)
            return None
        except BaseException:
            self.node.state.end_transfer([held])
            raise
        return RemoteDescriptor(sess.hold(table, held, ttl, rkey), place.addr, place.length, rkey)

    def unwindow(self, sess, held) -> None:
        """Revoke ``held``'s memory window (if any) before its slot may go anywhere."""
        if held.grant is not None:
            if sess.windows is not None:
                sess.windows.revoke(held.grant)
            self.node.state.end_transfer([held.obj])
            held.grant = None

    def expire_windows(self, sess) -> None:
        """Revoke and give back one-sided holds past their deadline (the node does not expire
        them: they are marked in transfer while their window exists). Called before every
        request: a session without windows (TCP) holds no grant, so it returns at once."""
        if sess.windows is None:
            return
        for table, handle, held in sess.overdue_grants(time.monotonic()):
            self.unwindow(sess, held)
            del table[handle]
            if table is sess.leases:
                self.node.state.release([held.obj])
            else:
                self.node.state.abort([held.obj])

    async def _op_lease(self, ch, sess, req: P.LeaseRequest, plen) -> None:
        keys = list(req.keys)
        ttl = req.ttl if req.ttl is not None else self.lease_ttl
        if ttl > self.limits.max_lease_ttl_s:
            raise P.bad(f"ttl {ttl} s is over this node's limit of {self.limits.max_lease_ttl_s} s")
        one_sided = self._one_sided(sess, req.rdma)
        self._room_for(sess, len(keys))
        leases = await self.node.leaser.lease(
            keys, ttl, self._disk_budget(sess), sees=sess.sees, owner=sess.tenant
        )
        res, drop = [], []
        for lease in leases:
            if lease is None or not sess.allows(lease.header):
                if lease is not None:
                    drop.append(lease)
                res.append(P.LeaseEntry(Status.MISS))
                continue
            desc = await self._describe(sess, sess.leases, lease, ttl, one_sided)
            if desc is None:
                drop.append(lease)  # not in the slab: the client GETs it inline
            res.append(P.LeaseEntry(Status.HIT, stored_header(lease), lease.tier, desc=desc))
        if drop:
            self.node.state.release(drop)
        await ch.send_frame(P.LeaseReply(req.rid, tuple(res)).to_wire())

    def _disk_budget(self, sess) -> int:
        """How many bytes of disk-only blocks a LEASE on ``sess`` may still read: copies and
        promotions live as long as their leases, so those already held count -- this
        connection's against ``server.max_frame`` (a walk of its own holds), its tenant's
        (every connection, counted by the node as leases begin and end) against
        ``limits.max_leased_disk_bytes_per_tenant``."""
        mine = sum(
            h.obj.header.payload_len
            for h in sess.leases.values()
            if h.obj.from_disk and self.node.state.is_live(h.obj)
        )
        tenant = self.node.state.leased_disk_bytes(sess.tenant)
        cap = int(self.limits.max_leased_disk_bytes_per_tenant)
        return max(0, min(self.max_frame - mine, cap - tenant))

    async def _op_release(self, ch, sess, req: P.ReleaseRequest, plen) -> None:
        found = [sess.leases.pop(x, None) for x in req.handles]
        for f in found:
            if f is not None:
                self.unwindow(sess, f)
        self.node.state.release([f.obj for f in found if f is not None])
        await ch.send_frame(P.ReleaseReply(req.rid, tuple(f is not None for f in found)).to_wire())

    async def _op_read(self, ch, sess, req: P.ReadRequest, plen) -> None:
        descs = req.descs
        found = [sess.live(sess.leases, d.handle) for d in descs]
        found = [
            x if x is not None and d.addr + d.length <= x.view.nbytes else None for x, d in zip(found, descs)
        ]
        held = list({id(x): x for x in found if x is not None}.values())
        views: list = []
        nbytes = 0

        def send(live: list[bool]):
            nonlocal nbytes
            ok = {id(x) for x, alive in zip(held, live) if alive}
            res = []
            for x, d in zip(found, descs):
                good = x is not None and id(x) in ok
                if good:
                    views.append(x.view[d.addr : d.addr + d.length])
                res.append(good)
            nbytes = sum(v.nbytes for v in views)
            return ch.send_frame(P.ReadReply(req.rid, tuple(res)).to_wire(), views)

        await self.transfers.moving(held, send)
        self.metrics.bytes_out.inc(nbytes)
        self.tenant_stats[sess.tenant]["bytes_out"] += nbytes

    async def _op_reserve(self, ch, sess, req: P.ReserveRequest, plen) -> None:
        hdrs = req.headers
        for i, x in enumerate(hdrs):
            if x.payload_len > self.max_frame:
                raise P.bad(f"hdrs[{i}].payload_len {x.payload_len} is over max_frame {self.max_frame}")
        one_sided = self._one_sided(sess, req.rdma)
        self._room_for(sess, len(hdrs))
        allowed = [i for i, x in enumerate(hdrs) if sess.may_write(x)]
        # lazy: a block with no host slot (disk, GPU) gets no buffer here; it is answered
        # inline below, so no memory is held for bytes that have not come (docs/security.md)
        # make_room=False: a RESERVE may never be written, so it evicts nothing (a slot only
        # where one is free now; else the client PUTs inline, which makes room as bytes come);
        # sees: another tenant's key answers BUSY, never EXISTS
        todo = [hdrs[i] for i in allowed]
        reserved = (
            await self.node.writer.reserve(todo, lazy=True, make_room=False, sees=sess.sees)
            if allowed
            else []
        )
        got = dict(zip(allowed, reserved))
        res, inline = [], []
        for i in range(len(hdrs)):
            r = got.get(i)
            if r is None or isinstance(r, Status):
                res.append(P.ReserveEntry(r if r is not None else Status.INVALID))
                continue
            if r.scratch is not None:  # a private buffer, not a slot: the client PUTs it inline
                inline.append(r)
                res.append(P.ReserveEntry())
                continue
            desc = await self._describe(sess, sess.reservations, r, self.lease_ttl, one_sided, write=True)
            if desc is None:
                inline.append(r)  # not in the slab: the client PUTs it inline
            res.append(P.ReserveEntry(desc=desc))
        if inline:
            self.node.state.abort(inline)
        await ch.send_frame(P.ReserveReply(req.rid, tuple(res)).to_wire())

    async def _op_write(self, ch, sess, req: P.WriteRequest, plen) -> None:
        descs = req.descs
        if sum(d.length for d in descs) != plen:
            raise P.bad(f"plen {plen} is not the sum of the descriptors' lengths")
        found = [sess.live(sess.reservations, d.handle) for d in descs]
        found = [
            x if x is not None and d.addr + d.length <= x.view.nbytes else None for x, d in zip(found, descs)
        ]
        held = list({id(x): x for x in found if x is not None}.values())
        res: list[bool] = []

        async def receive(live: list[bool]) -> None:
            ok = {id(x) for x, alive in zip(held, live) if alive}
            for x, d in zip(found, descs):
                if x is not None and id(x) in ok:
                    await ch.recv_into(x.view[d.addr : d.addr + d.length])
                    res.append(True)
                else:
                    await ch.discard(d.length)
                    res.append(False)

        await self.transfers.moving(held, receive)
        self.metrics.bytes_in.inc(plen)
        self.tenant_stats[sess.tenant]["bytes_in"] += plen
        await ch.send_frame(P.WriteReply(req.rid, tuple(res)).to_wire())

    async def _op_commit(self, ch, sess, req: P.CommitRequest, plen) -> None:
        found = [sess.reservations.pop(x, None) for x in req.handles]
        for f in found:
            if f is not None:
                self.unwindow(sess, f)  # no remote write lands after the checksum is taken
        live = [f.obj for f in found if f is not None]
        done = dict(zip([id(r) for r in live], await self.node.writer.commit(live))) if live else {}
        res = []
        for f in found:
            if f is None:
                res.append(PutResult(Status.INVALID))
                continue
            pr = done[id(f.obj)]
            if pr.status is Status.INVALID:
                self.metrics.checksum_failures.inc()
            res.append(pr)
        await ch.send_frame(P.CommitReply(req.rid, tuple(res)).to_wire())
