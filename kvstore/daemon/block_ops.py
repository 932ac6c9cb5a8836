"""The block ops of the data port: EXISTS, GET, PUT, DELETE and STATS.

GET sends payloads from leased slots and PUT receives them into reserved ones, each move
marked in transfer and bounded by the transfer deadline (kvstore/daemon/transfer.py). Each
handler queues its one reply on the connection's :class:`~kvstore.daemon.replies.ReplyQueue`
(sent in request order while the next request is read); a GET's reply owns its packed lease,
marked in transfer before it is queued and released when its bytes have left (or never will). Every reply about
another tenant's block is the reply about an absent key (docs/security.md): GET answers
MISS with no header and tier 0, EXISTS code 0, DELETE 0, and a PUT of its key BUSY. Only a peer session
(another node's repair) is ever answered DELETED: a push of a copy this node deleted since. Owned by
:class:`~kvstore.daemon.dataport.DataServer`, which gives it what it uses in its constructor
(:meth:`BlockOps.ops` names the handlers); event loop thread only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from kvstore import protocol as P
from kvstore.block import payload_hasher
from kvstore.daemon.admission import Admission
from kvstore.daemon.metrics import DaemonMetrics, plain
from kvstore.daemon.session import Session
from kvstore.daemon.transfer import Transfers
from kvstore.keys import KeyBatch
from kvstore.lookups import TIER_CODES
from kvstore.node.leases import Lease, PackedLease
from kvstore.node.store import NodeStore
from kvstore.results import PutResult, Status

_DISCARD_CHUNK = 1 << 20  # the scratch buffer a refused PUT payload is received into
_INVALID = PutResult(Status.INVALID)  # (results are frozen: one instance serves many blocks)
_DELETED = PutResult(Status.DELETED)  # a peer's repair of a copy this node deleted since


class BlockOps:
    """``tenant_stats`` is the port's per-tenant counters (shared, written here);
    ``auth_enabled`` reads the port's current token table (it may be swapped on SIGHUP)."""

    def __init__(
        self,
        node: NodeStore,
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
        """The handlers by op name: ``await handler(replies, sess, request, plen)``, ``replies``
        the connection's ReplyQueue (``replies.ch`` its channel, for a payload that follows),
        ``request`` the op's typed request (kvstore/protocol/requests.py) and ``plen`` the
        payload bytes that follow."""
        return {
            P.ExistsRequest.OP: self._op_exists,
            P.GetRequest.OP: self._op_get,
            P.PutRequest.OP: self._op_put,
            P.DeleteRequest.OP: self._op_delete,
            P.StatsRequest.OP: self._op_stats,
        }

    async def _visible(self, sess: Session, keys: KeyBatch) -> bytes:
        """Per key one tier code: its tier when stored and in one of the session's namespaces,
        else 0 (another tenant's block answers exactly as an absent one)."""
        return await self.node.lookup(keys, sess.sees)

    async def _op_exists(self, out, sess, req: P.ExistsRequest, plen) -> None:
        out.send(P.ExistsReply(req.rid, await self._visible(sess, req.keys)).to_wire())

    async def _op_get(self, out, sess, req: P.GetRequest, plen) -> None:
        keys, caps = req.keys, req.caps
        n = len(keys)
        state = self.node.state
        if out.read_bytes:
            # a queued reply holds bytes read from disk: this one may read up to max_frame
            # more only once it has gone (a connection's disk buffers stay within max_frame)
            await out.drain()
        # One packed lease for the batch (kvstore/node/leasing.py): one call into the node,
        # the stored headers forwarded as they are, one mark in transfer, one release.
        # Disk-resident keys are read into private buffers: at most max_frame bytes of them
        # per GET (the rest are misses); no up-front refusal, which would tell another
        # tenant's key exists. ``sees``: another tenant's block is left out before any work on
        # it (no disk read, promotion, lease or share of the read budget; docs/security.md).
        # The client judges each header it gets (key, parent, tokens, checksum): the node
        # sends what it holds under the key, as columns, with no per-key record.
        p = await self.node.leaser.lease_packed(keys, self.lease_ttl, self.max_frame, sees=sess.sees)
        try:
            # No await from here to the mark in transfer: a lease live now stays live.
            # One that lapsed while its disk reads ran holds nothing: every key is a miss.
            views: list = []
            if state.is_live(p) and p.at:
                codes, views = _fitting(p, caps)
                tiers = bytes(map(TIER_CODES.__getitem__, p.tiers))
                reply = P.GetReply.of(req.rid, n, p.at, codes, p.headers, tiers)
            else:
                reply = P.GetReply.of(req.rid, n, (), b"", (), b"")
            sent = len(views)
            nbytes = sum(v.nbytes for v in views)
            if views:
                # held and in transfer until the reply's bytes have left (or never will)
                state.begin_transfer([p])
        except BaseException:
            state.release([p])
            raise
        self.metrics.hits.inc(sent)  # once per batch: an increment takes a lock
        self.metrics.misses.inc(n - sent)
        ts = self.tenant_stats[sess.tenant]
        ts["hits"] += sent
        ts["misses"] += n - sent

        def done(ok: bool) -> None:
            if views:
                state.end_transfer([p])
            state.release([p])
            if ok:
                self.metrics.bytes_out.inc(nbytes)
                ts["bytes_out"] += nbytes

        out.send(reply.to_wire(), views, done, read_bytes=p.read_bytes if views else 0)

    async def _op_put(self, out, sess, req: P.PutRequest, plen) -> None:
        # Per batch, not per block, outside the socket reads: one reserve (another tenant's
        # key answers BUSY there, the answer for a key being written: docs/security.md), one
        # receive of the whole stream, one commit, statuses filled by position.
        ch = out.ch
        hdrs = req.headers
        n = len(hdrs)
        lens = [x.payload_len for x in hdrs]
        if sum(lens) != plen:
            raise P.bad(f"plen {plen} is not the sum of the headers' payload lengths")
        res: list[PutResult] = [_INVALID] * n  # refused (may_write) unless set below
        # a peer's repair must not bring back what this node deleted: DELETED says "deleted
        # here after your copy was written" (a copy written after the delete is taken)
        dead = self.node.state.tombstones
        if sess.all_namespaces and len(dead):
            allowed = []
            for i, x in enumerate(hdrs):
                if dead.refuses(x.key.raw, x.created):
                    res[i] = _DELETED
                else:
                    allowed.append(i)
        else:
            allowed = range(n)
        may_write = sess.may_write
        allowed = [i for i in allowed if may_write(hdrs[i])]
        reserved = (
            await self.node.writer.reserve([hdrs[i] for i in allowed], lazy=True, sees=sess.sees)
            if allowed
            else []
        )
        held_at, held = [], []  # positions in the request and their reservations
        for i, r in zip(allowed, reserved):
            if isinstance(r, Status):
                res[i] = PutResult(r)
            else:
                held_at.append(i)
                held.append(r)
        got: list = []
        digests: list[int | None] = []  # by position in got: its payload's checksum as it landed

        async def receive(live: list[bool]) -> None:
            # consecutive payloads land as one stream (recvmsg_into into many slots per
            # syscall), each hashed as its bytes land (still in cache: commit then compares,
            # no second pass over the batch); a refused one lands in a scratch buffer, a
            # slot-less one grows alone (hashed by commit)
            slot = {i: r for i, r, alive in zip(held_at, held, live) if alive}
            run: list[memoryview] = []
            run_held: list[bool] = []  # per view of run: a reservation's payload (else scratch)
            scratch = memoryview(bytearray(min(plen, _DISCARD_CHUNK))) if plen else None

            async def flush() -> None:
                landed = await ch.recv_views(run, payload_hasher)
                digests.extend(d for d, mine in zip(landed, run_held) if mine)
                run.clear()
                run_held.clear()

            for i, x in enumerate(lens):
                r = slot.get(i)
                if r is None:
                    sink = _sink(scratch, x)
                    run += sink
                    run_held += [False] * len(sink)
                elif r.view.nbytes < x:  # no slot of its own: memory as bytes come
                    if run:
                        await flush()
                    self.node.writer.attach_payload(r, await ch.recv_growing(x))
                    got.append(r)
                    digests.append(None)
                else:
                    run.append(r.view[:x])
                    run_held.append(True)
                    got.append(r)
            if run:
                await flush()

        try:
            await self.transfers.moving(held, receive)
        except BaseException:
            self.node.state.abort(held)
            raise
        if len(got) < len(held):
            arrived = {id(r) for r in got}
            self.node.state.abort([r for r in held if id(r) not in arrived])
        self.metrics.bytes_in.inc(plen)
        if got:
            # held and got are in request order: a reservation not received stays INVALID
            at = dict(zip(map(id, held), held_at))
            failed = 0
            # a receive cut short left some unhashed: commit hashes them all
            landed = digests if len(digests) == len(got) else None
            for r, pr in zip(got, await self.node.writer.commit(got, landed)):
                res[at[id(r)]] = pr
                failed += pr.status is Status.INVALID
            if failed:
                self.metrics.checksum_failures.inc(failed)
        ts = self.tenant_stats[sess.tenant]
        ts["bytes_in"] += plen
        ts["puts"] += sum(x.status is Status.STORED for x in res)
        out.send(P.PutReply(req.rid, tuple(res)).to_wire())

    async def _op_delete(self, out, sess, req: P.DeleteRequest, plen) -> None:
        keys = req.keys
        mine = np.flatnonzero(np.frombuffer(await self._visible(sess, keys), dtype=np.uint8))
        done = np.zeros(len(keys), dtype=np.uint8)
        if len(mine):
            done[mine] = await self.node.delete(keys.take(mine), by=sess.tenant or "")  # its tombstones
        out.send(P.DeleteReply(req.rid, done.tobytes()).to_wire())

    async def _op_stats(self, out, sess, req: P.StatsRequest, plen) -> None:
        """With auth: the tenant's own counters only. Without: the node's (one tenant)."""
        conns = self.admission.per_tenant.get(sess.tenant, 0)
        counters = self.tenant_stats[sess.tenant]
        if self._auth_enabled():
            reply = P.StatsReply.of(req.rid, sess.tenant, conns, counters)
        else:
            node, daemon = plain(self.node.inspector.stats()), self.metrics.snapshot()
            reply = P.StatsReply.of(req.rid, sess.tenant, conns, counters, node, daemon)
        out.send(reply.to_wire())


def _fitting(p: PackedLease, caps: tuple[int, ...] | None) -> tuple[bytes, list[memoryview]]:
    """Per block of ``p``: HIT, or BUF_TOO_SMALL where the caller's buffer (``caps``, by key)
    is smaller than its payload (its header is sent, not its bytes); the views to send."""
    if caps is None:
        return bytes(len(p.at)), p.views  # every block a HIT (code 0)
    codes = bytearray(len(p.at))
    views = []
    for j, (i, v) in enumerate(zip(p.at, p.views)):
        if caps[i] < v.nbytes:
            codes[j] = Status.BUF_TOO_SMALL
        else:
            views.append(v)
    return bytes(codes), views


def _sink(scratch: memoryview | None, n: int) -> list[memoryview]:
    """Views of ``scratch`` that take ``n`` bytes nobody keeps (a refused block's payload)."""
    if not n:
        return []
    step = scratch.nbytes
    return [scratch[: min(step, n - k)] for k in range(0, n, step)]


def stored_header(lease: Lease) -> bytes:
    """The encoded header a reply forwards for ``lease``'s block: the bytes the node stored,
    as they are (no decode and encode again)."""
    return lease.raw_header
