"""Per-layer-group timing of prefill steps (issue 11): with the switch on, a request served
from a real ``local://`` store (in-process node, real LMDB) has, in the engine's timeline, one
entry per layer group its load was cut into, with non-negative load-wait and compute times
that sum to at most the step's wall time, and the groups appear on /metrics; with it off
nothing is recorded. Tiny random model, CPU (and CUDA where there is one)."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest
from scraping import Scrape

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.kv_transfer import KVTransfer, layer_groups
from engine.sequence import SamplingParams
from engine.server import Metrics
from tests.engine.interpret import HAS_CUDA

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
    ),
]


async def _run(aeng: AsyncEngine, prompt: list[int], rid: str) -> int:
    cached = -1
    async for out in aeng.generate(prompt, GREEDY, rid):
        cached = out.cached_tokens
    return cached


async def _cold_then_hit(d: str, tmp_path, device: str, timeline_layers: bool) -> tuple[AsyncEngine, float]:
    """One engine without its own prefix cache: a cold request saves 9 blocks of 16 into the
    store, then the same prompt loads them in 2 layer groups and prefills its 6-token tail.
    Returns the (stopped) engine and the compute phase's seconds during the hit request."""
    url = f"local://{tmp_path}/store?lookup_deadline_s=5&policy=always&block_tokens=16&layer_groups=2"
    cfg = EngineConfig(num_pages=64, enable_prefix_cache=False, device=device)
    aeng = AsyncEngine.from_model(d, cfg, url, timeline_layers=timeline_layers)
    prompt = torch.randint(6, 250, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    try:
        await aeng.start()
        assert aeng.engine.timeline.layer_steps() == [], "the warm-up's steps are no request's"
        assert await _run(aeng, prompt, "cold") == 0
        assert await aeng.connector.flush()
        before = aeng.engine.timeline.total("compute")
        assert await _run(aeng, prompt, "hit") == 144
        compute_s = aeng.engine.timeline.total("compute") - before
        aeng.check_integrity()
    finally:
        await aeng.stop()
    return aeng, compute_s


@pytest.mark.parametrize("device", DEVICES)
async def test_layer_timeline_of_a_hit_has_one_entry_per_group(tiny_model_dir, tmp_path, device):
    aeng, compute_s = await _cold_then_hit(tiny_model_dir("llama-tiny"), tmp_path, device, True)
    tl = aeng.engine.timeline
    steps = tl.layer_steps("hit")
    assert len(steps) == 1, steps  # the tail's one prefill step; decode steps are not timed
    step = steps[0]
    assert step.request_ids == ("hit",) and step.tokens == 6
    assert [(g.first, g.stop) for g in step.groups] == [(0, 1), (1, 2)]  # the load's groups
    assert all(g.load_wait_s >= 0 and g.compute_s > 0 for g in step.groups), step
    assert sum(g.load_wait_s + g.compute_s for g in step.groups) <= step.wall_s
    if device == "cpu":  # host time: the forward lies inside the step's compute phase
        assert step.wall_s <= compute_s
    # cold prefills are timed too: before any load, in one group of every layer
    cold = tl.layer_steps("cold")
    assert cold and all([(g.first, g.stop) for g in s.groups] == [(0, 2)] for s in cold)
    assert len(tl.layer_steps()) == len(cold) + 1
    m = Scrape(generate_latest(Metrics(aeng).registry).decode())
    for kind in ("load_wait", "compute"):
        counts = [m.value("tierkv_engine_layer_group_seconds_count", 0, group=i, kind=kind) for i in range(3)]
        assert counts == [len(cold) + 1, 1, 0], kind


async def test_layer_timeline_off_records_nothing(tiny_model_dir, tmp_path):
    aeng, _ = await _cold_then_hit(tiny_model_dir("llama-tiny"), tmp_path, "cpu", False)
    tl = aeng.engine.timeline
    assert aeng.engine.runner.layer_timer is None  # off: no hook in the step at all
    assert tl.layer_steps() == [] and tl.layer_steps("hit") == []
    m = Scrape(generate_latest(Metrics(aeng).registry).decode())
    assert not m.of("tierkv_engine_layer_group_seconds_count")
    assert tl.count("compute") > 0  # the per-step phases still are


def test_step_groups_follow_the_latest_scatter_on_cpu():
    kv = KVCache(8, 6, 4, 2, 8, torch.float32, "cpu")
    t = KVTransfer(kv)
    assert t.step_groups() == [range(0, 8)]  # before any load: one group
    buf = torch.randn(kv.block_shape(2))
    t.scatter([([1, 4], buf)], groups=3)
    assert t.step_groups() == layer_groups(8, 3) == [range(0, 3), range(3, 5), range(5, 8)]
    t.scatter([([1, 4], buf)], groups=20)  # at most one group per layer
    assert t.step_groups() == [range(i, i + 1) for i in range(8)]
