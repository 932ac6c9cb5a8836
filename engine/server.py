"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE streaming),
/v1/models, /health, /metrics. Bad requests get OpenAI-style 4xx error bodies.

One file (~360 lines) on purpose: it is the whole HTTP surface, routes beside the request
checks and error bodies they share, read as one contract with the OpenAI API."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

from engine.async_engine import AsyncEngine, RequestOutput
from engine.connector_runs import ConnectorRuns
from engine.errors import RequestError
from engine.sequence import SamplingParams


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        """The OpenAI-style error body, with ``status``."""
        err = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": err}, status_code=self.status)


class Metrics:
    """Prometheus metrics on a private registry (one per app, so tests can run several)."""

    def __init__(self, aeng: AsyncEngine) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "tierkv_engine_time_to_first_token_seconds",
            "Time to first token",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.itl = Histogram(
            "tierkv_engine_inter_token_seconds",
            "Time between streamed tokens",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.hit_tokens = Counter(
            "tierkv_engine_prefix_cache_hit_tokens", "Prompt tokens served from a cache", registry=r
        )
        self.prompt_tokens = Counter("tierkv_engine_prompt_tokens", "Prompt tokens received", registry=r)
        self.gen_tokens = Counter("tierkv_engine_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("tierkv_engine_requests", "Finished requests", ["finish_reason"], registry=r)
        pages_used = Gauge("tierkv_engine_pages_used", "KV pages referenced by requests", registry=r)
        pages_used.set_function(lambda: aeng.engine.bm.num_used)
        pages_total = Gauge("tierkv_engine_pages_total", "KV pages in the pool", registry=r)
        pages_total.set_function(lambda: aeng.engine.kv.num_pages)
        # The connector's own metrics (hit tokens by tier, load latency, fallbacks...) are
        # exported here too when it keeps them in a registry of its own.
        conn_registry = getattr(getattr(aeng.connector, "metrics", None), "registry", None)
        if conn_registry is not None:
            r.register(conn_registry)
        # tierkv_engine_phase_seconds{phase} and, with layer timing on (AsyncEngine
        # timeline_layers), tierkv_engine_layer_group_seconds{kind,group}
        r.register(aeng.engine.timeline.registry)
        cached = Gauge("tierkv_engine_pages_cached", "Unreferenced pages kept for prefix reuse", registry=r)
        cached.set_function(lambda: len(aeng.engine.bm.lru))
        if aeng.runs is not None:
            r.register(_ConnectorFailures(aeng.runs))


class _ConnectorFailures:
    """``tierkv_engine_connector_failures{call}``, read from the engine's connector calls at
    scrape time (engine/connector_runs.py: what each failure cost)."""

    def __init__(self, runs: ConnectorRuns) -> None:
        self._runs = runs

    def collect(self):
        fam = CounterMetricFamily(
            "tierkv_engine_connector_failures",
            "Connector calls that failed or timed out (lookup: served as a miss; load: filled "
            "short, the rest recomputed; save: nothing stored)",
            labels=["call"],
        )
        for call, n in self._runs.failures.items():
            fam.add_metric([call], n)
        yield fam


def _get(body: dict, name: str, types: tuple, default: Any = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types:
        raise ApiError(400, f"'{name}' has the wrong type", name)
    if not isinstance(v, types):
        raise ApiError(400, f"'{name}' must be of type {'/'.join(t.__name__ for t in types)}", name)
    return v


def _limit_field(body: dict, chat: bool) -> str:
    """The name under which the request sent its token limit (errors name it)."""
    return "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"


def _renamed(exc: RequestError, field: str) -> ApiError:
    """A 400 for ``exc``, naming ``field`` where the engine said max_tokens."""
    if exc.param == "max_tokens" and field != "max_tokens":
        return ApiError(400, str(exc).replace("max_tokens", field, 1), field)
    return ApiError(400, str(exc), exc.param)


def _params(body: dict, chat: bool, room: int) -> SamplingParams:
    """Sampling parameters of a request; ``room`` (context left after the prompt) caps the
    default max_tokens, while an explicit one that does not fit is an error."""
    # Chat takes either name (max_completion_tokens wins); an explicit 0 is an error, never
    # "unset", and errors name the field the client sent.
    field = _limit_field(body, chat)
    max_tokens = _get(body, field, (int,))
    if max_tokens is None:
        max_tokens = max(1, min(16 if not chat else 256, room))
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
    if _get(body, "n", (int,), 1) != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    for unsupported in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "best_of"):
        v = body.get(unsupported)
        if v not in (None, False, 0, [], 1 if unsupported == "best_of" else None):
            raise ApiError(400, f"'{unsupported}' is not supported by this server", unsupported)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_get(body, "temperature", (int, float), 1.0)),
            top_p=float(_get(body, "top_p", (int, float), 1.0)),
            top_k=int(_get(body, "top_k", (int,), 0)),
            seed=_get(body, "seed", (int,)),
            stop=tuple(stop),
            ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)),
        )
    except RequestError as exc:
        raise _renamed(exc, field) from exc


def create_app(aeng: AsyncEngine, model_name: str) -> FastAPI:
    """The FastAPI app around a (not yet started) AsyncEngine; starts and stops it with the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await aeng.start()
        yield
        await aeng.stop()

    app = FastAPI(title="kvengine", lifespan=lifespan)
    metrics = Metrics(aeng)
    tok = aeng.engine.tokenizer

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    async def _body(request: Request) -> dict:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise ApiError(404, f"The model '{model}' does not exist", "model", "model_not_found")
        return body

    @app.get("/health")
    async def health(check_pool: bool = False):
        """Liveness; with ``?check_pool=true`` also the page pool's integrity check."""
        if not check_pool:
            return {"status": "ok"}
        try:
            await aeng.verify()
        except AssertionError as exc:
            return JSONResponse({"status": "error", "pool": str(exc)}, status_code=500)
        return {"status": "ok", "pool": "ok"}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "tierkv"}],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            with aeng.engine.timeline.phase("tokenize"):
                ids = tok.encode(prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            ids = prompt
        else:
            raise ApiError(
                400, "'prompt' must be a non-empty string or list of token ids (one prompt)", "prompt"
            )
        return await _run(body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        clean = []
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, "each message needs a string 'role'", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise ApiError(400, "message 'content' must be a string", "messages")
            clean.append({"role": m["role"], "content": content})
        try:
            with aeng.engine.timeline.phase("tokenize"):
                ids = tok.apply_chat_template(clean)
        except Exception as exc:  # a template may raise_exception() on bad roles
            raise ApiError(400, f"chat template rejected the messages: {exc}", "messages") from exc
        return await _run(body, ids, chat=True)

    async def _run(body: dict, ids: list[int], chat: bool):
        params = _params(body, chat, aeng.engine.context_capacity - len(ids))
        stream = bool(_get(body, "stream", (bool,), False))
        opts = _get(body, "stream_options", (dict,), {})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        gen = aeng.generate(ids, params, rid)
        t0 = time.perf_counter()
        try:
            first = await gen.__anext__()  # raises RequestError before anything is sent
        except RequestError as exc:
            raise _renamed(exc, _limit_field(body, chat)) from exc
        metrics.prompt_tokens.inc(len(ids))
        metrics.ttft.observe(time.perf_counter() - t0)

        async def outputs() -> AsyncIterator[RequestOutput]:
            last = time.perf_counter()
            yield first
            if first.finished:
                return
            async for o in gen:
                now = time.perf_counter()
                metrics.itl.observe(now - last)
                last = now
                yield o

        def usage(o: RequestOutput) -> dict:
            return {
                "prompt_tokens": o.prompt_tokens,
                "completion_tokens": o.completion_tokens,
                "total_tokens": o.prompt_tokens + o.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
            }

        def done(o: RequestOutput) -> None:
            metrics.gen_tokens.inc(o.completion_tokens)
            metrics.hit_tokens.inc(o.cached_tokens)
            metrics.requests.labels(o.finish_reason or "abort").inc()

        obj = "chat.completion" if chat else "text_completion"
        if not stream:
            text, last = "", first
            async for o in outputs():
                text += o.text
                last = o
            done(last)
            choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model_name,
                "choices": [choice],
                "usage": usage(last),
            }

        async def sse():
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            base = {"id": rid, "object": chunk_obj, "created": created, "model": model_name}
            if chat:
                yield _sse(
                    {
                        **base,
                        "choices": [
                            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        ],
                    }
                )
            last = first
            async for o in outputs():
                last = o
                if chat:
                    choice = {
                        "index": 0,
                        "delta": {"content": o.text} if o.text else {},
                        "finish_reason": o.finish_reason,
                    }
                else:
                    choice = {"index": 0, "text": o.text, "finish_reason": o.finish_reason, "logprobs": None}
                yield _sse({**base, "choices": [choice]})
            done(last)
            if opts.get("include_usage"):
                yield _sse({**base, "choices": [], "usage": usage(last)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
