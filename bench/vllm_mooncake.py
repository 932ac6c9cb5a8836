"""bench/vllm_ttft.py's MooncakeStoreConnector cells: vLLM's own Mooncake Store connector over
``mooncake-transfer-engine-non-cuda`` (the venv ``make vllm-mooncake``: .venv-vllm plus
Mooncake), a fresh vLLM process loading what another saved.

Inside a private network namespace (``unshare --net``, only lo up: the transfer engine
listens on every interface), as bench/peers.py runs Mooncake: ``mooncake_master`` with its
HTTP metadata server, a store process holding the segment (bench/peers_mooncake.py
``--segment``; vLLM's "standalone-store" mode, so the blocks outlive the saving process),
then the two vLLM processes with ``MOONCAKE_CONFIG_PATH``. Where a step cannot run here the
cells are skipped with its reason: the first error line of the failing process's log.

``vllm_mooncake.py --inside SPEC.json WORK``: the part that runs in the namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from peers_mooncake import start_store  # noqa: E402
from vllm_bench import run_child, vllm_env  # noqa: E402

VENV = REPO / ".venv-vllm-mooncake"
SEGMENT_BYTES = 2 << 30  # the store process's share: every prompt's blocks in both dtypes


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[-400:]
    return lines[-1][-400:] if lines else "no output"


def _cause(exc: RuntimeError) -> str:
    """The error line of a vLLM process that failed (run_child's message carries its log)."""
    return _first_error(str(exc))


def inside(spec_path: str, work: str) -> int:
    """In the namespace: master, segment, the saving then the loading vLLM process; one JSON
    line on stdout: the two cells, or ``{"skipped": why}``."""
    wd = Path(work)
    # without it the transfer engine refuses to start with no address but loopback's
    os.environ.update(MC_TCP_BIND_ADDRESS="127.0.0.1", MC_TCP_ADMISSION_TIMEOUT_MS="20000")
    spec = json.loads(Path(spec_path).read_text())
    master, seg, maddr, meta = start_store(SEGMENT_BYTES)
    try:
        if seg.stdout.readline().strip() != "up":
            print(json.dumps({"skipped": "Mooncake's store segment did not start"}), flush=True)
            return 0
        cfg = wd / "mooncake.json"
        cfg.write_text(
            json.dumps(
                {
                    "metadata_server": meta,
                    "master_server_address": maddr,
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": "1GB",
                }
            )
        )
        env = vllm_env({"MOONCAKE_CONFIG_PATH": str(cfg)})
        kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {}}
        out = {}
        for cell in ("mooncake_save", "mooncake"):
            try:
                out[cell] = run_child(sys.executable, {**spec, "kv_transfer": kv}, wd / cell, env)
            except RuntimeError as exc:
                print(json.dumps({"skipped": f"{cell}: {_cause(exc)}", "log": str(wd / cell / "child.log")}))
                return 0
            out[cell]["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(out), flush=True)
    finally:
        seg.stdin.close()
        for proc in (seg, master):
            proc.kill()
            proc.wait()
    return 0


def mooncake_cells(spec: dict, work: Path) -> dict:
    """``{"mooncake_save": ..., "mooncake": ...}``, or ``{"mooncake_skipped": why}``."""
    py = VENV / "bin" / "python"
    if not py.exists():
        return {"mooncake_skipped": "no Mooncake venv (make vllm-mooncake)"}
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return {"mooncake_skipped": "needs root and unshare for a private network namespace"}
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    inner = f"ip link set lo up && exec {py} {Path(__file__).resolve()} --inside {spec_path} {work}"
    done = subprocess.run(
        ["unshare", "--net", "sh", "-c", inner], capture_output=True, text=True, timeout=1800, cwd=REPO
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {
            "mooncake_skipped": f"the namespace's run failed ({done.returncode}): {_first_error(done.stderr)}"
        }
    got = json.loads(lines[-1])
    if "skipped" in got:
        return {"mooncake_skipped": got["skipped"]}
    return got


if __name__ == "__main__" and sys.argv[1:2] == ["--inside"]:
    sys.exit(inside(sys.argv[2], sys.argv[3]))
