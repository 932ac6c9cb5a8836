"""bench/trace.py's daemon cells: the same requests replayed on real ``kvstore serve``
daemons (one, or a static cluster of three running the orphan pass when asked) through
``kvstore.client``, beside the simulation of the same requests over the same node addresses."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import common
from trace_report import DEFAULT_POLICY, cell_keys
from trace_sim import BLOCK_TOKENS, GET_BATCH, ChainKeys, load_trace, simulate, trace_namespace

from kvstore.block import make_header
from kvstore.client.read import get_into
from kvstore.keys import BlockKey


def _launch(
    wd: Path,
    per_node: int | None,
    tiers: str,
    policy: str,
    payload: int,
    hlen: int,
    port: int,
    peers: list[str],
):
    """One daemon; with ``peers`` (more than one node) a static cluster member whose orphan
    pass runs only when asked (no repair: one copy, every block on its owner)."""
    blocks = per_node if tiers == "dram" else max(per_node // 4, 1)
    dram = {"capacity": max(blocks, 2) * payload, "slab_size": payload}
    sections: dict = {"dram": dram, "eviction": {"policy": policy}, "node": {"lease_ttl_s": 30.0}}
    sections["server"] = {"data_port": port}
    if len(peers) > 1:
        sections["cluster"] = {"peers": peers}
        sections["repair"] = {"enabled": False, "replicas": 1}
        sections["orphans"] = {"interval_s": 1e6, "deadline_s": 120.0}
    if tiers == "dram":
        return common.start_daemon(wd, **sections)
    disk = {"capacity": per_node * (payload + hlen), "sync": False}
    return common.start_daemon(wd, use_disk=True, disk=disk, **sections)


async def _orphan_passes(admins: list[str]) -> int:
    """One orphan pass on each node in turn (node order); the blocks they evicted."""
    import aiohttp

    n = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for admin in admins:
            async with http.post(admin + "/v1/orphans/pass", json={}) as r:
                r.raise_for_status()
                n += (await r.json())["orphans_dropped"]
    return n


async def _replay_daemons(
    reqs, addrs: list[str], admins: list[str], payload: int, speedup: float, every: int
) -> dict:
    from kvstore.client import open as open_store

    ns = trace_namespace()
    chain = ChainKeys(ns)
    # long deadlines, no outlier ejection: on a loaded host a node past the default ones is
    # marked down or ejected, and the replay would measure that rather than eviction
    store = open_store(
        "kvstore://" + ",".join(addrs),
        replicas=1,
        lookahead=0,
        namespaces=(ns,),
        op_timeout_s=120.0,
        write_floor_s=120.0,
        probe_deadline_s=30.0,
        outlier_factor=1e9,
    )
    body = bytes(payload)
    parent_of: dict[bytes, bytes] = {}
    out = {"input_tokens": 0, "hit_tokens": 0, "hits": {"dram": 0, "disk": 0}, "get_miss": 0, "evicted": 0}
    bufs = [bytearray(payload) for _ in range(GET_BATCH)]  # one GET per part, as simulated
    t_start, ts0 = time.monotonic(), reqs[0].timestamp_ms if reqs else 0
    try:
        for n, req in enumerate(reqs):
            if speedup:
                wait = (req.timestamp_ms - ts0) / 1000 / speedup - (time.monotonic() - t_start)
                if wait > 0:
                    await asyncio.sleep(wait)
            raws = chain.keys(req.hash_ids)
            keys = [BlockKey(k) for k in raws]
            out["input_tokens"] += req.input_tokens
            tiers = (await store.lookup(keys)).names() if keys else []
            hit = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
            got = 0
            for start in range(0, hit, len(bufs)):
                part = keys[start : min(hit, start + len(bufs))]
                res = await get_into(store, part, bufs[: len(part)])
                ok = next((i for i, r in enumerate(res) if not r.status.ok), len(res))
                got += ok
                if ok < len(res):
                    out["get_miss"] += 1
                    break
            for t in tiers[:got]:
                out["hits"][t if t == "disk" else "dram"] += 1
            out["hit_tokens"] += got * BLOCK_TOKENS
            parents = [ns.id.raw, *raws[:-1]]
            blocks = []
            for i in range(got, len(keys)):
                parent_of[raws[i]] = parents[i]
                h = make_header(
                    key=keys[i],
                    parent=BlockKey(parents[i]),
                    namespace=ns.id,
                    tokens=[req.hash_ids[i]],
                    dtype="uint8",
                    shape=[payload],
                    payload=body,
                    created=0.0,
                )
                blocks.append((h, body))
            if blocks:
                await store.put(blocks)
            if every and len(addrs) > 1 and (n + 1) % every == 0:
                out["evicted"] += await _orphan_passes(admins)
        stored: set[bytes] = set()
        known = list(parent_of)
        for start in range(0, len(known), 2048):
            part = known[start : start + 2048]
            for k, t in zip(part, (await store.lookup([BlockKey(k) for k in part])).names()):
                if t is not None:
                    stored.add(k)
        out["orphans"] = sum(1 for k in stored if parent_of[k] != ns.id.raw and parent_of[k] not in stored)
        out["stored"] = len(stored)
        out["stats"] = await store.stats()
    finally:
        await store.close()
    return out


def daemon_cell(
    trace: str,
    n_req: int,
    nodes: int,
    tiers: str,
    cap: int,
    policy: str,
    payload: int,
    speedup: float,
    every: int,
):
    """Replay on ``nodes`` real daemons; the simulation of the same requests over the same
    node addresses beside it."""
    reqs = load_trace(trace, n_req)
    ns = trace_namespace()
    sample = make_header(
        key=ns.id, parent=ns.id, namespace=ns.id, tokens=[0], dtype="uint8",
        shape=[payload], payload=bytes(payload), created=0.0,
    )  # fmt: skip
    # every header of the replay has this length (one token of fixed width, the same payload
    # and so the same checksum): the disk holds exactly its share of blocks, as simulated. A
    # slack of 8 bytes a block once gave a disk of 3,005 blocks for 3,000, and this cell's
    # probation share tips over with the capacity (docs/benchmarks.md, "What ran where")
    hlen = len(sample.encode())
    wd = Path(tempfile.mkdtemp(prefix="tierkv-trace-"))
    daemons = []
    try:
        ports = [common.free_port() for _ in range(nodes)]
        peers = [f"127.0.0.1:{p}" for p in ports]
        for i in range(nodes):
            daemons.append(_launch(wd / f"n{i}", cap // nodes, tiers, policy, payload, hlen, ports[i], peers))
        addrs = [d.addr for d in daemons]
        t0 = time.perf_counter()
        got = asyncio.run(_replay_daemons(reqs, addrs, [d.admin for d in daemons], payload, speedup, every))
        secs = time.perf_counter() - t0
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(wd, ignore_errors=True)
    sim = simulate(reqs, nodes, cap, tiers, policy, ids=addrs, sample_every=0, orphan_every=every)
    hits = got["hits"]["dram"] + got["hits"]["disk"]
    ratio = got["hit_tokens"] / got["input_tokens"]
    return {
        **cell_keys(trace, nodes, tiers, cap, policy),
        "hit_token_ratio": round(ratio, 5),
        "orphan_bytes_ratio": round(got["orphans"] / cap, 5),
        "disk_hit_share": round(got["hits"]["disk"] / hits, 4) if hits else 0.0,
        "orphan_pass_every": every if nodes > 1 else 0,
        "orphans_evicted": got["evicted"],
        "requests": len(reqs),
        "source": "daemons",
        "simulated_hit_token_ratio": round(sim.hit_token_ratio, 5),
        "simulated_orphans_evicted": sim.orphans_evicted,
        "delta_pp": round(100 * (ratio - sim.hit_token_ratio), 3),
        "get_misses": got["get_miss"],
        "seconds": round(secs, 1),
    }


DAEMON_CELLS = [  # (nodes, tiers, capacity, policy): the default against LRU where it matters
    (1, "dram", 3000, "lru"),
    (1, "dram", 3000, DEFAULT_POLICY),
    (3, "dram", 3000, "lru"),
    (3, "dram", 3000, DEFAULT_POLICY),
    (1, "dram+disk", 3000, DEFAULT_POLICY),
    (3, "dram+disk", 3000, DEFAULT_POLICY),
]
