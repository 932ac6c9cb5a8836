"""Background passes that yield (issue 34, finding 7), against real daemons: operator requests
for the orphan pass join the one running (ten concurrent requests ran ten passes before); a
request cut off stops the pass it started (one cut at 30 s ran to its end before); and while a
pass over thousands of blocks runs, the node answers the data port between its slices
(measured as slices of the pass between two answers, never as time).

A member (n0) holds children whose parents are not on it, so its pass asks the other member
(n1) about them; stopping n1 (SIGSTOP) once n0's pass holds a connection to it holds the next
pass in that EXISTS for as long as the test needs (``orphans.deadline_s`` 60 s), so what
overlaps what is decided by the test, not by timing."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import urllib.request

import pytest
from polling import until_async
from ports import free_port
from scraping import scrape
from storeutil import make_blocks

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace

NS = Namespace("orphan-requests", "uint8", 4)
CFG = ClientConfig(namespaces=(NS,), op_timeout_s=30.0, connect_timeout_s=5.0)


def _post(admin: str, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(admin + "/v1/orphans/pass", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _post_and_hang_up(admin: str, after_s: float) -> None:
    """POST a pass, wait ``after_s`` for its answer, then close the connection unanswered."""
    host, port = admin.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=after_s)
    try:
        conn.request("POST", "/v1/orphans/pass", body=b"{}")
        with pytest.raises(TimeoutError):
            conn.getresponse()
    finally:
        conn.close()


def _counter(admin: str, name: str) -> float:
    return scrape(admin).value(f"tierkv_orphans_{name}_total")


async def _members(start_daemon, tmp_path, n_chains: int, batch_keys: int = 1024, parents: bool = False):
    """n0 holding block 1 of ``n_chains`` two-block chains, their parents (block 0) on n1 with
    ``parents``, else nowhere (orphans); both members, no repair."""
    ports = [free_port() for _ in range(2)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    member = {
        "cluster": {"peers": addrs},
        "repair": {"enabled": False, "replicas": 1},
        "orphans": {"interval_s": 3600.0, "deadline_s": 60.0, "batch_keys": batch_keys},
    }
    ds = [
        start_daemon(use_disk=False, workdir=tmp_path / f"n{i}", server={"data_port": p}, **member)
        for i, p in enumerate(ports)
    ]
    chains = [make_blocks(2, 16, seed=s, ns=NS) for s in range(n_chains)]
    for addr, blocks in (
        (addrs[0], [c[1] for c in chains]),
        (addrs[1], [c[0] for c in chains] if parents else []),
    ):
        c = NodeClient(addr, CFG)
        for i in range(0, len(blocks), 256):
            part = blocks[i : i + 256]
            assert [r.status.ok for r in await c.put(part)] == [True] * len(part)
        await c.close()
    return ds


async def _held_pass(n0, n1) -> None:
    """A pass that finds every parent on n1 (n0's peer connection to n1 stays open), then n1
    stopped: the next pass waits in its EXISTS until n1 is continued."""
    assert (await asyncio.to_thread(_post, n0.admin))["orphans_found"] == 0
    n1.signal(signal.SIGSTOP)


async def test_concurrent_requests_for_the_orphan_pass_join_the_one_running(start_daemon, tmp_path):
    n0, n1 = await _members(start_daemon, tmp_path, 64, parents=True)
    await _held_pass(n0, n1)
    try:
        posts = [asyncio.get_running_loop().run_in_executor(None, _post, n0.admin) for _ in range(3)]
        await until_async(
            lambda: _counter(n0.admin, "requests_joined"), 60.0, "2 requests joined", ok=lambda j: j >= 2
        )
    finally:
        n1.signal(signal.SIGCONT)
    got = await asyncio.gather(*posts)
    assert got[0] == got[1] == got[2] and got[0]["blocks_checked"] == 64, got
    assert _counter(n0.admin, "passes") == 2  # the first, then one pass for the three requests


async def test_a_request_cut_off_stops_the_pass_it_started(start_daemon, tmp_path):
    n0, n1 = await _members(start_daemon, tmp_path, 64, parents=True)
    await _held_pass(n0, n1)
    try:
        await asyncio.to_thread(_post_and_hang_up, n0.admin, 1.0)  # the client gives up after 1 s
        await until_async(
            lambda: _counter(n0.admin, "passes_cancelled"),
            60.0,
            "the cut pass cancelled",
            ok=lambda n: n == 1,
        )
    finally:
        n1.signal(signal.SIGCONT)
    assert (await asyncio.to_thread(_post, n0.admin))["blocks_checked"] == 64  # a fresh pass
    assert _counter(n0.admin, "passes") == 2  # the first and the fresh: the cut one never ended


async def test_the_data_port_is_answered_between_the_slices_of_a_pass(start_daemon, tmp_path):
    n0, _ = await _members(start_daemon, tmp_path, 4096, batch_keys=16)  # hundreds of slices
    stats = NodeClient(n0.addr, CFG)
    try:

        async def slices_and_passes() -> tuple[float, float]:
            s = await stats.stats(30.0)
            assert s is not None, "the data port did not answer"
            d = s["daemon"]
            return d["tierkv_orphans_slices_total"], d["tierkv_orphans_passes_total"]

        before, _ = await slices_and_passes()
        post = asyncio.get_running_loop().run_in_executor(None, _post, n0.admin)
        seen: list[tuple[float, float]] = []
        while not post.done():
            seen.append(await slices_and_passes())
        done = await post
        after, passes = await slices_and_passes()
    finally:
        await stats.close()
    assert passes == 1 and done["orphans_dropped"] == 4096
    mid = [s for s, p in seen if p == 0 and before < s < after]  # answered while it ran
    # answers between the pass's slices, at several points of it: it never held the loop
    # for the whole pass (a count of slices, whatever the host's speed)
    assert len(set(mid)) >= 2, (before, after, seen[:20])
