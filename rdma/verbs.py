"""The RDMA transport: one-sided READ/WRITE over an RC queue pair with pyverbs.

What it needs from a host: rdma-core's Python bindings (``pyverbs``; Debian/Ubuntu ship them
as ``python3-pyverbs``, built against the host's rdma-core) and a verbs device. Neither is a
pip dependency. Everything that does not touch a device lives in :mod:`rdma.transport` and is
shared with TCP (descriptors, QP info, batching, selection); this module is only the device
calls. It has NOT been run against a device (see docs/rdma.md); tests skip it with a reason.

Use: ``t = VerbsTransport.open()``; ``t.register(slab)`` once; exchange ``t.local_info()`` and
the peer's :class:`QPInfo` over the data connection (HELLO's ``rdma`` field); ``t.connect(peer)``;
then ``await t.read(pairs)`` / ``await t.write(pairs)``. A failed work request completes its
pair with False (a miss or a dropped write). Not thread-safe; one event loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import random
from collections.abc import Sequence
from typing import Any

from rdma.transport import QPInfo, RemoteDescriptor, Transport, TransportError, batches, check_pairs

MAX_WR = 64  # work requests per doorbell (and outstanding per QP)
MAX_BATCH_BYTES = 256 << 20


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


def buffer_address(buf: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of a writable contiguous buffer (numpy array, bytearray,
    memoryview, torch tensor). Raises TransportError for a read-only or strided buffer."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):  # torch, without importing it
        if not buf.is_contiguous():
            raise TransportError("cannot register a non-contiguous tensor")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    mv = memoryview(buf)
    if mv.readonly or not mv.contiguous:
        raise TransportError("can only register writable contiguous buffers")
    mv = mv.cast("B")
    return ctypes.addressof(ctypes.c_char.from_buffer(mv)), mv.nbytes


class VerbsTransport(Transport):
    name = "rdma"

    def __init__(self, pv, ctx, pd, cq, qp, port: int, gid_index: int) -> None:
        self._pv, self.ctx, self.pd, self.cq, self.qp = pv, ctx, pd, cq, qp
        self.port, self.gid_index = port, gid_index
        self._mrs: list[tuple[int, int, Any]] = []  # (addr, len, MR)
        self._psn = random.randrange(1 << 24)
        self._wr_id = 0

    @classmethod
    def open(cls, device: str | None = None, port: int = 1, gid_index: int = 0) -> VerbsTransport:
        """Open ``device`` (default: the first), a PD, a CQ and an RC QP. TransportError when
        pyverbs or a device is missing."""
        pv = _pyverbs()
        if pv is None:
            raise TransportError(
                "RDMA needs pyverbs (python3-pyverbs from the host's rdma-core); see docs/rdma.md"
            )
        try:
            names = [d.name.decode() for d in pv.device.get_device_list()]
        except Exception as exc:
            raise TransportError(f"no RDMA devices: {exc}") from exc
        if not names or (device and device not in names):
            raise TransportError(f"RDMA device {device or '(any)'} not found; have {names}")
        e = pv.enums
        ctx = pv.device.Context(name=device or names[0])
        pd = pv.pd.PD(ctx)
        cq = pv.cq.CQ(ctx, MAX_WR * 4)
        cap = pv.qp.QPCap(max_send_wr=MAX_WR, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)
        qp = pv.qp.QP(pd, init)
        return cls(pv, ctx, pd, cq, qp, port, gid_index)

    def register(self, buf) -> Any:
        addr, length = buffer_address(buf)
        e = self._pv.enums
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        mr = self._pv.mr.MR(self.pd, length, access, address=addr)
        self._mrs.append((addr, length, mr))
        return mr

    def local_info(self) -> QPInfo:
        port = self.ctx.query_port(self.port)
        gid = self.ctx.query_gid(self.port, self.gid_index)
        return QPInfo(
            self.qp.qp_num, self._psn, port.lid, bytes.fromhex(gid.gid.replace(":", "")), port.active_mtu
        )

    def connect(self, peer: QPInfo) -> None:
        """Move the QP to RTS against ``peer``."""
        pv, e = self._pv, self._pv.enums
        attr = pv.qp.QPAttr(port_num=self.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        attr.path_mtu = min(peer.mtu, self.local_info().mtu)
        attr.dest_qp_num = peer.qp_num
        attr.rq_psn = peer.psn
        attr.sq_psn = self._psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 16
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        gr = pv.addr.GlobalRoute(
            dgid=pv.addr.GID(":".join(peer.gid.hex()[i : i + 4] for i in range(0, 32, 4)))
        )
        gr.sgid_index = self.gid_index
        attr.ah_attr = pv.addr.AHAttr(port_num=self.port, dlid=peer.lid, is_global=1, gr=gr)
        self.qp.to_rts(attr)

    def _lkey(self, mv: memoryview) -> int:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mv)) if not mv.readonly else None
        for base, length, mr in self._mrs:
            if addr is not None and base <= addr and addr + mv.nbytes <= base + length:
                return mr.lkey
        raise TransportError("local buffer is not inside a registered region; call register() first")

    async def _post(self, opcode, pairs, views) -> list[bool]:
        done = [False] * len(pairs)
        for idx in batches(pairs, MAX_WR, MAX_BATCH_BYTES):
            head = None
            ids = {}
            for i in reversed(idx):
                mv, desc = views[i], pairs[i][1]
                self._wr_id += 1
                ids[self._wr_id] = i
                sge = self._pv.wr.SGE(
                    ctypes.addressof(ctypes.c_char.from_buffer(mv)), desc.length, self._lkey(mv)
                )
                wr = self._pv.wr.SendWR(
                    wr_id=self._wr_id,
                    opcode=opcode,
                    num_sge=1,
                    sg=[sge],
                    send_flags=self._pv.enums.IBV_SEND_SIGNALED,
                )
                wr.set_wr_rdma(desc.rkey, desc.addr)
                if head is not None:
                    wr.next_wr = head
                head = wr
            try:
                self.qp.post_send(head)
            except Exception:
                return done
            pending = len(idx)
            while pending:
                n, wcs = self.cq.poll(pending)
                for wc in wcs[:n]:
                    pending -= 1
                    if wc.wr_id in ids and wc.status == self._pv.enums.IBV_WC_SUCCESS:
                        done[ids[wc.wr_id]] = True
                if pending:
                    await asyncio.sleep(0)  # yield; completions for MiB-sized WRs take microseconds
        return done

    async def read(self, pairs: Sequence[tuple[Any, RemoteDescriptor]]) -> list[bool]:
        views = check_pairs(pairs)
        return await self._post(self._pv.enums.IBV_WR_RDMA_READ, pairs, views)

    async def write(self, pairs: Sequence[tuple[Any, RemoteDescriptor]]) -> list[bool]:
        views = check_pairs(pairs)
        return await self._post(self._pv.enums.IBV_WR_RDMA_WRITE, pairs, views)

    async def close(self) -> None:
        for _, _, mr in self._mrs:
            mr.close()
        self._mrs.clear()
        for obj in (self.qp, self.cq, self.pd, self.ctx):
            obj.close()
