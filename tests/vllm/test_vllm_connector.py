"""vLLM with tierkv (connector.vllm.TierkvConnector), end to end: real vLLM engines in child
processes, a real daemon, SmolLM2-135M in float32 (where vLLM's greedy tokens depend only on
the KV, so a hit must give a cold run's tokens exactly).

One daemon and one set of engines for the module (an engine start costs ~30 s here):
- a reference engine without any connector runs every prompt;
- the bundled engine (kvengine, 32-token blocks like vLLM's here) saves PX on the daemon;
- a prefill engine (``kv_producer``) saves P1 and PY; then a fresh decode engine
  (``kv_consumer``) runs P1, PX, PY and PC: P1 and PY load from the daemon, PX (the bundled
  engine's) and PC (nobody's) do not, and it saves nothing;
- last, an engine behind a slow link loads P1 while the daemon is killed mid-load.
Each test reads the engines' counters (``stats_path``) to prove its path was taken."""

from __future__ import annotations

import asyncio
import random

import pytest
from daemonutil import launch_daemon
from polling import until
from scraping import scrape

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


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    d = launch_daemon(tmp_path_factory.mktemp("vllm-node"))
    yield d
    d.stop(10)


@pytest.fixture(scope="module")
def reference(vllm_python, smol_model, tmp_path_factory) -> dict[str, list[int]]:
    """Each prompt's tokens from an engine without a connector and without prefix caching."""
    log = tmp_path_factory.mktemp("ref") / "ref.log"
    res = vllmutil.run(vllm_python, smol_model, list(PROMPTS.values()), None, log, prefix_caching=False)
    return dict(zip(PROMPTS, res["outputs"]))


@pytest.fixture(scope="module")
def bundled_saved(smol_model, node) -> None:
    """The bundled engine has stored PX (blocks of 32 tokens) on the daemon."""
    from connutil import make_engine, run

    async def save() -> None:
        a = make_engine(
            smol_model, f"kvstore://{node.addr}?block_tokens={BS}&policy=always&lookup_deadline_s=5"
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
    """The prefill engine's and then the decode engine's results (and the daemon's bytes in
    before and after the decode engine ran)."""
    wd = tmp_path_factory.mktemp("pd")
    url = f"kvstore://{node.addr}"
    prefill = vllmutil.run(
        vllm_python,
        smol_model,
        [P1, PY],
        vllmutil.kv(url, wd / "p", "kv_producer", policy="always"),
        wd / "p.log",
    )
    before = scrape(node.admin).total("tierkv_bytes_in_total")
    decode = vllmutil.run(
        vllm_python,
        smol_model,
        [P1, PX, PY, PC],
        vllmutil.kv(url, wd / "d", "kv_consumer", policy="always"),
        wd / "d.log",
    )
    after = scrape(node.admin).total("tierkv_bytes_in_total")
    return {"prefill": prefill, "decode": decode, "bytes_in": (before, after)}


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
    assert w["hit_tokens.remote:dram"] == 9 * BS
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
        f"kvstore://{node.addr}?block_tokens={BS}&policy=always&lookup_deadline_s=5",
        enable_prefix_cache=False,
    )
    try:
        _, cached_py = await run(b, PY)
        _, cached_px = await run(b, PX)
    finally:
        await b.stop()
    assert cached_py == 0
    assert cached_px == 4 * BS


def test_a_daemon_killed_mid_load_ends_in_recompute_with_the_same_tokens(
    vllm_python, smol_model, node, pd, reference, tmp_path
):
    """Last in the module: it kills the module's daemon. One block per read, behind a link
    of 0.5 s: the daemon is killed once it served the first block of P1's load."""
    link = SlowLink(node.addr, delay_s=0.5)
    served = scrape(node.admin).total("tierkv_hits_total")
    spec = vllmutil.kv(
        f"kvstore://{link.addr}", tmp_path / "c", "kv_consumer", policy="always", load_batch_blocks=1
    )
    proc = vllmutil.start(vllm_python, smol_model, [P1], spec, tmp_path / "c.log")
    try:
        until(
            lambda: proc.poll() is not None or scrape(node.admin).total("tierkv_hits_total") > served,
            400,
            "the daemon to serve the load's first block",
        )
        node.kill9()
        res = vllmutil.wait(proc, tmp_path / "c.log")
    finally:
        proc.kill()
        link.close()
    assert res["outputs"] == [reference["P1"]]
    w = res["stats"]["worker-tp0"]
    assert 0 < w["loaded_tokens"] < 5 * BS, f"the kill did not land mid-load: {w}"
    assert w["load_error_blocks"] == 5 - w["loaded_tokens"] // BS
