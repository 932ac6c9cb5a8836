"""vLLM with tierkv (connector.vllm.TierkvConnector), end to end: real vLLM engines in child
processes, a real daemon, SmolLM2-135M in float32 (where vLLM's greedy tokens depend only on
the KV, so a hit must give a cold run's tokens exactly).

One daemon (with auth; its disk the only tier, so every read after a restart comes from disk)
and one set of engines for the module, in file order (an engine start costs ~30-50 s here):
- a reference engine without any connector runs every prompt (beside the prefill engine);
- the bundled engine (kvengine, 32-token blocks like vLLM's here) saves PX on the daemon;
- a prefill engine (``kv_producer``) saves P1 and PY; then a fresh decode engine
  (``kv_consumer``) runs P1, PX, PY and PC: P1 and PY load from the daemon, PX (the bundled
  engine's) and PC (nobody's) do not, and it saves nothing;
- an engine with a wrong token runs P1: misses, and one line saying why;
- the daemon is stopped, a block of P1 corrupted in its LMDB file, the daemon restarted, and an
  engine runs P1: the blocks before the corrupt one load, it and the rest are recomputed;
- last, an engine behind a slow link loads PY while the daemon is killed mid-load.
Each test reads the engines' counters (``stats_path``) to prove its path was taken."""

from __future__ import annotations

import asyncio
import random

import lmdb
import pytest
from daemonutil import launch_daemon
from polling import until
from scraping import scrape

from kvstore.block import BlockHeader
from kvstore.keys import tokens_le_bytes
from tests.connector.slowlink import SlowLink
from tests.vllm import vllmutil

pytestmark = pytest.mark.timeout(900)  # the module's engines start in the first test's fixtures

BS = 32  # vLLM's CPU attention takes multiples of 32 tokens per block


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


P1 = _prompt(5 * BS + 10, 1)  # 5 full blocks; the tail is computed
PX = _prompt(4 * BS + 7, 2)  # saved by the bundled engine only
PY = _prompt(4 * BS + 12, 3)  # saved by vLLM's producer
PC = _prompt(3 * BS + 5, 4)  # run only by the consumer: never saved
PROMPTS = {"P1": P1, "PX": PX, "PY": PY, "PC": PC}
AUTH = {"token": "right-token", "tenant": "tenant-a"}
AUTH_QUERY = "token=right-token&tenant=tenant-a"
AUTH_SAID = "tierkv: the store refused this vLLM's token"


class Node:
    """The module's daemon; ``restart`` brings it back on its data (on new ports)."""

    def __init__(self, wd) -> None:
        (wd / "tokens").write_text("right-token tenant-a\noperator-token *\n")
        self.wd = wd
        self.sections = {
            "auth": {"token_file": str(wd / "tokens")},
            "dram": {"capacity": 0},
            "disk": {"sync": True},
        }
        self.daemon = launch_daemon(wd, **self.sections)

    def counter(self, name: str) -> float:
        """A counter of the daemon's admin /metrics (the operator's token)."""
        return scrape(self.daemon.admin, "operator-token").total(name)

    def restart(self, between=lambda: None) -> None:
        """Stop the daemon, run ``between`` (on its stopped data), start it again."""
        assert self.daemon.stop() == 0
        between()
        self.daemon = launch_daemon(self.wd, **self.sections)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("vllm-node"))
    yield n
    n.daemon.stop(10)


@pytest.fixture(scope="module")
def bundled_saved(smol_model, node) -> None:
    """The bundled engine has stored PX (blocks of 32 tokens) on the daemon."""
    from connutil import make_engine, run

    async def save() -> None:
        a = make_engine(
            smol_model,
            f"kvstore://{node.daemon.addr}?block_tokens={BS}&policy=always&lookup_deadline_s=5&{AUTH_QUERY}",
        )
        try:
            await run(a, PX)
            flushed = await a.connector.flush()
            assert flushed and flushed.saved == 4, flushed
        finally:
            await a.stop()

    asyncio.run(save())


@pytest.fixture(scope="module")
def pd(vllm_python, smol_model, node, bundled_saved, tmp_path_factory) -> dict:
    """The reference engine's, the prefill engine's and then the decode engine's results (and
    the daemon's bytes in before and after the decode engine ran). The reference engine runs
    beside the prefill engine (neither reads what the other does)."""
    wd = tmp_path_factory.mktemp("pd")
    url = f"kvstore://{node.daemon.addr}"
    ref = vllmutil.start(
        vllm_python, smol_model, list(PROMPTS.values()), None, wd / "ref.log", prefix_caching=False
    )
    try:
        prefill = vllmutil.run(
            vllm_python,
            smol_model,
            [P1, PY],
            vllmutil.kv(url, wd / "p", "kv_producer", policy="always", **AUTH),
            wd / "p.log",
        )
        reference = dict(zip(PROMPTS, vllmutil.wait(ref, wd / "ref.log")["outputs"]))
    finally:
        ref.kill()
    before = node.counter("tierkv_bytes_in_total")
    decode = vllmutil.run(
        vllm_python,
        smol_model,
        [P1, PX, PY, PC],
        vllmutil.kv(url, wd / "d", "kv_consumer", policy="always", **AUTH),
        wd / "d.log",
    )
    after = node.counter("tierkv_bytes_in_total")
    return {"reference": reference, "prefill": prefill, "decode": decode, "bytes_in": (before, after)}


@pytest.fixture(scope="module")
def reference(pd) -> dict[str, list[int]]:
    """Each prompt's tokens from an engine without a connector and without prefix caching."""
    return pd["reference"]


def test_a_fresh_engine_loads_what_another_saved_with_a_cold_runs_tokens(pd, reference):
    prefill, decode = pd["prefill"], pd["decode"]
    assert prefill["outputs"] == [reference["P1"], reference["PY"]]
    assert prefill["stats"]["worker-tp0"]["saved_blocks"] == 5 + 4
    # the decode engine: a hit of P1's 5 blocks and PY's 4, loaded into vLLM's pages
    assert decode["outputs"] == [reference[k] for k in ("P1", "PX", "PY", "PC")]
    assert decode["cached"] == [5 * BS, 0, 4 * BS, 0]
    w = decode["stats"]["worker-tp0"]
    assert w["loaded_tokens"] == 9 * BS and w["load_blocks"] == 9
    assert w.get("load_error_blocks", 0) == 0
    assert w["hit_tokens.remote:disk"] == 9 * BS
    assert decode["stats"]["scheduler"]["external_tokens"] == 9 * BS


def test_the_producer_only_saves_and_the_consumer_only_loads(pd):
    prefill, decode = pd["prefill"]["stats"], pd["decode"]["stats"]
    assert prefill["scheduler"].get("lookup_requests", 0) == 0  # never asked the store
    assert prefill["worker-tp0"].get("loads", 0) == 0
    assert decode["scheduler"]["lookup_requests"] == 4
    assert decode["worker-tp0"].get("save_blocks_staged", 0) == 0
    assert decode["worker-tp0"].get("saved_blocks", 0) == 0
    before, after = pd["bytes_in"]
    assert after == before, "the consumer wrote to the daemon"


async def test_vllm_and_the_bundled_engine_never_load_each_others_blocks(pd, smol_model, node):
    """Same model, same tokens, same block size, one daemon: the bundled engine's PX is not a
    hit for vLLM, vLLM's PY not for the bundled engine; each engine's own blocks are."""
    from connutil import make_engine, run

    decode = pd["decode"]["stats"]["scheduler"]
    assert decode["held_tokens"] == (5 + 4) * BS  # P1 and PY; PX (the bundled engine's) held nothing
    b = make_engine(
        smol_model,
        f"kvstore://{node.daemon.addr}?block_tokens={BS}&policy=always&lookup_deadline_s=5&{AUTH_QUERY}",
        enable_prefix_cache=False,
    )
    try:
        _, cached_py = await run(b, PY)
        _, cached_px = await run(b, PX)
    finally:
        await b.stop()
    assert cached_py == 0
    assert cached_px == 4 * BS


def test_a_wrong_token_serves_misses_and_says_why_once(vllm_python, smol_model, node, reference, tmp_path):
    spec = vllmutil.kv(
        f"kvstore://{node.daemon.addr}", tmp_path / "w", token="wrong-token", tenant="tenant-a"
    )
    res = vllmutil.run(vllm_python, smol_model, [P1, PY], spec, tmp_path / "w.log", policy="always")
    assert res["outputs"] == [reference["P1"], reference["PY"]]
    assert res["cached"] == [0, 0]
    s = res["stats"]["scheduler"]
    assert s["lookup_requests"] == 2 and s["held_tokens"] == 0
    assert s["store.auth_refused"] >= 1
    assert (tmp_path / "w.log").read_text().count(AUTH_SAID) == 1


def test_a_corrupt_block_on_disk_is_recomputed_with_the_same_tokens(
    vllm_python, smol_model, node, reference, tmp_path
):
    node.restart(lambda: _flip_a_byte_of_block(node.wd / "disk", P1[2 * BS : 3 * BS]))
    spec = vllmutil.kv(
        f"kvstore://{node.daemon.addr}", tmp_path / "r", "kv_consumer", policy="always", **AUTH
    )
    res = vllmutil.run(vllm_python, smol_model, [P1], spec, tmp_path / "r.log")
    assert res["outputs"] == [reference["P1"]]
    w = res["stats"]["worker-tp0"]
    assert w["loaded_tokens"] == 2 * BS  # blocks 0 and 1; block 2 and the rest recomputed
    assert w["load_error_blocks"] == 3
    assert w.get("recompute_fallbacks.corrupt", 0) + w.get("recompute_fallbacks.miss", 0) >= 1, w


def _flip_a_byte_of_block(disk, tokens: list[int]) -> None:
    """Flip one payload byte of the stored block holding ``tokens`` (the daemon stopped)."""
    want = tokens_le_bytes(tokens)
    env = lmdb.open(str(disk), max_dbs=2, map_size=1 << 30)  # at least the daemon's: a put needs room
    try:
        hdr, data = env.open_db(b"hdr"), env.open_db(b"data")
        with env.begin(write=True) as txn:
            keys = [k for k, v in txn.cursor(db=hdr) if BlockHeader.decode(v).token_bytes == want]
            assert len(keys) == 1, f"{len(keys)} stored blocks hold these tokens"
            payload = bytearray(txn.get(keys[0], db=data))
            payload[len(payload) // 2] ^= 0xFF
            txn.put(keys[0], bytes(payload), db=data)
    finally:
        env.close()


def test_a_daemon_killed_mid_load_ends_in_recompute_with_the_same_tokens(
    vllm_python, smol_model, node, reference, tmp_path
):
    """Last in the module: it kills the module's daemon. One block per read, behind a link
        of 0.5 s: the daemon is killed once it sent the first block of PY's load (the next read
    comes a link delay later)."""
    daemon = node.daemon
    link = SlowLink(daemon.addr, delay_s=0.5)
    sent = node.counter("tierkv_bytes_out_total")  # counted once a reply's bytes have left
    spec = vllmutil.kv(
        f"kvstore://{link.addr}", tmp_path / "c", "kv_consumer", policy="always", load_batch_blocks=1, **AUTH
    )
    proc = vllmutil.start(vllm_python, smol_model, [PY], spec, tmp_path / "c.log")
    try:
        until(
            lambda: proc.poll() is not None or node.counter("tierkv_bytes_out_total") > sent,
            400,
            "the daemon to have sent the load's first block",
        )
        daemon.kill9()
        res = vllmutil.wait(proc, tmp_path / "c.log")
    finally:
        proc.kill()
        link.close()
    assert res["outputs"] == [reference["PY"]]
    w = res["stats"]["worker-tp0"]
    assert 0 < w["loaded_tokens"] < 4 * BS, f"the kill did not land mid-load: {w}"
    assert w["load_error_blocks"] == 4 - w["loaded_tokens"] // BS
