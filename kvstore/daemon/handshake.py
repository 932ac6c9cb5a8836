"""HELLO on the data port: who a connection is, what it may see, how its bytes move.

:class:`Handshake` answers a HELLO (:meth:`Handshake.answer`) on a :class:`Session`: the token
names the tenant (a claimed tenant must be the token's); a *peer* HELLO (tenant ``"*"`` with
the operator token, or any token-less HELLO to a node without auth) is another node's repair,
which sees every tenant's blocks for the peer ops only (the port enforces which); the
tenant's namespaces are derived with its salt and claimed in the node's per-tenant shares
(``limits.max_namespaces_per_tenant``); the tenant's connections are capped
(``limits.max_conns_per_tenant``); an RDMA offer is accepted or refused per
``server.transport``. A second HELLO re-authenticates and replaces the namespaces and the
queue pair. Anything refused raises :class:`Refusal`: the port replies with its code and
closes the connection (docs/protocol.md, HELLO). Loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore import protocol as P
from kvstore.daemon.admission import Admission
from kvstore.daemon.auth import OPERATOR, TokenTable
from kvstore.daemon.descriptor_ops import DescriptorOps
from kvstore.daemon.logs import RateLimitedLog
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.session import Session
from kvstore.daemon.slab_rdma import SlabRdma, accept_offer
from kvstore.node.store import NodeStore
from kvstore.node.tiers.owners import NamespaceCapError
from rdma.transport import TransportError
from rdma.windows import Windows


class Refusal(Exception):
    """Reply with this error code, then close the connection."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Handshake:
    """HELLO for one data port. ``tokens()`` is the port's current token table (swapped on
    SIGHUP); ``descriptors`` unbinds a re-HELLO's windows; ``rdma``/``transport`` answer
    RDMA offers; ``node_name`` and ``max_frame`` go in the reply."""

    def __init__(
        self,
        node: NodeStore,
        tokens: Callable[[], TokenTable],
        admission: Admission,
        metrics: DaemonMetrics,
        limits,
        descriptors: DescriptorOps,
        rdma: SlabRdma | None,
        transport: str,
        node_name: str,
        max_frame: int,
        log: RateLimitedLog,
    ) -> None:
        self.node = node
        self._tokens = tokens
        self.admission = admission
        self.metrics = metrics
        self.limits = limits
        self.descriptors = descriptors
        self.rdma = rdma
        self.transport = transport
        self.node_name = node_name
        self.max_frame = max_frame
        self._log = log  # one line per HELLO, at most 10 per 10 s

    def answer(self, sess: Session, hello: P.Hello) -> P.HelloReply:
        """Authenticate ``sess`` with ``hello`` and fill it in; the reply to send. Raises
        :class:`Refusal` for a refused token, tenant claim, cap or transport."""
        tokens = self._tokens()
        tenant = tokens.tenant_of(hello.token)
        if tenant is None:
            raise Refusal(P.AUTH, "token refused")
        # A peer session (another node's repair, docs/cluster.md): tenant "*" with the operator
        # token, or without auth (loopback only). It sees every tenant's blocks, for PEER_OPS only.
        peer = hello.tenant == OPERATOR and (tenant == OPERATOR or not tokens.enabled)
        if tenant == OPERATOR and not peer:
            raise Refusal(P.AUTH, "the operator token is for the admin port, or a peer HELLO (tenant '*')")
        if hello.tenant not in (None, tenant) and not peer:
            raise Refusal(P.AUTH, f"tenant {hello.tenant!r} does not match the token's")
        if peer:
            tenant = OPERATOR
        salt = "" if peer else tokens.salt_of(tenant)
        declared = [] if peer else hello.namespaces_with(salt)
        sess.all_namespaces = peer
        ids = [n.id.raw for n in declared]
        if not self.admission.authenticate(sess, tenant):
            self.metrics.refused_connections.labels("per_tenant").inc()
            raise Refusal(P.BUSY, f"this tenant has {self.limits.max_conns_per_tenant} connections open")
        if not peer:  # the node's shares count this tenant's bytes over all its namespaces
            try:
                self.node.owners.claim(tenant, ids, previous=sess.namespaces)
            except NamespaceCapError as exc:
                self.metrics.refused_connections.labels("namespaces").inc()
                raise Refusal(P.BUSY, str(exc)) from None
        elif sess.namespaces:  # a peer HELLO after a tenant's: it declares none
            self.node.owners.release(sess.namespaces)
        sess.tenant, sess.token, sess.salt = tenant, hello.token, salt
        if sess.verbs is not None:  # a second HELLO replaces the queue pair (and its windows)
            for table in (sess.leases, sess.reservations):
                for held in table.values():
                    self.descriptors.unwindow(sess, held)
            sess.verbs.destroy()
            sess.verbs = sess.windows = None
        try:
            accepted = accept_offer(self.rdma, self.transport, hello.rdma, sess.peer, self.metrics)
        except TransportError as exc:
            raise Refusal(P.TRANSPORT, str(exc)) from exc
        sess.verbs, rdma = accepted or (None, None)
        sess.windows = Windows(sess.verbs) if sess.verbs is not None else None
        transport = "rdma" if rdma is not None else "tcp"
        self.metrics.hellos.labels(transport).inc()
        sess.namespaces = frozenset(ids)
        sess.declared = {n.id.raw: n for n in declared}
        sess.derive_keys = tokens.enabled
        self._log.info(
            "hello", peer=sess.peer, tenant=tenant or "-", namespaces=len(ids), transport=transport
        )
        return P.HelloReply(hello.rid, tenant, salt, tuple(ids), self.node_name, self.max_frame, rdma)
