"""Time to first token inside vLLM, each figure beside its peers, in one run (issue 32).

Per prompt length (1K and 4K tokens, capped to the model's context) and dtype, every cell a
fresh vLLM process (bench/vllm_child.py under .venv-vllm: ``make vllm-venv``) running the
same prompts greedily:

- ``cold``: no cache (first sight of the prompt); ``prefix_cache``: vLLM's own prefix cache,
  the same prompt again in the same process.
- ``example``: vLLM's ExampleConnector (safetensors files per layer), a fresh process loading
  what another process saved.
- ``tierkv_dram``: the TierkvConnector (connector/vllm.py) on one ``kvstore serve`` daemon
  (tests/daemonutil.py), a fresh process loading what another saved; ``tierkv_disk``: the
  same after the daemon restarted (its DRAM empty, the blocks on its disk).
- ``mooncake``: vLLM's MooncakeStoreConnector over mooncake-transfer-engine-non-cuda
  (bench/vllm_mooncake.py, its own venv; skipped with the reason where it cannot run).

Every hit's greedy tokens are compared with the cold run's (float32: any difference is a
mismatch) and with the same configuration's recompute (the saving process; bf16 agreement is
reported, never hidden). Ratios and targets in ``summary``. The load average is printed and
stored beside each cell: teammates' runs share the host.

    .venv-vllm/bin/python bench/vllm_ttft.py --json docs/results/vllm_ttft.json
    .venv/bin/python bench/vllm_ttft.py --plot docs/results/vllm_ttft.json --png docs/vllm_ttft.png
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "tests"))  # tests/daemonutil.py imports its neighbours by name

from vllm_bench import CONNECTOR, load_avg, model_dir, run_child, tierkv_daemon  # noqa: E402

LENGTHS = (1000, 4000)
MAX_TOKENS = 16


def make_prompts(
    model: str, lengths: tuple[int, ...], reps: int, limit: int
) -> tuple[list[dict], list[list[int]]]:
    """``reps`` distinct prompts per length (their first block differs, so no two share a key),
    capped to ``limit`` tokens; and an unrelated warm-up prompt of each length."""
    from tokenizers import Tokenizer

    from connector.demo import long_document

    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    text = long_document(max(lengths) * 2)
    prompts = []
    for n in lengths:
        for r in range(reps):
            ids = tok.encode(f"Report {n}-{r}. " + text).ids[: min(n, limit)]
            prompts.append({"length": n, "rep": r, "ids": ids})
    warm = [tok.encode(f"Warm-up {n}. " + text[::-1]).ids[: min(n, limit)] for n in lengths]
    return prompts, warm


def cell(name: str, py: str, spec: dict, work: Path, kv=None, env=None) -> dict:
    print(f"  {name} ({spec['dtype']}) load {load_avg()}", flush=True)
    out = run_child(py, {**spec, "kv_transfer": kv}, work / f"{name}-{spec['dtype']}", env)
    out["load_avg"] = load_avg()
    return out


def run_dtype(dtype: str, spec: dict, work: Path, skip_mooncake: bool, skip_example: bool) -> dict:
    from vllm_mooncake import mooncake_cells

    spec = {**spec, "dtype": dtype}
    n = len(spec["prompts"])
    seq = list(range(n))
    py = sys.executable
    out: dict = {}
    # a loading process runs each prompt twice: the load, then vLLM's prefix cache on what it
    # loaded -- the in-process floor measured beside the load, in the same process and minute
    twice = {**spec, "runs": [i for i in seq for _ in (0, 1)]}
    out["cold"] = cell("cold", py, twice, work)
    ex = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(work / f"example-{dtype}")},
    }
    s = {**spec, "runs": seq}
    if skip_example:
        out["example_skipped"] = "--no-example"
    else:
        out["example_save"] = cell("example_save", py, s, work, ex)
        out["example"] = cell("example", py, twice, work, ex)
    if skip_mooncake:
        out["mooncake_skipped"] = "--no-mooncake"
    else:
        out.update(mooncake_cells(twice, work / f"mooncake-{dtype}"))
    if importlib.util.find_spec("connector.vllm") is None:
        out["tierkv_skipped"] = "connector/vllm.py is not there"
        return out
    with tierkv_daemon(work / f"daemon-{dtype}") as daemon:
        kv = {
            **CONNECTOR,
            "kv_connector_extra_config": {"url": f"kvstore://{daemon.addr}", "policy": "always"},
        }
        out["tierkv_save"] = cell("tierkv_save", py, s, work, kv)
        out["tierkv_dram"] = cell("tierkv_dram", py, twice, work, kv)
        daemon.restart()
        kv = {
            **CONNECTOR,
            "kv_connector_extra_config": {"url": f"kvstore://{daemon.addr}", "policy": "always"},
        }
        out["tierkv_disk"] = cell("tierkv_disk", py, twice, work, kv)
    return out


# cell -> (the runs that are its hits, the cell whose tokens are the same configuration's recompute)
HITS = {
    "prefix_cache": ("cold", 1, "cold"),
    "example": ("example", 0, "example_save"),
    "tierkv_dram": ("tierkv_dram", 0, "tierkv_save"),
    "tierkv_disk": ("tierkv_disk", 0, "tierkv_save"),
    "mooncake": ("mooncake", 0, "mooncake_save"),
}


def rows_of(dtype: str, cells: dict, prompts: list[dict]) -> list[dict]:
    """One row per (cell, length): median TTFT, hit tokens, tokens against cold and against
    the same configuration's recompute."""
    n = len(prompts)
    cold_runs = cells["cold"]["runs"][0::2]
    rows = []

    def runs_of(src: str, at: int) -> list[dict]:
        r = cells[src]["runs"]
        return r[at::2] if len(r) == 2 * n else r  # each prompt twice: the first, or the second

    names = [("cold", ("cold", 0, None))] + [(k, v) for k, v in HITS.items() if v[0] in cells]
    names += [(k, (k, 0, None)) for k in ("example_save", "tierkv_save", "mooncake_save") if k in cells]
    for name, (src, at, recompute) in names:
        runs = runs_of(src, at)
        ref = runs_of(recompute, 0) if recompute else None
        for length in sorted({p["length"] for p in prompts}):
            idx = [i for i in range(n) if prompts[i]["length"] == length]
            paired = src != "cold" and len(cells[src]["runs"]) == 2 * n
            after = runs_of(src, 1) if paired else None
            rows.append(
                {
                    "cell": name,
                    "dtype": dtype,
                    "length": length,
                    "prompt_tokens": len(prompts[idx[0]]["ids"]),
                    "ttft_s": round(statistics.median(runs[i]["ttft_s"] for i in idx), 4),
                    "ttft_s_each": [runs[i]["ttft_s"] for i in idx],
                    "hit_tokens": [runs[i]["cached_tokens"] for i in idx],
                    "differs_from_cold": sum(runs[i]["tokens"] != cold_runs[i]["tokens"] for i in idx),
                    "differs_from_recompute": (
                        None if ref is None else sum(runs[i]["tokens"] != ref[i]["tokens"] for i in idx)
                    ),
                    "prompts": len(idx),
                    # the same prompt again in the same process: vLLM's prefix cache on the load
                    "prefix_after_ttft_s": (
                        round(statistics.median(after[i]["ttft_s"] for i in idx), 4) if after else None
                    ),
                    "load_avg": cells[src]["load_avg"],
                }
            )
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """The targets, float32: tierkv (DRAM, and disk) against the prefix cache, ExampleConnector
    and cold; mismatches against cold in every cell."""
    at = {(r["cell"], r["dtype"], r["length"]): r for r in rows}
    out = []
    for length in sorted({r["length"] for r in rows}):
        for tier in ("tierkv_dram", "tierkv_disk"):
            t = at.get((tier, "float32", length))
            if t is None:
                continue
            pc, ex, cold = (at.get((c, "float32", length)) for c in ("prefix_cache", "example", "cold"))
            mc = at.get(("mooncake", "float32", length))
            out.append(
                {
                    "length": length,
                    "cell": tier,
                    "vs_prefix_cache": round(t["ttft_s"] / pc["ttft_s"], 2),
                    "vs_prefix_cache_same_process": (
                        round(t["ttft_s"] / t["prefix_after_ttft_s"], 2) if t["prefix_after_ttft_s"] else None
                    ),
                    "target_vs_prefix_cache": 1.3,
                    "vs_example": round(t["ttft_s"] / ex["ttft_s"], 2) if ex else None,
                    "target_vs_example": 0.5,
                    "speedup_vs_cold": round(cold["ttft_s"] / t["ttft_s"], 2),
                    "target_speedup_vs_cold": 5.0 if length >= 4000 else None,
                    "vs_mooncake": round(t["ttft_s"] / mc["ttft_s"], 2) if mc else None,
                }
            )
    mism = sum(r["differs_from_cold"] for r in rows if r["dtype"] == "float32")
    out.append({"float32_mismatches_vs_cold": mism, "target": 0})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", metavar="JSON", help="only draw the figure of a results file (.venv)")
    ap.add_argument("--png", help="the figure's path (default: beside the JSON)")
    ap.add_argument("--reps", type=int, default=3, help="distinct prompts per length, float32 (default 3)")
    ap.add_argument(
        "--bf16-reps", type=int, default=1, help="the same for bfloat16 (default 1: its agreement)"
    )
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--no-mooncake", action="store_true", help="skip the MooncakeStoreConnector cells")
    ap.add_argument("--no-example", action="store_true", help="skip the ExampleConnector cells")
    a = ap.parse_args()
    if a.plot:
        from vllm_plot import plot_ttft

        print(plot_ttft(a.plot, a.png))
        return 0
    model = model_dir()
    lengths = tuple(int(x) for x in a.lengths.split(","))
    limit = 8192 - MAX_TOKENS - 1  # SmolLM2-135M's context
    prompts, warm = make_prompts(model, lengths, max(a.reps, a.bf16_reps), limit)
    spec = {"model": model, "warmup": warm, "max_tokens": MAX_TOKENS}
    t0 = time.time()
    result: dict = {"started_load_avg": load_avg(), "cpus": os.cpu_count(), "rows": [], "skipped": {}}
    print(f"vllm_ttft: {len(prompts)} prompts, load average {load_avg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as tmp:
        for dtype in a.dtypes.split(","):
            reps = a.reps if dtype == "float32" else a.bf16_reps
            mine = [p for p in prompts if p["rep"] < reps]
            spec_d = {**spec, "prompts": [p["ids"] for p in mine]}
            cells = run_dtype(dtype, spec_d, Path(tmp), a.no_mooncake, a.no_example)
            for peer in ("example", "mooncake", "tierkv"):
                if f"{peer}_skipped" in cells:
                    result["skipped"][f"{peer}/{dtype}"] = cells.pop(f"{peer}_skipped")
            result.setdefault("engine_start_s", {})[dtype] = {
                k: v["engine_start_s"] for k, v in cells.items()
            }
            result["rows"] += rows_of(dtype, cells, mine)
            result["summary"] = summarize(result["rows"])
            result["seconds"] = round(time.time() - t0)
            result["ended_load_avg"] = load_avg()
            if a.json:  # after each dtype: a run cut short keeps what it measured
                Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    for r in result["rows"]:
        print(
            f"{r['cell']:>13} {r['dtype']:>8} {r['length']:>5}: ttft {r['ttft_s']:.3f} s  hits {r['hit_tokens']}"
            f"  !=cold {r['differs_from_cold']}  !=recompute {r['differs_from_recompute']}"
        )
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
