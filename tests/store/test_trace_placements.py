"""bench/trace.py averages a simulated three-node cell over several draws of the node
addresses: rendezvous placement hashes each key with each node's address, so the addresses
decide which blocks share a node, and one draw of them is one sample of the cluster
(docs/benchmarks.md "Hit rate on real traffic"). Block counts only, a slice of the trace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from trace_sim import load_trace, node_ids, simulate  # noqa: E402

# bench/trace.py by its path: "trace" is also a module of the standard library
_spec = importlib.util.spec_from_file_location("bench_trace", BENCH / "trace.py")
trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace)


def test_placement_zero_is_the_addresses_of_the_earlier_runs_and_the_others_differ():
    assert node_ids(3) == node_ids(3, 0) == ["127.0.0.1:20000", "127.0.0.1:20001", "127.0.0.1:20002"]
    draws = [set(node_ids(3, p)) for p in range(5)]
    assert all(a.isdisjoint(b) for i, a in enumerate(draws) for b in draws[i + 1 :])


def test_a_three_node_cell_is_the_mean_of_its_placements():
    row = trace._sim_cell(("synthetic", 400, 3, "dram", 300, "lru", 10, 3))
    draws = row["placement_hit_token_ratios"]
    assert len(draws) == 3
    assert len(set(draws)) > 1  # the draws place the keys differently
    assert row["hit_token_ratio"] == round(sum(draws) / 3, 5)
    reqs = load_trace("synthetic", 400)
    second = simulate(reqs, 3, 300, "dram", "lru", ids=node_ids(3, 1), orphan_every=10)
    assert draws[1] == round(second.hit_token_ratio, 5)


def test_one_node_and_unlimited_cells_run_once():
    one = trace._sim_cell(("synthetic", 200, 1, "dram", 300, "lru", 0, 3))
    unlimited = trace._sim_cell(("synthetic", 200, 3, "dram", None, "lru", 10, 3))
    assert "placement_hit_token_ratios" not in one
    assert "placement_hit_token_ratios" not in unlimited
