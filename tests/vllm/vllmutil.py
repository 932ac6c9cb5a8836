"""Running vLLM engines (tests/vllm/vllm_child.py) and reading what they did."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("vllm_child.py")
ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    env.update(ENV)
    env["PYTHONPATH"] = str(REPO)
    return env


def kv(url: str, stats: Path, role: str = "kv_both", **options) -> dict:
    """A connector spec: ``url``, counters under ``stats`` (made here), ``options``."""
    stats.mkdir(parents=True, exist_ok=True)
    return {"role": role, "extra": {"url": url, "stats_path": str(stats), "lookup_deadline_s": 5, **options}}


def start(python: str, model: str, prompts: list[list[int]], kv_spec: dict | None, log: Path, **spec):
    """A child engine started (not waited for): ``wait`` reads its result."""
    body = {"model": model, "prompts": prompts, "kv": kv_spec, **spec}
    with open(log, "w") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(
            [python, str(CHILD), json.dumps(body)],
            cwd=REPO,
            env=child_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait(proc: subprocess.Popen, log: Path, timeout_s: float = 400) -> dict:
    """The child's result; AssertionError with its log's tail when it failed."""
    rc = proc.wait(timeout_s)
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and lines, f"vLLM child failed ({rc}):\n{text[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def run(python: str, model: str, prompts: list[list[int]], kv_spec: dict | None, log: Path, **spec) -> dict:
    return wait(start(python, model, prompts, kv_spec, log, **spec), log)
