"""The cost model: load when loading is faster than computing, per prefix; follow measurements."""

from __future__ import annotations

from connector.policy import CostModel

MB = 1 << 20


def test_loads_everything_when_the_tier_is_fast():
    m = CostModel(prefill_tokens_per_s=1000)  # 16 ms per 16-token block
    d = m.decide(["dram"] * 10, block_bytes=1 * MB, block_tokens=16)  # ~0.25 ms per block
    assert d.load_blocks == 10 and d.load_s < d.recompute_s


def test_recomputes_when_compute_is_faster_than_the_wire():
    m = CostModel(prefill_tokens_per_s=1e6)  # a fast GPU: 16 us per block
    m.observe_load("remote:dram", 100 * MB, 1.0)  # 100 MB/s link: 10 ms per 1 MB block
    d = m.decide(["remote:dram"] * 10, block_bytes=1 * MB, block_tokens=16)
    assert d.load_blocks == 0


def test_mixed_tiers_load_only_the_profitable_prefix():
    m = CostModel(prefill_tokens_per_s=2000)  # 8 ms per block
    m.observe_load("dram", 4000 * MB, 1.0)
    m.observe_load("disk", 50 * MB, 1.0)  # 20 ms per 1 MB block: slower than computing it
    d = m.decide(["dram"] * 6 + ["disk"] * 6, block_bytes=1 * MB, block_tokens=16)
    assert d.load_blocks == 6


def test_measurements_move_the_estimates():
    m = CostModel(prefill_tokens_per_s=2000)
    m.observe_prefill(10_000, 1.0)
    assert m.prefill_tps == 10_000
    m.observe_prefill(20_000, 1.0)
    assert 10_000 < m.prefill_tps < 20_000
    m.observe_load("disk", 0, 1.0)  # ignored
    assert "disk" not in m.bandwidth
