"""The synchronous engine: load a model folder, add requests, step. ``AsyncEngine``
(engine/async_engine.py) drives the same object from an event loop and adds the connector."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass

import torch

from engine.attention import make_backend
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.errors import RequestError
from engine.kv_cache import KVCache
from engine.kv_calibration import calibrate_scales, calibration_tokens
from engine.kv_connector import EngineKeys
from engine.kv_dtype import dtype_name, is_scaled, layout_name, storage_dtype
from engine.kv_transfer import KVTransfer
from engine.loader import IncrementalDetokenizer, Tokenizer
from engine.model import CausalLM
from engine.runner import ModelRunner
from engine.sampling import sample
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, Status
from engine.timeline import Timeline
from engine.weights import TORCH_DTYPES, load_model, random_model

log = logging.getLogger("engine")


@dataclass
class StepOutput:
    seq: Sequence
    token: int
    text_delta: str
    finished: bool


class LLMEngine:
    """Owns the model, the KV cache, the page pool and the scheduler. Not thread-safe: one
    caller steps it (AsyncEngine runs every step on one worker thread)."""

    def __init__(self, model_dir: str | os.PathLike, config: EngineConfig | None = None) -> None:
        cfg = config or EngineConfig()
        self.model_dir: str | None = os.fspath(model_dir)
        mc = ModelConfig.from_dir(self.model_dir)
        tokenizer = Tokenizer(self.model_dir)
        dtype = TORCH_DTYPES[cfg.torch_dtype_name()]
        max_len = min(cfg.max_model_len or mc.max_position, mc.max_position)
        self._setup(cfg, mc, load_model(self.model_dir, mc, dtype, cfg.device, max_len), tokenizer)

    @classmethod
    def from_random(cls, model_config: ModelConfig, config: EngineConfig, seed: int = 0) -> LLMEngine:
        """An engine over random weights created directly on the device (benchmarks of real
        model shapes without a checkpoint). No tokenizer: outputs carry token ids only."""
        self = cls.__new__(cls)
        self.model_dir = None
        dtype = TORCH_DTYPES[config.torch_dtype_name()]
        max_len = min(config.max_model_len or model_config.max_position, model_config.max_position)
        self._setup(
            config, model_config, random_model(model_config, dtype, config.device, max_len, seed), None
        )
        return self

    def _setup(
        self, cfg: EngineConfig, mc: ModelConfig, model: CausalLM, tokenizer: Tokenizer | None
    ) -> None:
        self.config, self.model_config, self.model, self.tokenizer = cfg, mc, model, tokenizer
        self.dtype = TORCH_DTYPES[cfg.torch_dtype_name()]
        self.max_model_len = min(cfg.max_model_len or mc.max_position, mc.max_position)
        shape = dict(
            num_layers=mc.num_layers,
            page_size=cfg.page_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
        )
        kv_dtype = storage_dtype(cfg.kv_cache_dtype, self.dtype)
        scales = None
        if is_scaled(kv_dtype):  # static fp8 scales, fixed now for the engine's life
            encode = tokenizer.encode if tokenizer is not None else None
            tokens = calibration_tokens(encode, mc.vocab_size)
            scales = calibrate_scales(model, tokens, cfg.device, self.dtype)
        num_pages = cfg.num_pages or KVCache.pages_for_budget(cfg.kv_cache_bytes, dtype=kv_dtype, **shape)
        self.kv = KVCache(num_pages=num_pages, dtype=kv_dtype, device=cfg.device, scales=scales, **shape)
        # what an operator needs to find this engine's blocks (kvstore lookup's dtype and layout)
        log.info(
            "event=kv_cache kv_dtype=%s layout=%s pages=%d page_bytes=%d",
            dtype_name(kv_dtype),
            layout_name(kv_dtype, self.dtype, scales),
            num_pages,
            self.kv.page_bytes,
        )
        self.backend = make_backend(
            cfg.attention_backend, cfg.device, mc.num_heads, mc.num_kv_heads, mc.head_dim, self.dtype
        )
        ns = self.namespace(cfg.page_size) if cfg.enable_prefix_cache and self.model_dir else None
        self.bm = BlockManager(num_pages, cfg.page_size, ns)
        self.timeline = Timeline()
        self.scheduler = Scheduler(self.bm, cfg.max_num_batched_tokens, cfg.max_num_seqs, self.timeline)
        self.transfer = KVTransfer(self.kv)
        self.runner = ModelRunner(self.model, self.kv, self.backend, cfg.device, self.transfer)
        self.eos_ids = set(mc.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.requests: dict[str, Sequence] = {}
        self.detok: dict[str, IncrementalDetokenizer | None] = {}
        self.record_logits: dict[str, list[torch.Tensor]] | None = None  # tests: logits per sample
        self.steps = 0
        self.last_step_tokens = (0, 0)
        # Connector saves (set by AsyncEngine): block size, and pages held until saved.
        self.save_block_tokens = 0
        # per save to start: the request, its prompt's tokens of whole blocks, their pages
        self.pending_saves: list[tuple[Sequence, tuple[int, ...], list[int]]] = []

    def namespace(self, block_tokens: int, fingerprint: str | None = None):
        """The kvstore.keys Namespace of this model: fingerprint of its folder (or
        ``fingerprint``: engines over random weights name theirs), the KV dtype the pages hold,
        the layout (for a dtype other than the compute dtype: the compute dtype and, for fp8, a
        digest of the scales; engine/kv_dtype.py) and ``block_tokens`` (a multiple of the page
        size)."""
        from kvstore.keys import Namespace

        if fingerprint is None and self.model_dir is None:
            raise ValueError("an engine over random weights has no model folder to fingerprint")
        if block_tokens % self.config.page_size:
            raise ValueError(
                f"block_tokens {block_tokens} is not a multiple of page_size {self.config.page_size}"
            )
        return Namespace.for_model(
            self.model_dir,
            dtype_name(self.kv.dtype),
            block_tokens,
            layout=layout_name(self.kv.dtype, self.dtype, self.kv.scales),
            fingerprint=fingerprint or None,
        )

    @property
    def context_capacity(self) -> int:
        """Most tokens (prompt + output) one request may hold: the context or the whole pool."""
        return min(self.max_model_len, self.kv.num_pages * self.config.page_size)

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        prompt_tokens: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        queue: bool = True,
    ) -> Sequence:
        """Add a request and queue it for the scheduler (``queue`` False: the caller queues it
        later, ``scheduler.add``: the AsyncEngine, once its connector lookup answered). Raises
        RequestError when the prompt is empty, has ids outside the vocabulary, or prompt +
        max_tokens exceeds the context or the page pool."""
        if not prompt_tokens:
            raise RequestError("prompt must not be empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(not (0 <= t < vocab) for t in prompt_tokens):
            raise RequestError(f"prompt has token ids outside [0, {vocab})", "prompt")
        total = len(prompt_tokens) + params.max_tokens
        cap = self.context_capacity
        if total > cap:
            raise RequestError(
                f"prompt ({len(prompt_tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of {cap} tokens",
                "max_tokens",
            )
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise RequestError(f"duplicate request id {rid!r}", "request_id")
        seq = Sequence(rid, list(prompt_tokens), params)
        ns = self.bm.namespace
        if ns is not None:
            with self.timeline.phase("hash"):  # once per request, batched
                packed = ns.key_batch(seq.prompt_tokens)
                seq.prompt_keys = list(packed)
                seq.engine_keys = EngineKeys(ns.id, packed)
        if not params.greedy:
            g = torch.Generator()
            g.manual_seed(
                params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            )
            seq.generator = g
        self.requests[rid] = seq
        self.detok[rid] = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
        if queue:
            self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        self.detok.pop(request_id, None)
        if seq is not None and seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule, run the model once, sample, apply stop rules. Returns one output per
        token generated this step."""
        tl = self.timeline
        with tl.phase("schedule"):
            batch = self.scheduler.schedule()
        if not batch.items:
            return []
        n_decode = sum(1 for seq, n in batch.items if n == 1 and seq.num_computed >= seq.num_prompt)
        self.last_step_tokens = (batch.num_tokens - n_decode, n_decode)  # (prefill, decode)
        with tl.phase("compute"):
            to_sample, logits = self.runner.run(batch.items)
        for seq, n in batch.items:
            seq.num_computed += n
            self.bm.register(seq.tokens, seq.page_table, seq.page_keys, seq.num_computed, seq.prompt_keys)
            if self.save_block_tokens and not seq.saved and seq.num_computed >= seq.num_prompt:
                self._hold_for_save(seq)
        self.steps += 1
        if not to_sample:
            return []
        if self.record_logits is not None:
            for i, seq in enumerate(to_sample):
                self.record_logits.setdefault(seq.request_id, []).append(logits[i].clone())
        with tl.phase("sample"):
            tokens = sample(logits, [s.params for s in to_sample], [s.generator for s in to_sample])
        outs = []
        for seq, tok in zip(to_sample, tokens):
            seq.tokens.append(tok)
            outs.append(self._postprocess(seq, tok))
        return outs

    def _hold_for_save(self, seq: Sequence) -> None:
        # Before the request can finish and release its pages: reference the prompt's whole
        # connector blocks; the AsyncEngine saves them and drops the reference afterwards.
        seq.saved = True
        ps = self.config.page_size
        n_pages = (seq.num_prompt // self.save_block_tokens) * (self.save_block_tokens // ps)
        if n_pages:
            pages = seq.page_table[:n_pages]
            self.bm.incref(pages)
            self.pending_saves.append((seq, tuple(seq.tokens[: n_pages * ps]), pages))

    def _postprocess(self, seq: Sequence, tok: int) -> StepOutput:
        p = seq.params
        detok = self.detok[seq.request_id]
        before = len(detok.text) if detok else 0
        delta = detok.push(tok) if detok else ""
        reason = None
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
            delta = ""  # the EOS/stop token's text is not part of the output
        elif p.stop and detok is not None:
            # Search only where a stop string could newly end; cut the text before it.
            text = detok.text
            lo = max(0, before - max(len(s) for s in p.stop))
            hits = [i for i in (text.find(s, lo) for s in p.stop) if i >= 0]
            if hits:
                cut = min(hits)
                delta = text[before:cut] if cut > before else ""
                detok.text = text[:cut]
                reason = "stop"
        if reason is None and len(seq.output_tokens) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return StepOutput(seq, tok, delta, reason is not None)

    def text_of(self, request_id: str) -> str:
        """A request's output text so far, cut at a matched stop string: what :meth:`generate`'s
        callers read (its sequences carry token ids only). Until :meth:`release`."""
        return self.detok[request_id].text

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping."""
        self.requests.pop(request_id, None)
        self.detok.pop(request_id, None)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Sequence]:
        """Run prompts (token ids) to completion, all batched together. Returns the sequences
        in input order (``.output_tokens``, ``.finish_reason``)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work():
            self.step()
        return seqs

    def warm_up(self) -> None:
        """Pay one-time costs at start, not on the first request: a tiny prefill, the same
        prompt again over its cached prefix, and decode steps (CUDA context and library set-up,
        kernel compilation and autotuning, allocator growth), then the capture of every
        decode-graph bucket (CUDA graphs, engine/decode_graphs.py). Call only while no request is
        live; afterwards the counters and the timeline are as before and the pages it cached
        are free again (in a full pool it may have evicted older cached pages)."""
        if self.requests or self.scheduler.has_work():
            raise RuntimeError("warm_up() with requests in flight")
        ps = self.config.page_size
        n = min(2 * ps + 1, self.context_capacity - 3)
        if n < 1:
            return
        prompt = [1 + i % (self.model_config.vocab_size - 1) for i in range(n)]
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        saved = (self.steps, self.last_step_tokens, self.bm.hit_tokens_total, self.save_block_tokens)
        self.save_block_tokens = 0  # nothing of the warm-up goes to a connector
        timeline = self.timeline
        cached_before = set(self.bm.cache)
        self.timeline = self.scheduler.timeline = Timeline()  # the warm-up is no request's time
        try:
            for _ in range(2):  # the second one runs over the first one's cached pages
                seq = self.add_request(prompt, params, f"warm-up-{uuid.uuid4().hex}")
                while self.has_work():
                    self.step()
                self.release(seq.request_id)
        finally:
            self.steps, self.last_step_tokens, self.bm.hit_tokens_total, self.save_block_tokens = saved
            self.timeline = self.scheduler.timeline = timeline
            self.bm.forget([k for k in list(self.bm.cache) if k not in cached_before])
        if self.runner.graphs is not None:
            self.runner.graphs.capture_all()  # a no-op where graphs are not captured (CPU)

    def check_integrity(self, extra_tables: list[list[int]] | None = None) -> None:
        """Raise PoolIntegrityError unless the page pool is consistent with live requests."""
        held = [p for _, _, p in self.pending_saves]
        self.bm.check([*self.scheduler.live_tables(), *held, *(extra_tables or [])])

    def stats(self) -> dict[str, float]:
        return {
            "pages_total": self.kv.num_pages,
            "pages_used": self.bm.num_used,
            "pages_cached": len(self.bm.lru),
            "prefix_hit_tokens_total": self.bm.hit_tokens_total,
            "preemptions_total": self.scheduler.num_preemptions,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }
