"""Remote access per lease: type-2 memory windows bound to one slot's bytes.

The node registers its DRAM slab for local access and window binding only
(``VerbsDevice.register(buf, remote=False)``): the slab's own rkey grants nothing to a peer.
For each one-sided lease (or reservation) the node binds a fresh type-2 memory window to
exactly that payload's range, on that connection's queue pair, with REMOTE_READ (lease) or
REMOTE_WRITE (reservation), and hands out the window's rkey. A type-2 window is reachable
only through the queue pair it was bound on, so another connection cannot use the key.
:meth:`Windows.revoke` deallocates the window (the rkey stops working) and must run before the
slot is released, aborted or committed, and for every open window before the queue pair is
destroyed.

What ran: only the device-free parts (:func:`inc_rkey`, :func:`mw_access` and :func:`bind_wr`
built with the system's pyverbs, when installed). No RDMA device was available: binding,
using and invalidating windows on hardware has not been exercised (docs/rdma.md).
"""

from __future__ import annotations

import asyncio
from typing import Any

from rdma.transport import Region, TransportError

_BIND_POLLS = 100_000  # bound on CQ polls while waiting for one bind to complete


def inc_rkey(rkey: int) -> int:
    """libibverbs' ``ibv_inc_rkey``: the key a type-2 bind gives the window (the low 8 bits
    are the consumer's tag, bumped on every bind so an old key never matches a new binding)."""
    return (rkey & 0xFFFFFF00) | ((rkey + 1) & 0xFF)


def mw_access(e, write: bool) -> int:
    """The remote access a window grants: WRITE into a reservation, READ of a lease."""
    return e.IBV_ACCESS_REMOTE_WRITE if write else e.IBV_ACCESS_REMOTE_READ


def bind_wr(pv, wr_id: int, mw, mr, addr: int, length: int, access: int):
    """The signalled BIND_MW work request binding ``mw`` to ``[addr, addr + length)`` of
    ``mr`` with ``access``."""
    e = pv.enums
    wr = pv.wr.SendWR(wr_id=wr_id, opcode=e.IBV_WR_BIND_MW, send_flags=e.IBV_SEND_SIGNALED)
    wr.set_bind_wr(mw, pv.mr.MWBindInfo(mr, addr, length, access))
    return wr


class Windows:
    """The windows bound on one connection's queue pair (a ``rdma.verbs.VerbsTransport``),
    by rkey. Loop thread only."""

    def __init__(self, qp) -> None:
        self.qp = qp
        self._open: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self._open)

    async def grant(self, region: Region, addr: int, length: int, write: bool) -> int:
        """Bind a new window to ``[addr, addr + length)`` inside ``region`` (a registration of
        this device) and return its rkey. TransportError when the device refuses (the caller
        then moves the bytes inline)."""
        if not (region.addr <= addr and addr + length <= region.addr + region.length):
            raise TransportError(f"range {addr:#x}+{length} is outside the registered region")
        dev = self.qp.device
        pv, e = dev._pv, dev._pv.enums
        try:
            mw = pv.mr.MW(dev.pd, e.IBV_MW_TYPE_2)
        except Exception as exc:
            raise TransportError(f"cannot allocate a memory window: {exc}") from exc
        self.qp._wr_id += 1
        wr_id = self.qp._wr_id
        try:
            self.qp.qp.post_send(
                bind_wr(pv, wr_id, mw, dev.mr_for(region), addr, length, mw_access(e, write))
            )
            for _ in range(_BIND_POLLS):
                n, wcs = self.qp.cq.poll(1)
                if n:
                    if wcs[0].wr_id != wr_id or wcs[0].status != e.IBV_WC_SUCCESS:
                        raise TransportError(f"window bind failed: status {wcs[0].status}")
                    break
                await asyncio.sleep(0)
            else:
                raise TransportError("window bind did not complete")
        except TransportError:
            mw.close()
            raise
        except Exception as exc:
            mw.close()
            raise TransportError(f"cannot bind a memory window: {exc}") from exc
        rkey = inc_rkey(mw.rkey)
        self._open[rkey] = mw
        return rkey

    def revoke(self, rkey: int) -> None:
        """Deallocate the window of ``rkey``: remote access through it ends (idempotent)."""
        mw = self._open.pop(rkey, None)
        if mw is not None:
            try:
                mw.close()
            except Exception:
                pass  # the QP is being torn down; the window goes with the PD
