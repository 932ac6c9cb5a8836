"""The engine loop: drives an LLMEngine from asyncio and runs the KV connector.

One background task owns the engine. Between steps it applies events (new requests whose
connector lookup finished, finished loads and saves, aborts); each step runs on one worker
thread so the event loop (HTTP, connector I/O) stays responsive. All page-pool mutations
happen on the loop task between steps, never concurrently with a step.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.connector_runs import ConnectorRuns
from engine.errors import ConfigError
from engine.kv_connector import (
    ConnectorContext,
    ConnectorRegistry,
    KVConnector,
)
from engine.llm import LLMEngine
from engine.sequence import SamplingParams

log = logging.getLogger("engine")


@dataclass
class RequestOutput:
    request_id: str
    token_id: int | None
    text: str  # delta
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def connector_context(engine: LLMEngine) -> ConnectorContext:
    """What a connector factory gets from ``engine``."""
    return ConnectorContext(
        engine.config.page_size,
        engine.kv,
        engine.namespace,
        engine.model_dir,
        engine.config.device,
        engine.transfer,
    )


# Added to the connector's own lookup deadline for the engine's backstop: the connector hashes
# the prompt's keys before its deadline starts, and a backstop must never cut a lookup that
# the connector would still answer in time.
LOOKUP_MARGIN_S = 1.0


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        connector: KVConnector | None = None,
        lookup_timeout_s: float | None = None,
        timeline_layers: bool = False,
    ) -> None:
        """``connector`` None means no connector: no lookups, loads or saves at all.

        ``timeline_layers`` turns on the runner's per-layer-group timing of prefill steps
        (engine/runner.py); each step's record goes into the engine's timeline (per request,
        a log line, a histogram) after the step, before its outputs are handed out. Off by
        default: then nothing is timed or recorded.

        ``lookup_timeout_s`` is only a backstop against a connector that ignores its own
        deadline: by default the connector's ``lookup_deadline_s`` + LOOKUP_MARGIN_S. A
        value below the connector's deadline is refused (ConfigError): it would turn lookups
        the connector answers in time into misses."""
        self.engine = engine
        self.connector = connector
        if connector is not None:
            own = float(connector.lookup_deadline_s)
            if lookup_timeout_s is None:
                lookup_timeout_s = own + LOOKUP_MARGIN_S
            elif lookup_timeout_s < own:
                raise ConfigError(
                    f"lookup_timeout_s {lookup_timeout_s} is below the connector's lookup_deadline_s {own}"
                )
        self.lookup_timeout_s = lookup_timeout_s
        if timeline_layers:
            engine.runner.time_layers(True)
        self._started = False
        self._start_lock = asyncio.Lock()
        if connector is not None:
            engine.scheduler.connector_block_pages = connector.block_tokens // engine.config.page_size
            engine.save_block_tokens = connector.block_tokens
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._events: list = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._bg: set[asyncio.Task] = set()
        self._held: dict[int, list[int]] = {}  # save id -> pages held until the save returns
        self.runs = (
            None if connector is None else ConnectorRuns(engine, connector, lookup_timeout_s, self._post)
        )

    @classmethod
    def from_model(
        cls,
        model_dir: str,
        config: EngineConfig | None = None,
        kv_connector: str = "none",
        registry: ConnectorRegistry | None = None,
        lookup_timeout_s: float | None = None,
        timeline_layers: bool = False,
    ) -> AsyncEngine:
        eng = LLMEngine(model_dir, config)
        connector = (registry or ConnectorRegistry()).create(kv_connector, connector_context(eng))
        return cls(eng, connector, lookup_timeout_s, timeline_layers)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the loop. The first call also pays every one-time cost here rather than on
        the first request: the connector's ``start()`` (store, connections, buffers) on this
        loop, then the engine's warm-up (EngineConfig.warm_up) on the step thread. One after
        the other: the warm-up captures CUDA graphs, and a capture fails when another thread
        allocates or page-locks memory meanwhile (as opening a local store does)."""
        if self._task is not None:
            return
        async with self._start_lock:  # concurrent first requests wait for one warm-up
            if not self._started:
                if self.connector is not None:
                    await self.connector.start()
                if self.engine.config.warm_up:
                    await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.warm_up)
                    self._record_layer_times(keep=False)  # the warm-up is no request's time
                self._started = True
            if self._task is None:
                self._wake = asyncio.Event()
                self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for t in list(self._bg):
            t.cancel()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        self._apply_events()
        if self.connector is not None:
            await self.connector.close()
        self._pool.shutdown(wait=True)

    def check_integrity(self) -> None:
        """Pool integrity with every live request and every page held for a save. Call it
        only while no step runs (tests between requests); else use :meth:`verify`."""
        self.engine.check_integrity(list(self._held.values()))

    async def verify(self) -> None:
        """Run :meth:`check_integrity` on the loop between two steps; raises
        PoolIntegrityError if the pool is inconsistent."""
        await self.start()
        fut = asyncio.get_running_loop().create_future()
        self._events.append(("check", fut))
        self._kick()
        await fut

    # ---- requests -----------------------------------------------------------------------
    async def generate(
        self, prompt_tokens: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Raises RequestError (before the first output) for a
        bad request. Cancelling the iterator aborts the request."""
        await self.start()
        rid = request_id or uuid.uuid4().hex
        seq = self.engine.add_request(prompt_tokens, params, rid, queue=False)  # validates
        if self.runs is not None and not self.runs.cached_locally(seq):
            self._spawn(self.runs.lookup(seq))  # queued when the lookup answers (or times out)
        else:
            self.engine.scheduler.add(seq)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        self._kick()
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if seq.finish_reason is None:
                self._events.append(("abort", rid))
                self._kick()
            else:
                self._events.append(("release", rid))

    def _post(self, event: tuple) -> None:
        """An event for the loop to apply between two steps (:meth:`_apply_events`)."""
        self._events.append(event)
        self._kick()

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # ---- the loop -----------------------------------------------------------------------
    def _apply_events(self) -> None:
        events, self._events = self._events, []
        sch = self.engine.scheduler
        for ev in events:
            kind = ev[0]
            if kind == "lookup":
                _, seq, found = ev
                if seq.finish_reason is None:
                    seq.external_hit_tokens = int(found.hit_tokens)
                    seq.connector_lookup = found.found
                    sch.add(seq)
            elif kind == "loaded":
                _, seq, first, n, t0 = ev
                sch.finish_load(seq, first, n)
                self.engine.timeline.observe("load", time.perf_counter() - t0)
                if seq.request_id not in self._queues:  # aborted while loading
                    self.engine.abort(seq.request_id)
            elif kind == "saved":
                self.engine.bm.release(self._held.pop(ev[1]))
            elif kind == "abort":
                seq = self.engine.requests.get(ev[1])
                if seq is not None and seq in sch.loading:
                    continue  # finish_load aborts it; its pages are being written
                self.engine.abort(ev[1])
            elif kind == "release":
                self.engine.release(ev[1])
            elif kind == "check":
                try:
                    self.check_integrity()
                    ev[1].set_result(None)
                except Exception as exc:  # handed to the caller of verify()
                    ev[1].set_exception(exc)

    def _record_layer_times(self, keep: bool = True) -> None:
        """Move the runner's finished layer timings into the timeline (``keep``) or drop them
        (waiting for their events: only after a warm-up, whose last step already synced)."""
        timer = self.engine.runner.layer_timer
        if timer is not None:
            for step in timer.take(wait=not keep):
                if keep:
                    self.engine.timeline.record_layers(step)

    def _after_step(self, outs) -> None:
        eng = self.engine
        self._record_layer_times()  # before the outputs: a finished request's record is in
        if self.runs is not None:
            for seq, first, pages in eng.scheduler.to_load:
                self._spawn(self.runs.load(seq, first, pages))
            eng.scheduler.to_load.clear()
            for seq, tokens, pages in eng.pending_saves:  # referenced by the step
                sid = id(pages)
                self._held[sid] = pages
                self._spawn(self.runs.save(sid, seq, tokens, pages))
            eng.pending_saves.clear()
        for o in outs:
            q = self._queues.get(o.seq.request_id)
            if q is not None:
                s = o.seq
                q.put_nowait(
                    RequestOutput(
                        s.request_id,
                        o.token,
                        o.text_delta,
                        o.finished,
                        s.finish_reason if o.finished else None,
                        s.num_prompt,
                        len(s.output_tokens),
                        s.num_cached_tokens or 0,
                    )
                )

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        eng = self.engine
        while True:
            self._apply_events()
            # schedule loads for requests admitted straight from events (no step needed)
            if not eng.has_work() or not (eng.scheduler.running or eng.scheduler.waiting):
                self._after_step([])
                self._wake.clear()
                if not self._events:
                    await self._wake.wait()
                continue
            before = eng.steps
            t0 = time.perf_counter()
            marks: list[float] = []  # when the step began and ended on its thread
            try:
                outs = await loop.run_in_executor(self._pool, _timed_step, eng, marks)
            except Exception as exc:  # a bug in a step: fail the live requests, keep serving
                log.exception("event=step_failed")
                for rid, q in list(self._queues.items()):
                    q.put_nowait(exc)
                    self._events.append(("abort", rid))
                continue
            if len(marks) == 2:
                tl = eng.timeline
                tl.observe("to_thread", marks[0] - t0)
                tl.observe("from_thread", time.perf_counter() - marks[1])
            prefill, decode = eng.last_step_tokens
            if self.connector is not None and eng.steps != before and prefill and not decode:
                observe = getattr(self.connector, "observe_prefill", None)
                if observe is not None:
                    observe(prefill, time.perf_counter() - t0)
            self._after_step(outs)
            if eng.steps == before and not self._events:
                # Nothing could run (pages held by loads or saves): wait for one to finish.
                self._wake.clear()
                waiter = asyncio.ensure_future(self._wake.wait())
                done, _ = await asyncio.wait({waiter}, timeout=0.05)
                if not done:
                    waiter.cancel()
            else:
                await asyncio.sleep(0)  # let HTTP handlers and connector tasks run


def _timed_step(eng: LLMEngine, marks: list[float]):
    """``eng.step()`` on the step thread, noting when it began and ended (the hand-offs)."""
    marks.append(time.perf_counter())
    try:
        return eng.step()
    finally:
        marks.append(time.perf_counter())
