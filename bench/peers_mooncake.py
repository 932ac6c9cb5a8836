"""Mooncake Store's side of bench/peers.py: run by it in the peers venv (``make peers``), inside
a private network namespace (the transfer engine listens on every interface).

``peers_mooncake.py SIZE COUNT``: starts ``mooncake_master`` (HTTP metadata server in it) and
a store process that holds the global segment, then serves commands on stdin, one JSON line
each on stdout: ``fetch`` (batch_get_into registered buffers, every block compared with what
was stored), ``store`` (batch_put_from), ``clean`` (remove the stored keys), ``quit``.
``peers_mooncake.py --segment MASTER META BYTES``: the store process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import cpu_s, free_port  # the standard library only: this venv has no tierkv


def _store(master: str, meta: str, segment: int, local: int):
    from mooncake.store import MooncakeDistributedStore

    st = MooncakeDistributedStore()
    rc = st.setup("127.0.0.1", meta, segment, local, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"setup returned {rc}")
    return st


def segment(master: str, meta: str, nbytes: int) -> None:
    st = _store(master, meta, nbytes, 16 << 20)
    print("up", flush=True)
    sys.stdin.read()  # until the parent closes it
    del st


def start_store(segment_bytes: int) -> tuple[subprocess.Popen, subprocess.Popen, str, str]:
    """``mooncake_master`` (HTTP metadata server in it) from this interpreter's venv and a store
    process holding a ``segment_bytes`` segment (it prints "up" once mounted; closing its stdin
    ends it): (master, segment, master address, metadata URL). Also bench/vllm_mooncake.py's."""
    rpc, http = free_port(), free_port()
    bindir = Path(sys.executable).parent
    master_bin = shutil.which("mooncake_master", path=str(bindir)) or "mooncake_master"
    master = subprocess.Popen(
        [
            master_bin,
            f"--rpc_port={rpc}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(2)
    maddr, meta = f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
    seg = subprocess.Popen(
        [sys.executable, __file__, "--segment", maddr, meta, str(segment_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    return master, seg, maddr, meta


def main() -> int:
    if sys.argv[1] == "--segment":
        segment(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    size, count = int(sys.argv[1]), int(sys.argv[2])
    nbytes = size * count
    master, seg, maddr, meta = start_store(3 * nbytes + (256 << 20))
    try:
        if seg.stdout.readline().strip() != "up":
            print(json.dumps({"ready": False, "why": "store segment did not start"}), flush=True)
            return 1
        cl = _store(maddr, meta, 0, 16 << 20)
        src = np.random.default_rng(size + 1).integers(0, 256, (count, size), dtype=np.uint8)
        dst = np.ones((count, size), np.uint8)
        for a in (src, dst):
            if cl.register_buffer(a.ctypes.data, a.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
        ptr = lambda a: [a.ctypes.data + i * size for i in range(count)]  # noqa: E731
        fkeys = [f"f{i}" for i in range(count)]
        skeys = [f"s{i}" for i in range(count)]
        sizes = [size] * count
        rc = cl.batch_put_from(fkeys, ptr(src), sizes)
        pre = sum(1 for r in rc if r != 0)
        print(json.dumps({"ready": True, "preload_failures": pre}), flush=True)
        servers = [master.pid, seg.pid]
        for line in sys.stdin:
            op = line.strip()
            if op == "quit":
                break
            if op == "clean":
                for k in skeys:
                    cl.remove(k, True)
                print(json.dumps({}), flush=True)
                continue
            s0, c0, t0 = cpu_s(servers), time.process_time(), time.perf_counter()
            if op == "fetch":
                rc = cl.batch_get_into(fkeys, ptr(dst), sizes)
            else:
                rc = cl.batch_put_from(skeys, ptr(src), sizes)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            srv = cpu_s(servers) - s0
            if op == "fetch":
                bad = sum(1 for i, r in enumerate(rc) if r != size or not np.array_equal(dst[i], src[i]))
                dst[:] = 1
            else:
                bad = sum(1 for r in rc if r != 0)
            codes = sorted({int(r) for r in rc if (r < 0)})
            print(
                json.dumps({"s": dt, "client_cpu": cpu, "server_cpu": srv, "failures": bad, "codes": codes}),
                flush=True,
            )
    finally:
        seg.stdin.close()
        seg.kill()
        master.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
