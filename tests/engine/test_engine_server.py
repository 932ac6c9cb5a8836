"""The OpenAI-compatible server as a real uvicorn subprocess on a port picked at run time,
driven by the `openai` client and by curl."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from daemonutil import stop_process
from polling import until
from ports import free_port
from scraping import scrape


def start_server(model_dir: str, *extra: str):
    """Start `kvengine serve` on a free port; returns (base URL, process) once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--model", model_dir, "--port", str(port)]
    cmd += ["--num-pages", "64", "--served-model-name", "tiny", "--device", "cpu", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return base, proc
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"server did not start: {proc.stdout.read()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    base, proc = start_server(tiny_model_dir("llama-tiny"))
    yield base
    stop_process(proc, 10.0)


@pytest.fixture(autouse=True)
def pool_stays_consistent(request):
    """After every test that used the shared server: its page pool passes the integrity check."""
    yield
    if "server" in request.fixturenames:
        base = request.getfixturevalue("server")
        with urllib.request.urlopen(base + "/health?check_pool=true", timeout=10) as r:
            assert json.loads(r.read()) == {"status": "ok", "pool": "ok"}


@pytest.fixture
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_engine_server_models_and_completion(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    kw = dict(
        model="tiny", prompt="hello there", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 12  # BOS + 11 bytes
    assert client.completions.create(**kw).choices[0].text == r.choices[0].text


def test_engine_server_cached_tokens_reported(client):
    prompt = "a long shared prefix that fills more than two pages of sixteen tokens each. " * 2
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt + "more", max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 128


def test_engine_server_chat_streaming(client):
    msgs = [{"role": "user", "content": "Say something."}]
    kw = dict(model="tiny", messages=msgs, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    text, usage, reasons = "", None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert text == full.choices[0].message.content
    assert usage.completion_tokens == 10 and reasons[-1] == "length"


def test_engine_server_errors(client, server):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=100000)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=3)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    req = urllib.request.Request(
        server + "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req, timeout=10)
    assert he.value.code == 400 and "error" in json.loads(he.value.read())


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_engine_server_curl(server):
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
    )
    out = subprocess.run(
        ["curl", "-sN", "-H", "Content-Type: application/json", "-d", body, server + "/v1/completions"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 5 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    metrics = scrape(server)
    for name in (
        "tierkv_engine_time_to_first_token_seconds_bucket",
        "tierkv_engine_inter_token_seconds_bucket",
        "tierkv_engine_prefix_cache_hit_tokens_total",
        "tierkv_engine_pages_used",
    ):
        assert metrics.of(name), f"no {name} on /metrics"
    health = subprocess.run(
        ["curl", "-sf", server + "/health"], capture_output=True, text=True, timeout=30, check=True
    )
    assert json.loads(health.stdout)["status"] == "ok"


async def test_engine_server_concurrent_streams_match_sequential(server):
    openai = pytest.importorskip("openai")
    import asyncio

    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = [f"request number {i} says" + " hello" * i for i in range(8)]
    kw = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})

    async def one(p: str, stream: bool) -> str:
        if not stream:
            return (await client.completions.create(prompt=p, **kw)).choices[0].text
        text = ""
        async for chunk in await client.completions.create(prompt=p, stream=True, **kw):
            text += chunk.choices[0].text
        return text

    sequential = [await one(p, False) for p in prompts]
    concurrent = await asyncio.gather(*(one(p, True) for p in prompts))
    assert list(concurrent) == sequential
    await client.close()


def _wait_saved(base: str, deadline_s: float = 30.0) -> None:
    """Until the engine holds no pages: a save keeps its pages referenced until it returned."""
    until(
        lambda: scrape(base).value("tierkv_engine_pages_used"),
        deadline_s,
        "the background save done (no page used)",
        ok=lambda n: n == 0,
    )


def test_engine_server_with_memory_connector(tiny_model_dir):
    openai = pytest.importorskip("openai")
    d = tiny_model_dir("llama-tiny")
    base, proc = start_server(d, "--no-prefix-cache", "--kv-connector", "memory://?block_tokens=32")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        prompt = "the connector serves this prefix from its in-process store " * 2
        kw = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        first = client.completions.create(**kw)
        _wait_saved(base)  # the save runs in the background
        second = client.completions.create(**kw)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens >= 96  # no HBM prefix cache: the connector
        assert second.choices[0].text == first.choices[0].text
        phases = _phase_counts(base)
        assert phases["lookup"] == 2 and phases["load"] == 1, phases  # the timeline sees the connector
        with urllib.request.urlopen(base + "/health?check_pool=true", timeout=10) as r:
            assert json.loads(r.read())["pool"] == "ok"
    finally:
        stop_process(proc, 10.0)


def test_engine_server_default_max_tokens_fits_the_context(client):
    # 64 pages x 16 = 1024 tokens; a 1000-token chat leaves less room than the default 256
    msgs = [{"role": "user", "content": "y" * 990}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= 1024
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_engine_server_chat_bad_token_limit_names_the_field_sent(server, field, value):
    # issue 13: max_completion_tokens=0 used to fall through to the default (200, 256 tokens)
    # and -1 was reported as a bad 'max_tokens'
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], field: value}
    ).encode()
    req = urllib.request.Request(
        server + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req, timeout=30)
    err = json.loads(he.value.read())["error"]
    assert he.value.code == 400
    assert err["param"] == field and field in err["message"]


def test_engine_cli_bad_connector_option_is_one_line_and_status_2(tiny_model_dir, cli_error_line):
    # issue 13: a bad --kv-connector option raised kvstore.errors.ConfigError through kvengine
    d = tiny_model_dir("llama-tiny")
    serve = ["serve", "--model", d, "--device", "cpu", "--port", "0"]
    line = cli_error_line(*serve, "--kv-connector", "kvstore://127.0.0.1:1?lookup_deadline_s=soon")
    assert line.startswith("kvengine: error:") and "lookup_deadline_s" in line, line


def _phase_counts(base: str) -> dict[str, float]:
    return scrape(base).by("tierkv_engine_phase_seconds_count", "phase")


def test_engine_server_exports_the_request_timeline(client, server):
    # issue 11 item 2: per-phase histograms on /metrics, counted for a real request
    before = _phase_counts(server)
    r = client.completions.create(
        model="tiny",
        prompt="time every phase " * 20,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 4
    after = _phase_counts(server)
    delta = {p: after.get(p, 0) - before.get(p, 0) for p in after}
    assert delta["hash"] == 1, "a prompt's page keys are hashed once per request"
    assert delta["tokenize"] == 1
    assert delta["queue"] == 1
    for per_step in ("schedule", "compute", "to_thread", "from_thread"):
        assert delta[per_step] >= 4, (per_step, delta)  # a prefill step and three decodes at least
    assert delta["sample"] == 4
    assert "lookup" in after and delta["lookup"] == 0  # no connector: no lookups


def test_engine_cli_lookup_backstop_below_the_connectors_deadline_is_refused(tiny_model_dir, cli_error_line):
    # the engine's own lookup cap may only sit above the connector's deadline (issue 11);
    # memory:// keeps the interface's default 1 s deadline
    d = tiny_model_dir("llama-tiny")
    serve = ["serve", "--model", d, "--device", "cpu", "--port", "0"]
    line = cli_error_line(
        *serve, "--kv-connector", "memory://?block_tokens=16", "--kv-lookup-timeout-s", "0.5"
    )
    assert "lookup_timeout_s 0.5 is below" in line, line
