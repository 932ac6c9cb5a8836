"""The RDMA transport: one-sided READ/WRITE over RC queue pairs with pyverbs.

What it needs from a host: rdma-core's Python bindings (``pyverbs``; Debian/Ubuntu ship them
as ``python3-pyverbs``, built against the host's rdma-core) and a verbs device. Neither is a
pip dependency. Everything that does not touch a device lives in :mod:`rdma.transport` and is
shared with TCP (descriptors, QP info, regions, registrations, batching, selection); this
module is only the device calls, plus two builders of pyverbs objects (work-request chains,
QP attributes) that need the bindings but no device. The device calls have NOT been run
(see docs/rdma.md); tests skip them with a reason.

Use: ``dev = VerbsDevice.open()``; ``dev.register(buf)`` once per large buffer (the node's
DRAM slab, a client's staging buffers); per connection ``t = dev.queue_pair()``, send
``t.info`` to the peer (HELLO's ``rdma`` field), ``t.connect(peer_info)``, then
``await t.read(pairs)`` / ``await t.write(pairs)``. A failed work request completes its pair
with False (a miss or a dropped write). Not thread-safe; one event loop.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

from rdma.transport import (
    QPInfo,
    Region,
    Registrations,
    RemoteDescriptor,
    Transport,
    TransportError,
    batches,
    buffer_address,
    check_pairs,
)

MAX_WR = 64  # work requests per doorbell (and outstanding per QP)
MAX_BATCH_BYTES = 256 << 20
_DRAIN_POLLS = 100_000  # bound on polls while flushing a cancelled batch

__all__ = ["VerbsDevice", "VerbsTransport", "buffer_address", "device_available", "rts_attr", "wr_chain"]


def _pyverbs():
    """The pyverbs modules, or None when the bindings are not installed."""
    try:
        import pyverbs.addr
        import pyverbs.cq
        import pyverbs.device
        import pyverbs.enums
        import pyverbs.mr
        import pyverbs.pd
        import pyverbs.qp
        import pyverbs.wr
    except ImportError:
        return None
    return pyverbs


def device_available() -> bool:
    """True when pyverbs imports and lists at least one verbs device. Never raises."""
    pv = _pyverbs()
    if pv is None:
        return False
    try:
        return len(pv.device.get_device_list()) > 0
    except Exception:  # PyverbsRDMAError when the kernel has no RDMA support
        return False


def _access(e) -> int:
    return e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE


def wr_chain(pv, opcode: int, items: Sequence[tuple[int, int, int, int, int, int]]) -> list:
    """Signalled RDMA work requests, chained in order, for ``(wr_id, local addr, length, lkey,
    remote addr, rkey)`` items. The list keeps every request alive until it is posted (the
    chain links C structs; Python must hold each object). Needs pyverbs, not a device."""
    wrs = []
    for wr_id, addr, length, lkey, raddr, rkey in items:
        wr = pv.wr.SendWR(
            wr_id=wr_id,
            opcode=opcode,
            num_sge=1,
            sg=[pv.wr.SGE(addr, length, lkey)],
            send_flags=pv.enums.IBV_SEND_SIGNALED,
        )
        wr.set_wr_rdma(rkey, raddr)
        wrs.append(wr)
    for a, b in zip(wrs, wrs[1:]):
        a.next_wr = b
    return wrs


def rts_attr(pv, peer: QPInfo, local_mtu: int, sq_psn: int, port: int, gid_index: int):
    """The QPAttr that moves an RC QP to RTS against ``peer``. Needs pyverbs, not a device."""
    e = pv.enums
    attr = pv.qp.QPAttr(port_num=port)
    attr.qp_access_flags = _access(e)
    attr.path_mtu = min(peer.mtu, local_mtu)
    attr.dest_qp_num = peer.qp_num
    attr.rq_psn = peer.psn
    attr.sq_psn = sq_psn
    attr.max_dest_rd_atomic = attr.max_rd_atomic = 16
    attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
    gid = ":".join(peer.gid.hex()[i : i + 4] for i in range(0, 32, 4))
    gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(gid))
    gr.sgid_index = gid_index
    attr.ah_attr = pv.addr.AHAttr(port_num=port, dlid=peer.lid, is_global=1, gr=gr)
    return attr


class VerbsDevice:
    """An open verbs device: context, protection domain, and the memory registered with it.
    Open once per process side (a node; a client), register large buffers once, then make one
    :class:`VerbsTransport` per connection; their work requests may use any registration."""

    def __init__(self, pv, ctx, pd, name: str, port: int, gid_index: int) -> None:
        self._pv, self.ctx, self.pd = pv, ctx, pd
        self.name, self.port, self.gid_index = name, port, gid_index
        self.registrations = Registrations()
        self._mrs: list[Any] = []
        self._mr_at: dict[int, Any] = {}
        self._qps: list[VerbsTransport] = []

    @classmethod
    def open(cls, name: str | None = None, port: int = 1, gid_index: int = 0) -> VerbsDevice:
        """Open device ``name`` (default: the first) and a PD. TransportError when pyverbs or
        the device is missing, or the device cannot be opened."""
        pv = _pyverbs()
        if pv is None:
            raise TransportError(
                "RDMA needs pyverbs (python3-pyverbs from the host's rdma-core); see docs/rdma.md"
            )
        try:
            names = [d.name.decode() for d in pv.device.get_device_list()]
        except Exception as exc:
            raise TransportError(f"no RDMA devices: {exc}") from exc
        if not names or (name and name not in names):
            raise TransportError(f"RDMA device {name or '(any)'} not found; have {names}")
        try:
            ctx = pv.device.Context(name=name or names[0])
            pd = pv.pd.PD(ctx)
        except Exception as exc:
            raise TransportError(f"cannot open RDMA device {name or names[0]}: {exc}") from exc
        return cls(pv, ctx, pd, name or names[0], port, gid_index)

    def register(self, buf, remote: bool = True) -> Region:
        """Register ``buf`` (writable, contiguous) for local use and remote READ/WRITE; the
        returned Region is what a peer needs (address, length, rkey). With ``remote=False``
        the region's own rkey grants no remote access at all: peers reach its bytes only
        through memory windows bound per lease (rdma/windows.py). TransportError on failure."""
        addr, length = buffer_address(buf)
        e = self._pv.enums
        access = _access(e) if remote else e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_MW_BIND
        try:
            mr = self._pv.mr.MR(self.pd, length, access, address=addr)
        except Exception as exc:
            raise TransportError(f"cannot register {length} bytes with {self.name}: {exc}") from exc
        self._mrs.append(mr)
        self._mr_at[addr] = mr
        self.registrations.add(addr, length, mr.lkey)
        return Region(addr, length, mr.rkey)

    def mr_for(self, region: Region):
        """The memory region object registered as ``region`` (for binding windows)."""
        mr = self._mr_at.get(region.addr)
        if mr is None:
            raise TransportError(f"region {region.addr:#x} is not registered with {self.name}")
        return mr

    def queue_pair(self) -> VerbsTransport:
        """A new CQ + RC QP on this device (one per connection); ``.info`` is what to send."""
        pv, e = self._pv, self._pv.enums
        made: list[Any] = []
        try:
            made.append(pv.cq.CQ(self.ctx, MAX_WR * 4))
            cap = pv.qp.QPCap(max_send_wr=MAX_WR, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=made[0], rcq=made[0], cap=cap)
            made.append(pv.qp.QP(self.pd, init))
            t = VerbsTransport(self, made[0], made[1])
        except Exception as exc:
            for obj in reversed(made):
                obj.close()
            raise TransportError(f"cannot create a queue pair on {self.name}: {exc}") from exc
        self._qps.append(t)
        return t

    def close(self) -> None:
        """Destroy every queue pair, deregister everything, close the device; idempotent."""
        for t in list(self._qps):
            t.destroy()
        for mr in self._mrs:
            mr.close()
        self._mrs.clear()
        self._mr_at.clear()
        self.registrations.clear()
        for obj in (self.pd, self.ctx):
            obj.close()


class VerbsTransport(Transport):
    """One RC queue pair (with its CQ) of a :class:`VerbsDevice`: one connection's one-sided
    reads and writes. Local buffers must lie inside the device's registrations."""

    name = "rdma"

    def __init__(self, device: VerbsDevice, cq, qp) -> None:
        self.device, self.cq, self.qp = device, cq, qp
        self._pv = device._pv
        self._psn = random.randrange(1 << 24)
        self._wr_id = 0
        self.closed = False
        port = device.ctx.query_port(device.port)
        gid = device.ctx.query_gid(device.port, device.gid_index)
        self.info = QPInfo(
            qp.qp_num,
            self._psn,
            port.lid,
            bytes.fromhex(gid.gid.replace(":", "")),
            port.active_mtu,
            device.port,
            device.gid_index,
        )

    def register(self, buf) -> Region:
        return self.device.register(buf)

    def connect(self, peer: QPInfo) -> None:
        """Move the QP to RTS against ``peer``; TransportError when the device refuses."""
        d = self.device
        try:
            self.qp.to_rts(rts_attr(self._pv, peer, self.info.mtu, self._psn, d.port, d.gid_index))
        except Exception as exc:
            raise TransportError(f"cannot connect the queue pair to qpn {peer.qp_num}: {exc}") from exc

    async def _post(self, opcode, pairs, views) -> list[bool]:
        done = [False] * len(pairs)
        regs = self.device.registrations
        for idx in batches(pairs, MAX_WR, MAX_BATCH_BYTES):
            ids, items = {}, []
            for i in idx:
                mv, desc = views[i], pairs[i][1]
                lkey = regs.find(mv)
                if lkey is None:
                    raise TransportError(f"pair {i}: local buffer is not inside a registered region")
                self._wr_id += 1
                ids[self._wr_id] = i
                items.append((self._wr_id, buffer_address(mv)[0], desc.length, lkey, desc.addr, desc.rkey))
            wrs = wr_chain(self._pv, opcode, items)
            try:
                self.qp.post_send(wrs[0])
            except Exception:
                return done
            pending = len(items)
            try:
                while pending:
                    n, wcs = self.cq.poll(pending)
                    for wc in wcs[:n]:
                        pending -= 1
                        if wc.wr_id in ids and wc.status == self._pv.enums.IBV_WC_SUCCESS:
                            done[ids[wc.wr_id]] = True
                    if pending:
                        await asyncio.sleep(0)  # yield; MiB-sized WRs complete in microseconds
            except asyncio.CancelledError:
                self._flush(pending)  # no DMA into the caller's buffers after we return
                raise
        return done

    def _flush(self, pending: int) -> None:
        """Move the QP to the error state and reap ``pending`` flushed completions."""
        try:
            attr = self._pv.qp.QPAttr()
            attr.qp_state = self._pv.enums.IBV_QPS_ERR
            self.qp.modify(attr, self._pv.enums.IBV_QP_STATE)
            for _ in range(_DRAIN_POLLS):
                if pending <= 0:
                    break
                n, _ = self.cq.poll(pending)
                pending -= n
        except Exception:
            pass  # the QP is destroyed with the connection in any case

    async def read(self, pairs: Sequence[tuple[Any, RemoteDescriptor]]) -> list[bool]:
        views = check_pairs(pairs)
        return await self._post(self._pv.enums.IBV_WR_RDMA_READ, pairs, views)

    async def write(self, pairs: Sequence[tuple[Any, RemoteDescriptor]]) -> list[bool]:
        views = check_pairs(pairs)
        return await self._post(self._pv.enums.IBV_WR_RDMA_WRITE, pairs, views)

    def destroy(self) -> None:
        """Destroy the QP and its CQ (synchronously); idempotent."""
        if not self.closed:
            self.closed = True
            if self in self.device._qps:
                self.device._qps.remove(self)
            for obj in (self.qp, self.cq):
                try:
                    obj.close()
                except Exception:
                    pass
