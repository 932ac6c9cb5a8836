"""The block ops of the data port: EXISTS, GET, PUT, DELETE and STATS.

GET sends payloads from leased slots and PUT receives them into reserved ones, each move
marked in transfer and bounded by the transfer deadline (kvstore/daemon/transfer.py). Every reply about
another tenant's block is the reply about an absent key (docs/security.md): GET answers
``[MISS, nil, nil]``, EXISTS nil, DELETE false, and a PUT of its key BUSY. Owned by
:class:`~kvstore.daemon.dataport.DataServer`, which gives it what it uses in its constructor
(:meth:`BlockOps.ops` names the handlers); event loop thread only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from kvstore import protocol as P
from kvstore.daemon.admission import Admission
from kvstore.daemon.metrics import DaemonMetrics, plain
from kvstore.daemon.session import Session
from kvstore.daemon.transfer import Transfers
from kvstore.results import PutResult, Status


class BlockOps:
    """``tenant_stats`` is the port's per-tenant counters (shared, written here);
    ``auth_enabled`` reads the port's current token table (it may be swapped on SIGHUP)."""

    def __init__(
        self,
        node: Any,
        metrics: DaemonMetrics,
        transfers: Transfers,
        admission: Admission,
        tenant_stats: dict[str, Counter[str]],
        lease_ttl: float,
        auth_enabled: Callable[[], bool],
        max_frame: int,
    ) -> None:
        self.node = node
        self.metrics = metrics
        self.transfers = transfers
        self.admission = admission
        self.tenant_stats = tenant_stats
        self.lease_ttl = lease_ttl
        self._auth_enabled = auth_enabled
        self.max_frame = max_frame

    def ops(self) -> dict[str, Callable]:
        """The handlers by op name: ``await handler(ch, sess, request, plen)``, ``request`` the
        op's typed request (kvstore/protocol/requests.py) and ``plen`` the payload bytes that follow."""
        return {
            P.ExistsRequest.OP: self._op_exists,
            P.GetRequest.OP: self._op_get,
            P.PutRequest.OP: self._op_put,
            P.DeleteRequest.OP: self._op_delete,
            P.StatsRequest.OP: self._op_stats,
        }

    async def _visible(self, sess: Session, keys) -> list[str | None]:
        """Per key: its tier when stored and in one of the session's namespaces, else None
        (another tenant's block answers exactly as an absent one)."""
        return await self.node.visible_tiers(keys, sess.sees)

    async def _op_exists(self, ch, sess, req: P.ExistsRequest, plen) -> None:
        keys = list(req.keys)
        tiers = await self._visible(sess, keys)
        await ch.send_frame(P.ExistsReply(req.rid, tuple(tiers)).to_wire())

    async def _op_get(self, ch, sess, req: P.GetRequest, plen) -> None:
        keys, exp, caps = list(req.keys), req.expects, req.caps
        # disk-resident keys are read into private buffers: at most max_frame bytes of them per
        # GET (the rest are misses); no up-front refusal, which would tell another tenant's
        # key exists
        leases = await self.node.lease(keys, self.lease_ttl, self.max_frame)
        try:
            # No await from here to the transfer's mark (moving): a lease live now stays live.
            # Leases are taken key by key around disk reads, so an early one may have lapsed
            # (and its slot been reused) by now: that key is a miss, its view is never sent.
            res, views, sent = [], [], []
            for i, lease in enumerate(leases):
                hdr = lease.header if lease is not None else None
                if lease is None or not self.node.is_live(lease) or not sess.allows(hdr):
                    res.append(P.GetEntry(Status.MISS))  # another tenant's block is absent
                    self.metrics.misses.inc()
                    continue
                st = Status.HIT
                if exp[i] is not None and not hdr.matches(keys[i], exp[i].parent, exp[i].token_bytes):
                    st = Status.MISMATCH
                elif caps is not None and caps[i] < hdr.payload_len:
                    st = Status.BUF_TOO_SMALL
                if st is Status.HIT:
                    views.append(lease.view)
                    sent.append(lease)
                    self.metrics.hits.inc()
                else:
                    self.metrics.misses.inc()
                res.append(P.GetEntry(st, stored_header(lease), lease.tier))
            nbytes = sum(v.nbytes for v in views)
            reply = P.GetReply(req.rid, tuple(res))
            await self.transfers.moving(sent, lambda _: ch.send_frame(reply.to_wire(), views))
            self.metrics.bytes_out.inc(nbytes)
            ts = self.tenant_stats[sess.tenant]
            ts["hits"] += len(sent)
            ts["misses"] += len(keys) - len(sent)
            ts["bytes_out"] += nbytes
        finally:
            self.node.release([x for x in leases if x is not None])

    async def _op_put(self, ch, sess, req: P.PutRequest, plen) -> None:
        hdrs = req.headers
        if sum(x.payload_len for x in hdrs) != plen:
            raise P.bad(f"plen {plen} is not the sum of the headers' payload lengths")
        # a peer's repair must not bring back what this node deleted: MISS says "deleted here"
        dead = (
            {i for i, d in enumerate(self.node.tombstoned([x.key for x in hdrs])) if d}
            if sess.all_namespaces
            else ()
        )
        allowed = [i for i, x in enumerate(hdrs) if sess.may_write(x) and i not in dead]
        reserved = await self.node.reserve([hdrs[i] for i in allowed], lazy=True) if allowed else []
        slot: dict[int, Any] = dict(zip(allowed, reserved))
        held = [r for r in slot.values() if not isinstance(r, Status)]
        got = []

        async def receive(live: list[bool]) -> None:
            ok = {id(r) for r, alive in zip(held, live) if alive}
            for i, x in enumerate(hdrs):
                r = slot.get(i)
                if r is None or isinstance(r, Status) or id(r) not in ok:
                    await ch.discard(x.payload_len)
                elif r.view.nbytes < x.payload_len:  # no slot of its own: memory as bytes come
                    self.node.attach_payload(r, await ch.recv_growing(x.payload_len))
                    got.append(r)
                else:
                    await ch.recv_into(r.view)
                    got.append(r)

        try:
            await self.transfers.moving(held, receive)
        except BaseException:
            self.node.abort(held)
            raise
        self.node.abort([r for r in held if r not in got])
        self.metrics.bytes_in.inc(plen)
        committed = dict(zip([id(r) for r in got], await self.node.commit(got))) if got else {}
        res = []
        for i in range(len(hdrs)):
            r = slot.get(i)
            if i in dead:
                res.append(PutResult(Status.MISS))
            elif r is None or (not isinstance(r, Status) and id(r) not in committed):
                res.append(PutResult(Status.INVALID))
            elif isinstance(r, Status):
                # EXISTS only for the tenant's own block: another tenant's key answers BUSY,
                # the answer for a key being written (docs/security.md)
                res.append(PutResult(await self._own_status(sess, hdrs[i], r)))
            else:
                pr = committed[id(r)]
                if pr.status is Status.INVALID:
                    self.metrics.checksum_failures.inc()
                res.append(pr)
        ts = self.tenant_stats[sess.tenant]
        ts["bytes_in"] += plen
        ts["puts"] += sum(1 for x in res if x.status is Status.STORED)
        await ch.send_frame(P.PutReply(req.rid, tuple(res)).to_wire())

    async def _own_status(self, sess: Session, header, st: Status) -> Status:
        if st is not Status.EXISTS:
            return st
        [ns] = await self.node.namespaces([header.key])
        return st if ns is None or sess.sees(ns) else Status.BUSY

    async def _op_delete(self, ch, sess, req: P.DeleteRequest, plen) -> None:
        keys = list(req.keys)
        mine = await self._visible(sess, keys)
        todo = [k for k, t in zip(keys, mine) if t is not None]
        done = dict(zip([k.raw for k in todo], await self.node.delete(todo))) if todo else {}
        await ch.send_frame(
            P.DeleteReply(req.rid, tuple(bool(done.get(k.raw, False)) for k in keys)).to_wire()
        )

    async def _op_stats(self, ch, sess, req: P.StatsRequest, plen) -> None:
        """With auth: the tenant's own counters only. Without: the node's (one tenant)."""
        conns = self.admission.per_tenant.get(sess.tenant, 0)
        counters = self.tenant_stats[sess.tenant]
        if self._auth_enabled():
            reply = P.StatsReply.of(req.rid, sess.tenant, conns, counters)
        else:
            node, daemon = plain(self.node.stats()), self.metrics.snapshot()
            reply = P.StatsReply.of(req.rid, sess.tenant, conns, counters, node, daemon)
        await ch.send_frame(reply.to_wire())


def stored_header(lease: Any) -> bytes:
    """The encoded header a reply forwards for ``lease``'s block: the bytes the node stored,
    as they are (no decode and encode again)."""
    return lease.raw_header
