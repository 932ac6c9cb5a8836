"""GET and PUT throughput of a tierkv daemon over loopback, beside the raw-socket limit and Redis.

For each block size (2 MiB, 32 MiB) and client count (1, 8) it measures, in the same run:
  raw     blocking sendall -> recv_into between two processes (the limit for any TCP store)
  tierkv  `kvstore serve` (DRAM tier only) with kvstore.client.node: PUT fresh blocks, GET into
          preallocated buffers (every payload checksum-verified by the client)
  redis   redis-server (no persistence) with redis-py SET/GET of the same bytes
Each client is its own process; GB/s = total payload bytes / wall time of the slowest client.
``--policies``: one daemon per eviction policy (``[eviction] policy``), measured interleaved in
each run, the first listed in the ``tierkv`` column and each other as a ratio to it (the
eviction order's per-op cost: every PUT past the DRAM capacity evicts).
Prints a table and the load average before and after, and writes both as JSON (--json). Redis
is skipped (noted) when redis-server is absent.

    python bench/store_throughput.py --json .bench/store.json
    python bench/store_throughput.py --policies prefix-marginal,lru --sizes 2MiB --no-redis
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ raw socket


def _raw_server(port_q, size: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    port_q.put(srv.getsockname()[1])

    import threading

    def serve(conn):
        buf = bytearray(size)
        mv = memoryview(buf)
        while True:
            op = conn.recv(1)
            if not op:
                return
            if op == b"P":  # client sends `size` bytes, we receive them
                got = 0
                while got < size:
                    n = conn.recv_into(mv[got:])
                    if not n:
                        return
                    got += n
                conn.sendall(b"k")
            else:  # client reads `size` bytes
                conn.sendall(mv)

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _raw_client(port: int, size: int, ops: int, op: str, start, out) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(os.urandom(size))
    mv = memoryview(buf)
    start.wait()
    t0 = time.perf_counter()
    for _ in range(ops):
        if op == "put":
            s.sendall(b"P")
            s.sendall(mv)
            s.recv(1)
        else:
            s.sendall(b"G")
            got = 0
            while got < size:
                got += s.recv_into(mv[got:])
    out.put(time.perf_counter() - t0)


# ------------------------------------------------------------------ tierkv


def _blocks(size: int, n: int, seed: int):
    from kvstore.block import make_header
    from kvstore.keys import Namespace

    ns = Namespace("bench-model", "uint8", 16)
    payload = os.urandom(size)
    base = make_header(
        key=ns.id,
        parent=ns.id,
        namespace=ns.id,
        tokens=[0] * 16,
        dtype="uint8",
        shape=[size],
        payload=payload,
    )
    keys = ns.block_keys([seed] + list(range(16 * n - 1)))
    return ns, [(dataclasses.replace(base, key=k), payload) for k in keys]


def _tierkv_client(addr: str, size: int, ops: int, op: str, seed: int, start, out) -> None:
    from kvstore.client.node import ClientConfig, NodeClient
    from kvstore.results import Status

    async def run():
        ns, blocks = _blocks(size, ops if op == "put" else 4, seed)
        c = NodeClient(addr, ClientConfig(namespaces=(ns,), pool_size=1, op_timeout_s=60))
        keys = [h.key for h, _ in blocks]
        if op == "get":
            await c.put(blocks)
        bufs = [bytearray(size)]
        await c.exists(keys[:1])  # connect before the clock starts
        start.wait()
        t0 = time.perf_counter()
        bad = 0
        for i in range(ops):
            if op == "put":
                (r,) = await c.put([blocks[i]])
                bad += not r.status.ok
            else:
                (g,) = await c.get_into([keys[i % len(keys)]], bufs)
                bad += g.status is not Status.HIT
        dt = time.perf_counter() - t0
        if op == "put":  # leave the slots free (and faulted in) for the next measurement
            await c.delete(keys)
        await c.close()
        if bad:
            print(f"tierkv {op}: {bad} of {ops} ops failed", file=sys.stderr)
        out.put(dt)

    asyncio.run(run())


# ------------------------------------------------------------------ redis


def _redis_client(port: int, size: int, ops: int, op: str, seed: int, start, out) -> None:
    import redis

    r = redis.Redis(port=port)
    payload = os.urandom(size)
    keys = [f"blk:{seed}:{i}" for i in range(ops if op == "put" else 4)]
    if op == "get":
        for k in keys:
            r.set(k, payload)
    r.ping()
    start.wait()
    t0 = time.perf_counter()
    for i in range(ops):
        if op == "put":
            r.set(keys[i], payload)
        else:
            v = r.get(keys[i % len(keys)])
            assert v is not None and len(v) == size
    out.put(time.perf_counter() - t0)


# ------------------------------------------------------------------ driver


def _measure(target, per_client: list[tuple], size: int, ops: int) -> float:
    """Run one process per argument tuple; start them together; aggregate GB/s."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    clients = len(per_client)
    procs = [ctx.Process(target=target, args=(*a, start, out)) for a in per_client]
    for p in procs:
        p.start()
    time.sleep(1.0 + 0.3 * clients)  # let every client connect and prepare
    start.set()
    times = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return clients * ops * size / max(times) / 1e9


def _warm(addr: str, rport: int | None, size: int, capacity: int) -> None:
    """Touch every DRAM slot once (PUT then DELETE a capacity's worth), as a long-running node
    has: a fresh anonymous mapping pays a page fault per 4 KiB on first write, which would
    otherwise dominate the first PUTs. Redis gets the same treatment."""
    ops = capacity // size - 1
    _measure(_tierkv_client, [(addr, size, ops, "put", 999_999)], size, ops)
    if rport:
        _measure(_redis_client, [(rport, size, ops, "put", 999_999)], size, ops)
        import redis

        redis.Redis(port=rport).flushall()


def _dram_capacity(slab: int) -> int:
    return max(1024 * MiB, 40 * slab)


def _start_daemon(tmp: Path, slab: int, policy: str) -> tuple[subprocess.Popen, str]:
    tmp = tmp / policy
    tmp.mkdir(exist_ok=True)
    cfg = tmp / "node.toml"
    cfg.write_text(
        f'[dram]\ncapacity = "{_dram_capacity(slab) // MiB}MiB"\nslab_size = "{slab // MiB}MiB"\n'
        f'[disk]\nenabled = false\n[eviction]\npolicy = "{policy}"\n'
        f'[server]\nport_file = "{tmp / "ports.json"}"\nmax_frame = "{2 * slab // MiB + 1}MiB"\n'
    )
    (tmp / "ports.json").unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "serve", "--config", str(cfg), "--log-level", "WARNING"],
        cwd=REPO,
    )
    for _ in range(300):
        if (tmp / "ports.json").exists():
            ports = json.loads((tmp / "ports.json").read_text())
            return proc, f"127.0.0.1:{ports['data_port']}"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("daemon did not start")


def main() -> int:
    # SIGTERM runs the cleanup below (daemon, redis-server, raw server) instead of orphaning them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--sizes", default="2MiB,32MiB", help="block sizes (whole MiB), e.g. 2MiB,32MiB")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--repeat", default=3, type=int, help="runs per cell (median reported)")
    ap.add_argument("--bytes-per-client", default=256, type=int, help="MiB moved per client per measurement")
    ap.add_argument(
        "--policies", default="", help="eviction policies, one daemon each (default: the default)"
    )
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis baseline")
    args = ap.parse_args()
    from kvstore.config import EvictionSection, parse_size  # the project's one size parser (its unit table)

    policies = args.policies.split(",") if args.policies else [EvictionSection().policy]

    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    clients_list = [int(c) for c in args.clients.split(",")]
    redis_bin = None if args.no_redis else shutil.which("redis-server")
    rows = []
    load_before = os.getloadavg()  # on a shared host the ratios are what count; the load says how shared
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        redis_proc = None
        if redis_bin:
            rport = _free_port()
            redis_proc = subprocess.Popen(
                [redis_bin, "--port", str(rport), "--save", "", "--appendonly", "no", "--maxmemory", "0"],
                stdout=subprocess.DEVNULL,
            )
            time.sleep(0.5)
        try:
            for size in sizes:
                ctx = mp.get_context("spawn")
                q = ctx.Queue()
                raw_srv = ctx.Process(target=_raw_server, args=(q, size), daemon=True)
                raw_srv.start()
                raw_port = q.get(timeout=30)
                daemons = {p: _start_daemon(tmp, max(size, 2 * MiB), p) for p in policies}
                try:
                    for i, (_, addr) in enumerate(daemons.values()):
                        warm_redis = rport if redis_proc and i == 0 else None
                        _warm(addr, warm_redis, size, _dram_capacity(max(size, 2 * MiB)))
                    for clients in clients_list:
                        ops = max(4, args.bytes_per_client * MiB // size)
                        for op in ("put", "get"):
                            row = {
                                "size_mib": size // MiB,
                                "clients": clients,
                                "op": op,
                                "ops_per_client": ops,
                            }
                            n = range(clients)
                            runs: dict[str, list[float]] = {"raw": [], "redis": []}
                            runs.update({f"tierkv:{p}": [] for p in policies})
                            for rep in range(args.repeat):  # interleaved, so load drift hits all of them
                                raw_args = [(raw_port, size, ops, op) for _ in n]
                                runs["raw"].append(_measure(_raw_client, raw_args, size, ops))
                                # each run in another order: the first after the raw socket is slower
                                turn = rep % len(policies)
                                for p in policies[turn:] + policies[:turn]:
                                    addr = daemons[p][1]
                                    kv_args = [(addr, size, ops, op, 1000 * clients + i) for i in n]
                                    runs[f"tierkv:{p}"].append(_measure(_tierkv_client, kv_args, size, ops))
                                if redis_proc:
                                    rargs = [(rport, size, ops, op, i) for i in n]
                                    runs["redis"].append(_measure(_redis_client, rargs, size, ops))
                                    import redis

                                    redis.Redis(port=rport).flushall()
                            for name, vals in runs.items():
                                if name.startswith("tierkv:"):
                                    row.setdefault("policy_gbps", {})[name[7:]] = statistics.median(vals)
                                    row.setdefault("policy_runs", {})[name[7:]] = vals
                                    continue
                                row[f"{name}_gbps"] = statistics.median(vals) if vals else None
                                row[f"{name}_runs"] = vals
                            row["policy"] = policies[0]
                            row["tierkv_gbps"] = row["policy_gbps"][policies[0]]
                            row["tierkv_runs"] = row["policy_runs"][policies[0]]
                            if redis_proc:
                                import redis

                                redis.Redis(port=rport).flushall()
                            rows.append(row)
                            print(_fmt(row), flush=True)
                finally:
                    for daemon, _ in daemons.values():
                        daemon.terminate()
                        daemon.wait(30)
                    raw_srv.kill()
        finally:
            if redis_proc:
                redis_proc.terminate()
                redis_proc.wait(10)
    load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
    doc = {"host_cpus": os.cpu_count(), "python": sys.version.split()[0], "load_avg": load, "rows": rows}
    print()
    print(table(rows))
    print(f"load average (1, 5, 15 min): before {load['before']}, after {load['after']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


def _fmt(r: dict) -> str:
    red = f"{r['redis_gbps']:.2f}" if r["redis_gbps"] is not None else "n/a"
    pols = "".join(f"  {p} {g:.2f}" for p, g in r["policy_gbps"].items())
    return f"{r['op']:>3} {r['size_mib']:>2} MiB x{r['clients']}: raw {r['raw_gbps']:.2f}{pols}  redis {red} GB/s"


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.1f}x" if b else "n/a"


def table(rows: list[dict]) -> str:
    others = [p for p in rows[0]["policy_gbps"] if p != rows[0]["policy"]] if rows else []
    out = [
        f"| op | block | clients | raw socket GB/s | tierkv ({rows[0]['policy'] if rows else ''}) GB/s | "
        + "".join(f"{p} GB/s | {p} / first | " for p in others)
        + "Redis GB/s | tierkv / raw | tierkv / Redis |",
        "|---|---|---|---|---|" + "---|---|" * len(others) + "---|---|---|",
    ]
    for r in rows:
        red = r["redis_gbps"]
        pg = r["policy_gbps"]
        out.append(
            f"| {r['op'].upper()} | {r['size_mib']} MiB | {r['clients']} | {r['raw_gbps']:.2f} | {r['tierkv_gbps']:.2f} | "
            + "".join(f"{pg[p]:.2f} | {pg[p] / r['tierkv_gbps']:.3f}x | " for p in others)
            + f"{f'{red:.2f}' if red else 'n/a'} | {r['tierkv_gbps'] / r['raw_gbps']:.2f}x | "
            f"{_ratio(r['tierkv_gbps'], red)} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
