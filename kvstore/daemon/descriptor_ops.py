"""The descriptor ops of the data port: LEASE/READ/RELEASE and RESERVE/WRITE/COMMIT.

These are the RDMA-shaped halves of GET and PUT (docs/protocol.md): the node hands out
descriptors of leased or reserved slots. By default a descriptor is an offset in the held
payload and the READ/WRITE ops move the bytes over TCP. With ``rdma: true`` (only on a
connection whose HELLO set up a queue pair) it is the slot's address in the registered DRAM
slab and its rkey, and the client moves the bytes one-sidedly; a block whose bytes are not in
the slab then gets no descriptor (and no hold): the client moves it with GET/PUT instead.
Leases and reservations live in the connection's :class:`~kvstore.daemon.session.Session` and
end with it. Mixed into :class:`~kvstore.daemon.dataport.DataServer` (which provides ``node``,
``metrics``, ``lease_ttl`` and ``rdma``); event loop thread only.
"""

from __future__ import annotations

from typing import Any

from kvstore import protocol as P
from kvstore.daemon.slab_rdma import slab_descriptor
from kvstore.results import Status
from rdma.transport import RemoteDescriptor, TransportError


class DescriptorOps:
    node: Any
    metrics: Any
    lease_ttl: float
    rdma: Any

    def _one_sided(self, sess, h) -> bool:
        """The request's ``rdma`` flag; bad_request when the connection has no queue pair."""
        want = P.req_flag(h, "rdma")
        if want and (sess.verbs is None or self.rdma is None):
            raise P.bad("rdma: this connection has no RDMA queue pair (HELLO set none up)")
        return want

    def _describe(self, sess, table, held, ttl, one_sided: bool) -> RemoteDescriptor | None:
        """Hold ``held`` (a Lease or Reservation) under a new handle and describe its bytes: an
        offset descriptor (TCP), or with ``one_sided`` its place in the registered slab; None,
        holding nothing, when one-sided access was asked for and the bytes are not in the slab."""
        if not one_sided:
            return RemoteDescriptor(sess.hold(table, held, ttl), 0, held.header.payload_len)
        place = slab_descriptor(self.rdma.slab, 0, held)
        if place is None:
            return None
        return RemoteDescriptor(sess.hold(table, held, ttl), place.addr, place.length, place.rkey)

    async def _op_lease(self, ch, sess, rid, h, plen) -> None:
        keys = P.req_keys(h)
        ttl = P.req_float(h, "ttl", self.lease_ttl)
        one_sided = self._one_sided(sess, h)
        leases = await self.node.lease(keys, ttl)
        res, drop = [], []
        for lease in leases:
            if lease is None or not sess.allows(lease.header):
                if lease is not None:
                    drop.append(lease)
                res.append([int(Status.MISS), None, None, None])
                continue
            desc = self._describe(sess, sess.leases, lease, ttl, one_sided)
            if desc is None:
                drop.append(lease)  # not in the slab: the client GETs it inline
            res.append([int(Status.HIT), lease.header.encode(), lease.tier, desc.to_wire() if desc else None])
        if drop:
            self.node.release(drop)
        await ch.send_frame({"rid": rid, "ok": True, "res": res})

    async def _op_release(self, ch, sess, rid, h, plen) -> None:
        handles = P.req_ints(h, "handles")
        found = [sess.leases.pop(x, None) for x in handles]
        self.node.release([f.obj for f in found if f is not None])
        await ch.send_frame({"rid": rid, "ok": True, "res": [f is not None for f in found]})

    async def _op_read(self, ch, sess, rid, h, plen) -> None:
        descs = _descs(h)
        res, views = [], []
        for d in descs:
            lease = sess.live(sess.leases, d.handle)
            ok = lease is not None and d.addr + d.length <= lease.view.nbytes
            if ok:
                views.append(lease.view[d.addr : d.addr + d.length])
            res.append(ok)
        await ch.send_frame({"rid": rid, "ok": True, "res": res}, views)
        self.metrics.bytes_out.inc(sum(v.nbytes for v in views))

    async def _op_reserve(self, ch, sess, rid, h, plen) -> None:
        hdrs = P.req_headers(h)
        one_sided = self._one_sided(sess, h)
        allowed = [i for i, x in enumerate(hdrs) if sess.allows(x)]
        got = dict(zip(allowed, await self.node.reserve([hdrs[i] for i in allowed]))) if allowed else {}
        res, inline = [], []
        for i in range(len(hdrs)):
            r = got.get(i)
            if r is None or isinstance(r, Status):
                res.append([int(r if r is not None else Status.INVALID), None])
                continue
            desc = self._describe(sess, sess.reservations, r, self.lease_ttl, one_sided)
            if desc is None:
                inline.append(r)  # not in the slab: the client PUTs it inline
            res.append([None, desc.to_wire() if desc else None])
        if inline:
            self.node.abort(inline)
        await ch.send_frame({"rid": rid, "ok": True, "res": res})

    async def _op_write(self, ch, sess, rid, h, plen) -> None:
        descs = _descs(h)
        if sum(d.length for d in descs) != plen:
            raise P.bad(f"plen {plen} is not the sum of the descriptors' lengths")
        res = []
        for d in descs:
            r = sess.live(sess.reservations, d.handle)
            if r is not None and d.addr + d.length <= r.view.nbytes:
                await ch.recv_into(r.view[d.addr : d.addr + d.length])
                res.append(True)
            else:
                await ch.discard(d.length)
                res.append(False)
        self.metrics.bytes_in.inc(plen)
        await ch.send_frame({"rid": rid, "ok": True, "res": res})

    async def _op_commit(self, ch, sess, rid, h, plen) -> None:
        handles = P.req_ints(h, "handles")
        found = [sess.reservations.pop(x, None) for x in handles]
        live = [f.obj for f in found if f is not None]
        done = dict(zip([id(r) for r in live], await self.node.commit(live))) if live else {}
        res = []
        for f in found:
            if f is None:
                res.append([int(Status.INVALID), None, False])
                continue
            pr = done[id(f.obj)]
            if pr.status is Status.INVALID:
                self.metrics.checksum_failures.inc()
            res.append([int(pr.status), pr.tier, bool(pr.durable)])
        await ch.send_frame({"rid": rid, "ok": True, "res": res})


def _descs(h: dict[str, Any]) -> list[RemoteDescriptor]:
    out = []
    for i, raw in enumerate(P._list(h, "descs")):
        try:
            out.append(RemoteDescriptor.from_wire(raw))
        except TransportError as exc:
            raise P.bad(f"descs[{i}]: {exc}") from exc
    return out
