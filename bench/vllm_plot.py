"""The figures of bench/vllm_ttft.py and bench/vllm_replay.py's results (run with .venv's
Python, which has matplotlib; the benchmarks themselves run in .venv-vllm)."""

from __future__ import annotations

import json
from pathlib import Path

CELLS = ["cold", "prefix_cache", "example", "mooncake", "tierkv_dram", "tierkv_disk"]
LABELS = {
    "cold": "cold",
    "prefix_cache": "vLLM prefix cache\n(same process)",
    "example": "ExampleConnector\n(fresh process)",
    "mooncake": "MooncakeStore\n(fresh process)",
    "tierkv_dram": "tierkv DRAM\n(fresh process)",
    "tierkv_disk": "tierkv disk\n(daemon restarted)",
}


def plot_ttft(results: str, png: str | None = None, dtype: str = "float32") -> str:
    """A bar per cell and prompt length (log scale) into ``png`` (default: beside the JSON);
    its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(results).read_text())
    rows = {(r["cell"], r["length"]): r for r in data["rows"] if r["dtype"] == dtype}
    lengths = sorted({length for _, length in rows})
    cells = [c for c in CELLS if any((c, n) in rows for n in lengths)]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(lengths)
    for k, n in enumerate(lengths):
        xs = [i + k * width for i, c in enumerate(cells) if (c, n) in rows]
        ys = [rows[(c, n)]["ttft_s"] for c in cells if (c, n) in rows]
        bars = ax.bar(xs, ys, width, label=f"{rows[(cells[0], n)]['prompt_tokens']} tokens")
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7)
    ax.set_xticks([i + width * (len(lengths) - 1) / 2 for i in range(len(cells))])
    ax.set_xticklabels([LABELS[c] for c in cells], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s, median)")
    load = data.get("started_load_avg")
    ax.set_title(f"SmolLM2-135M in vLLM 0.32 (CPU, {dtype}); load average at start {load}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    out = png or str(Path(results).with_suffix(".png"))
    fig.savefig(out, dpi=110)
    return out
