"""The data port: accepts connections and serves the framed protocol against a NodeStore.

Each connection's requests are served in order, one after another, by its own task; their
replies are sent in order by the connection's :class:`~kvstore.daemon.replies.ReplyQueue`,
while the task already reads and prepares the next request (at most ``REPLY_DEPTH`` replies
queued: one being sent, one prepared), so building a reply overlaps sending the one before.
Requests on different connections interleave on the event loop. Payloads go from the node's lease views
to the socket with ``sendmsg`` and from the socket into reserved slots with ``recv_into``
(every call on the event loop with ``MSG_DONTWAIT``). While several requests are served at
once, the kernel copies of large received payloads run in a small thread pool, each job a
non-blocking burst that returns at EAGAIN (rdma/bursts.py); a large reply is always sent by a
worker, in blocking ``sendmsg`` calls of at most ``SEND_SLICE_S`` without room (the kernel's own
wait is cheaper than a return and a wait on the loop at each full buffer). Every longer wait for
a peer happens on the event loop: a hand-off ends at the first call that waited its slice out,
so a slow or stalled reader holds a worker about one slice per hand-off and costs only its own
connection (docs/security.md).

A transfer owns its slot: before bytes move from or into a slot, its lease or reservation is
marked in transfer (:meth:`NodeStore.begin_transfer`, which also refuses one that is no
longer live), so it cannot expire and be reused underneath; each transfer has a deadline
(``limits.transfer_timeout_s``), after which the connection is closed and only then is the
slot given back. Each whole request, its reply included, has twice that deadline (a peer
that stops reading its replies is closed and counted, ``tierkv_timeouts_total{kind="request"}``);
a reply's send has the transfer deadline from its start as well when it carries a payload
(kvstore/daemon/replies.py). A GET's packed lease is held, marked in transfer, from before its
reply is queued until its last byte has left or the connection has ended. The descriptor ops
(LEASE/READ/RELEASE, RESERVE/WRITE/COMMIT) wait for the queued replies to be sent first and
send their own: a READ's bytes come from a lease a RELEASE may end.
HELLO and idle deadlines, and caps on connections before HELLO (the oldest of the busiest
source is dropped for a newcomer, kvstore/daemon/admission.py) and per tenant, come from
``limits`` too. A header's decode is bounded in bytes and in msgpack objects (before HELLO and
after, ``limits.max_header_objects*``), and the decoded map is emptied as soon as the typed
request is parsed from it: what a request holds while its payload moves is what it uses.

Failure rules (docs/protocol.md): a bad frame or a length over ``server.max_frame`` gets an
error reply and the connection is closed; a bad request gets an error reply, its payload is
skipped and the connection stays usable; a node failure is an ``internal`` reply; nothing a
client sends can crash the daemon, store a block whose checksum does not match, or touch
another tenant's blocks (every op checks the block's namespace against the session's), and
every reply about another tenant's block is the reply about an absent one. A peer session
(HELLO tenant ``"*"``, another node's repair) sees every tenant's blocks but may use only
EXISTS, PUT and STATS: any other op is an ``auth`` error reply and the connection stays.

The ops live beside it (kvstore/daemon/block_ops.py, descriptor_ops.py; HELLO in
handshake.py; the reply queue in replies.py). What stays here, ~500 lines, is one contract
kept whole on purpose: the listener (accept, admission, stop, revoke) and the one loop that
serves a connection -- its deadlines (HELLO, idle, header, request), the error rules above
and the order of its cleanup (replies closed before the slots go back, then the session's
holds, the namespaces, the admission count), which a split would spread over files that
must then be read together to check any one of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstore import protocol as P
from kvstore.daemon.admission import Admission
from kvstore.daemon.auth import TokenTable
from kvstore.daemon.block_ops import BlockOps
from kvstore.daemon.descriptor_ops import DescriptorOps
from kvstore.daemon.handshake import Handshake, Refusal
from kvstore.daemon.logs import RateLimitedLog, kv
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.replies import ReplyQueue
from kvstore.daemon.session import Session
from kvstore.daemon.slab_rdma import SlabRdma
from kvstore.daemon.transfer import Transfers
from kvstore.node.store import NodeStore
from rdma.channel import SocketChannel
from rdma.framing import FrameError, decode_header, header_length, payload_len

# What a peer session (HELLO tenant "*", another node's repair: kvstore/member/repair.py) may
# do: it sees every tenant's blocks, so it may check and copy them in, never read or delete.
PEER_OPS = frozenset({P.ExistsRequest.OP, P.PutRequest.OP, P.StatsRequest.OP})

log = logging.getLogger("kvstore.daemon.data")

# Replies queued per connection (one being sent, one prepared): the reader reads the next
# header only below it, so a connection holds at most this many replies' leases, and disk
# reads of at most ``max_frame`` bytes (a GET waits for a queued reply that holds some).
REPLY_DEPTH = 2
# A large reply's send runs in a worker as blocking sendmsg calls of at most this long without
# room (SO_SNDTIMEO; rdma/channel.py): the kernel's wait costs less CPU per GB than a return
# and a wait on the loop at each full buffer, and a peer that stops reading holds a worker for
# at most one slice (then the wait is the loop's, under the transfer deadline).
SEND_SLICE_S = 0.02


class DataServer:
    """Serves one listening socket. It owns the op handlers (:class:`BlockOps`,
    :class:`DescriptorOps`), each given what it uses, and the transfer deadline
    (:class:`Transfers`). ``tokens`` may be swapped (SIGHUP) between requests
    (:meth:`revoke` then closes the connections whose token no longer holds).
    ``rdma`` (a :class:`~kvstore.daemon.slab_rdma.SlabRdma`, or None for TCP only) answers
    HELLO's RDMA offers; ``server.transport`` decides what happens to clients without one."""

    def __init__(
        self,
        node: NodeStore,
        sock: socket.socket,
        tokens: TokenTable,
        metrics: DaemonMetrics,
        cfg,
        rdma: SlabRdma | None = None,
    ) -> None:
        self.node = node
        self.rdma = rdma
        self.sock = sock
        self.tokens = tokens
        self.metrics = metrics
        self.limits = cfg.limits
        self.max_frame = int(cfg.server.max_frame)
        self.lease_ttl = float(cfg.node.lease_ttl_s)
        self.closing = False
        self.admission = Admission(cfg.limits)
        self.tenant_stats: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._conns: dict[asyncio.Task, Session] = {}
        # kernel copies of large payloads: receives until EAGAIN, sends until one slice waited out
        self._copies = ThreadPoolExecutor(
            max_workers=min(16, 2 * (os.cpu_count() or 2)), thread_name_prefix="copy"
        )
        self._busy = 0  # connections with a request being read or a reply being sent
        self._accept_task: asyncio.Task | None = None
        self._window_task: asyncio.Task | None = None
        self._bad = RateLimitedLog(log)
        self._accept_failures = RateLimitedLog(log)
        self._task_of: dict[Session, tuple[asyncio.Task, socket.socket]] = {}
        self.transfers = Transfers(node, cfg.limits, metrics)
        self.descriptors = DescriptorOps(
            node,
            metrics,
            self.transfers,
            cfg.limits,
            self.tenant_stats,
            self.lease_ttl,
            rdma,
            self._bad,
            self.max_frame,
        )
        blocks = BlockOps(
            node,
            metrics,
            self.transfers,
            self.admission,
            self.tenant_stats,
            self.lease_ttl,
            lambda: self.tokens.enabled,  # the table may be swapped (SIGHUP)
            self.max_frame,
        )
        self.handshake = Handshake(
            node,
            lambda: self.tokens,  # the table may be swapped (SIGHUP)
            self.admission,
            metrics,
            cfg.limits,
            self.descriptors,
            rdma,
            cfg.server.transport,
            cfg.node.name or socket.gethostname(),
            self.max_frame,
            RateLimitedLog(log),  # one line per HELLO, at most 10 per 10 s
        )
        self._queued_ops = blocks.ops()  # handler(replies, ...): replies queued
        self._ops = {**self._queued_ops, **self.descriptors.ops()}
        self._per_op: dict[str, tuple[Any, Any, str]] = {}  # see _op_metrics

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.sock.setblocking(False)
        loop = asyncio.get_running_loop()
        self._accept_task = loop.create_task(self._accept_loop())
        if self.rdma is not None:
            self._window_task = loop.create_task(self._window_sweeper())

    async def _window_sweeper(self) -> None:
        """Once a second: revoke one-sided holds past their deadline on idle connections too."""
        while not self.closing:
            await asyncio.sleep(1.0)
            for sess in list(self._conns.values()):
                if sess.windows is not None and len(sess.windows):
                    self.descriptors.expire_windows(sess)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.closing:
            try:
                conn, addr = await loop.sock_accept(self.sock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # EMFILE and friends: log (rate-limited), back off, keep serving
                self._accept_failures.warning("accept_failed", error=exc)
                await asyncio.sleep(0.1)
                continue
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            sess = Session(peer=peer, source=addr[0] if isinstance(addr, tuple) else peer)
            victim = self.admission.accept(sess)
            if victim is not None:  # the oldest waiting connection of the busiest source
                self.metrics.refused_connections.labels("unauthenticated").inc()
                self._bad.info("dropped_connection", peer=victim.peer, why="unauthenticated_limit")
                gone = self._task_of.get(victim)
                if gone is not None:
                    gone[0].cancel()
            task = loop.create_task(self._serve(conn, sess))
            self._conns[task] = sess
            self._task_of[sess] = (task, conn)
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task) -> None:
        sess = self._conns.pop(task)
        _, conn = self._task_of.pop(sess)
        # a task cancelled before it started never ran _serve's cleanup: close its socket here
        conn.close()
        self.admission.leave(sess)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let in-flight requests finish (up to ``grace_s``), close idle ones."""
        self.closing = True
        for t in (self._accept_task, self._window_task):
            if t is not None:
                t.cancel()
        self.sock.close()
        for task, sess in list(self._conns.items()):
            if not sess.busy:  # no request being read: cancelled once its replies are sent
                if sess.replies is None:
                    task.cancel()
                else:  # judged again when the replies are sent: a request begun since is served
                    sess.replies.when_idle(lambda t=task, s=sess: None if s.busy else t.cancel())
        busy = list(self._conns)
        if busy:
            _, pending = await asyncio.wait(busy, timeout=grace_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        self._copies.shutdown(wait=False, cancel_futures=True)

    def revoke(self, table: TokenTable) -> int:
        """Close every connection whose token ``table`` no longer maps to its tenant, or whose
        tenant's salt it changes (a new ``auth.salt_secret_file``: the session's namespaces were
        derived with the old one) (SIGHUP). A transfer under way is cancelled (a copy burst in
        a worker is waited for), then its slots are released."""
        n = 0
        for task, sess in list(self._conns.items()):
            if sess.token is None:
                continue
            salt = "" if sess.all_namespaces else table.salt_of(sess.tenant)
            if table.tenant_of(sess.token) != sess.tenant or salt != sess.salt:
                task.cancel()
                n += 1
        if n:
            self.metrics.refused_connections.labels("revoked").inc(n)
        return n

    # ------------------------------------------------------------ per connection

    async def _serve(self, conn: socket.socket, sess: Session) -> None:
        # Receives copy in worker threads only while another connection is being served too:
        # alone, the thread hops cost more than they win (docs/benchmarks.md). Large
        # sends always do, in SEND_SLICE_S slices of the kernel's own wait for room.
        ch = SocketChannel(
            conn, offload=self._copies, offload_if=lambda: self._busy > 1, send_slice_s=SEND_SLICE_S
        )
        # bounded (after the channel's own larger default): a peer that stops reading holds at
        # most this of the kernel's memory; the replies' read deadlines do the rest
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(self.limits.send_buffer))
        me = asyncio.current_task()
        replies = sess.replies = ReplyQueue(
            ch,
            REPLY_DEPTH,
            self.limits.transfer_timeout_s,
            self.metrics,
            self._bad,
            sess.peer,
            lambda d: self._active(sess, d),
            me.cancel,  # a failed send ends the connection
        )
        self.metrics.connections.inc()
        hello_by = time.monotonic() + self.limits.hello_timeout_s
        loop = asyncio.get_running_loop()
        graceful = False  # the replies queued are sent before the connection closes
        try:
            while not self.closing:
                await replies.room()
                h = await self._next_header(ch, sess, hello_by, replies)
                if h is None:
                    graceful = True
                    return
                sess.busy = True
                self._active(sess, 1)
                try:
                    # the whole request, its reply included, has twice the transfer deadline
                    # (one payload transfer plus its reply; a stalled transfer is cut first, as
                    # "transfer"): a peer that stops reading cannot hold a reply forever. The
                    # queued reply's send keeps the same deadline (replies.due).
                    replies.due = loop.time() + 2 * self.limits.transfer_timeout_s
                    async with asyncio.timeout_at(replies.due):
                        if not await self._request(replies, sess, h):
                            graceful = True
                            return
                except TimeoutError:
                    self.metrics.timeouts.labels("request").inc()
                    self._bad.info("timeout", peer=sess.peer, kind="request")
                    return
                finally:
                    sess.busy = False
                    self._active(sess, -1)
            graceful = True
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception as exc:  # never let one connection take the daemon down
            log.exception(kv("connection_failed", peer=sess.peer, error=type(exc).__name__))
        finally:
            try:
                if graceful:
                    await replies.drain()  # each send has its deadline
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                try:
                    await replies.close()  # first: no byte moves after this, so the slots can go back
                finally:  # even when cancelled again during close (which waits for its sender)
                    ch.close()
                    self._drop_session(sess)
                    if not sess.all_namespaces:
                        self.node.owners.release(sess.namespaces)
                    self.admission.leave(sess)
                    self.metrics.connections.dec()

    def _active(self, sess: Session, d: int) -> None:
        """Count ``sess`` in ``_busy`` while its reader serves a request or its replies are
        being sent (``d``: +1 when one of them starts, -1 when it ends)."""
        was = sess.active
        sess.active += d
        if (was == 0) != (sess.active == 0):
            self._busy += 1 if sess.active else -1

    async def _next_header(
        self, ch: SocketChannel, sess: Session, hello_by: float, replies: ReplyQueue
    ) -> dict | None:
        """The next request's header, or None (the connection ends) at a deadline or a bad
        frame. Before HELLO: a small header, all of it by the HELLO deadline. After: the first
        byte within the idle timeout, the rest within the transfer timeout."""
        lim = self.limits
        kind = "hello"
        try:
            # asyncio.timeout, not wait_for: the awaited code runs in this task, with no task
            # switch when the bytes are already there
            if sess.tenant is None:
                cap = int(lim.max_header_unauthenticated)
                async with asyncio.timeout(max(0.0, hello_by - time.monotonic())):
                    return await self._header(ch, cap, cap, lim.max_header_objects_unauthenticated)
            # one timer for both waits, moved from the idle deadline to the transfer one when
            # the first byte is there (a timer per wait was a tenth of a small GET's loop time)
            kind = "idle"
            async with asyncio.timeout(lim.idle_timeout_s) as deadline:
                await ch.readable()
                kind = "transfer"
                deadline.reschedule(asyncio.get_running_loop().time() + lim.transfer_timeout_s)
                return await self._header(ch, P.MAX_HEADER, self.max_frame, lim.max_header_objects)
        except TimeoutError:
            self.metrics.timeouts.labels(kind).inc()
            self._bad.info("timeout", peer=sess.peer, kind=kind)
            return None
        except FrameError as exc:
            self.metrics.protocol_errors.labels(exc.code).inc()
            self._bad.info("bad_frame", peer=sess.peer, code=exc.code, error=exc)
            replies.send(P.ErrorReply(0, exc.code, str(exc)).to_wire(), quiet=True)
            return None

    @staticmethod
    async def _header(ch: SocketChannel, max_header: int, max_frame: int, max_objects: int) -> dict:
        """:meth:`SocketChannel.recv_header`, with the decode bounded in objects too."""
        hlen = header_length(await ch.recv_exact(4), max_header, max_frame)
        return decode_header(await ch.recv_growing(hlen), max_frame, max_objects)

    def _drop_session(self, sess: Session) -> None:
        # first: no one-sided access to slots about to be freed
        for table in (sess.leases, sess.reservations):
            for held in table.values():
                self.descriptors.unwindow(sess, held)
        if sess.verbs is not None:
            sess.verbs.destroy()
            sess.verbs = None
            sess.windows = None
        try:
            if sess.leases:
                self.node.state.release([h.obj for h in sess.leases.values()])
            if sess.reservations:
                self.node.state.abort([h.obj for h in sess.reservations.values()])
        except Exception as exc:
            log.warning(kv("session_cleanup_failed", peer=sess.peer, error=exc))
        sess.leases.clear()
        sess.reservations.clear()

    def _parse(self, sess: Session, h: dict[str, Any], plen: int) -> tuple[str, Any]:
        """The op and typed request of header ``h`` (HELLO: its :class:`P.Hello`), after the
        checks that need only the op. ``h`` is emptied before this returns or raises: nothing
        the request does not use stays alive while its payload moves (a stalled payload
        behind a header of 65,536 objects would otherwise keep them all)."""
        try:
            op, _ = P.req_op(h)
            if op == P.Hello.OP:
                if plen:
                    raise P.bad("HELLO carries no payload")
                try:
                    return op, P.Hello.from_wire(h)
                except P.ProtocolError as exc:
                    if exc.code == P.BAD_VERSION:
                        raise Refusal(exc.code, str(exc)) from None
                    raise
            if sess.tenant is None:
                raise Refusal(P.AUTH, "send HELLO with a valid token first")
            if sess.all_namespaces and op not in PEER_OPS:
                # a peer session sees every tenant's blocks: only what repair needs
                raise P.ProtocolError(P.AUTH, f"{op}: a peer session may use only {sorted(PEER_OPS)}")
            if plen and op not in P.PAYLOAD_OPS:
                raise P.bad(f"{op} carries no payload")
            return op, P.REQUESTS[op].from_wire(h)
        except (P.ProtocolError, Refusal) as exc:
            # the traceback's frames hold the parsers' locals (parts of ``h``): drop them
            raise exc.with_traceback(None) from None
        finally:
            h.clear()

    async def _request(self, replies: ReplyQueue, sess: Session, h: dict[str, Any]) -> bool:
        """Serve one request: parse it into its typed request (:meth:`_parse`, which empties
        ``h``), hand it to the op's handler; False closes the connection (once the replies
        queued are sent). Queues exactly one reply, or none when the connection fails."""
        ch = replies.ch
        plen = payload_len(h)
        rid = P.request_rid(h)
        op = _op_label(h)
        t0 = time.perf_counter()
        try:
            self.descriptors.expire_windows(sess)
            op, req = self._parse(sess, h, plen)
            rid = req.rid
            if op == P.Hello.OP:
                replies.send(self.handshake.answer(sess, req).to_wire())
            elif op in self._queued_ops:
                await self._queued_ops[op](replies, sess, req, plen)
            else:  # a descriptor op sends its own reply, after those queued
                await replies.drain()
                await self._ops[op](ch, sess, req, plen)
            ok, latency, stat = self._op_metrics(op)
            ok.inc()
            latency.observe(time.perf_counter() - t0)
            if sess.tenant is not None:
                self.tenant_stats[sess.tenant][stat] += 1
            return True
        except Refusal as exc:
            self._count_error(op, exc.code)
            if exc.code == P.AUTH:
                self.metrics.auth_failures.labels("data").inc()
            self._bad.info("refused", peer=sess.peer, op=op, code=exc.code, error=exc)
            replies.send(P.ErrorReply(rid, exc.code, str(exc)).to_wire(), quiet=True)
            return False
        except P.ProtocolError as exc:
            # raised before any payload byte was read or any reply byte sent: resync is safe
            self._count_error(op, exc.code)
            if exc.code == P.AUTH:  # a peer session's op outside PEER_OPS
                self.metrics.auth_failures.labels("data").inc()
            self._bad.info("bad_request", peer=sess.peer, op=op, code=exc.code, error=exc)
            # (before HELLO the frame was at most limits.max_header_unauthenticated, and the
            # HELLO deadline still runs: a peer cannot stay unauthenticated by erring)
            await self.transfers.moving([], lambda _: ch.discard(plen))
            replies.send(P.ErrorReply(rid, exc.code, str(exc)).to_wire())
            return True
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:
            # mid-request: the stream may be desynchronised, so the connection ends here
            self._count_error(op, P.INTERNAL)
            log.exception(kv("op_failed", peer=sess.peer, op=op, error=type(exc).__name__))
            replies.send(
                P.ErrorReply(rid, P.INTERNAL, f"{op} failed: {type(exc).__name__}").to_wire(), quiet=True
            )
            return False

    def _op_metrics(self, op: str) -> tuple[Any, Any, str]:
        """The success counter, latency histogram and tenant-stat name of ``op`` (a known op),
        looked up once: a labels() lookup per request costs more than the increment."""
        got = self._per_op.get(op)
        if got is None:
            got = self._per_op[op] = (
                self.metrics.ops.labels(op, "ok"),
                self.metrics.latency.labels(op),
                f"ops_{op.lower()}",
            )
        return got

    def _count_error(self, op: str, code: str) -> None:
        self.metrics.ops.labels(op, code).inc()
        self.metrics.protocol_errors.labels(code).inc()

    # ------------------------------------------------------------ ops


def _op_label(h: dict[str, Any]) -> str:
    """The op a request's errors are counted under: "?" when it has no valid op and rid."""
    try:
        return P.req_op(h)[0]
    except P.ProtocolError:
        return "?"
