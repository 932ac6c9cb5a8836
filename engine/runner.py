"""Model runner: turns a scheduled batch into tensors, runs the model, returns logits for
the sequences that finished computing all their known tokens this step.

Layer timing (opt-in, :meth:`ModelRunner.time_layers`; issue 11): each prefill step is cut
into the layer groups its connector loads arrive in (``KVTransfer.step_groups``) and timed per
group: how long the compute waited for the group's KV, and the group's compute. On CUDA with
timing events recorded on the compute stream and read once the step's last event completed
(:meth:`LayerTimer.take`), so no synchronisation is added; on CPU with ``perf_counter``. Off,
the step runs exactly as without it (no hook, no event)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from engine.attention_meta import build_metadata
from engine.decode_graphs import DecodeGraphConfig, DecodeGraphs
from engine.kv_cache import KVCache
from engine.kv_transfer import KVTransfer
from engine.model import CausalLM
from engine.sequence import Sequence
from engine.timeline import LAYER_STEPS_KEPT, GroupTime, StepLayers

# Largest decode batch CUDA graphs are captured for (buckets 1, 2, 4, ... up to it).
GRAPH_MAX_BATCH = 256


class StepClock:
    """The marks of one timed step: start, then per group the start and end of its load wait,
    then the end of the last layer, then the end of the forward. Marks are CUDA timing events
    on the current stream, or ``perf_counter`` readings on CPU."""

    def __init__(self, cuda: bool, groups: list[range], request_ids: tuple[str, ...], tokens: int) -> None:
        self.cuda, self.groups, self.request_ids, self.tokens = cuda, groups, request_ids, tokens
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def before_layer(self, barrier: Callable[[int], None] | None) -> Callable[[int], None]:
        """The model's ``before_layer`` hook: ``barrier`` (the transfer's wait, or None) with a
        mark on each side of it at every group's first layer. Within a group ``barrier`` waits
        on events already waited for (groups are cut where the events change), so it costs
        no device time there and is not marked."""
        starts = {g.start for g in self.groups}
        mark = self.mark

        def hook(layer: int) -> None:
            if layer in starts:
                mark()
                if barrier is not None:
                    barrier(layer)
                mark()
            elif barrier is not None:
                barrier(layer)

        return hook

    def ready(self) -> bool:
        """Whether every mark is known (never blocks)."""
        return not self.cuda or self.marks[-1].query()

    def resolve(self) -> StepLayers:
        """The step's record; on CUDA blocks until its last event completed."""
        if self.cuda:
            self.marks[-1].synchronize()
            t = [0.0] + [self.marks[0].elapsed_time(e) / 1000 for e in self.marks[1:]]
        else:
            t = [m - self.marks[0] for m in self.marks]
        groups = tuple(
            GroupTime(g.start, g.stop, t[2 + 2 * i] - t[1 + 2 * i], t[3 + 2 * i] - t[2 + 2 * i])
            for i, g in enumerate(self.groups)
        )
        return StepLayers(self.request_ids, self.tokens, t[-1], groups)


class LayerTimer:
    """Timed steps waiting to be read. Thread-safe: the step thread adds, another may take."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        # bounded: an engine nobody drains (LLMEngine stepped directly) keeps only the latest
        self._steps: deque[StepClock] = deque(maxlen=LAYER_STEPS_KEPT)
        self._lock = threading.Lock()

    def clock(self, groups: list[range], request_ids: tuple[str, ...], tokens: int) -> StepClock:
        return StepClock(self.cuda, groups, request_ids, tokens)

    def add(self, clock: StepClock) -> None:
        """A step whose forward returned (a step that raised is never added)."""
        with self._lock:
            self._steps.append(clock)

    def take(self, wait: bool = False) -> list[StepLayers]:
        """The records of the steps whose times are known, oldest first, each returned once.
        On CUDA a step's times are known once its last event completed (after a step that
        sampled, at once: sampling waited for the device); ``wait`` blocks until every step's
        are (tests, benchmarks, discarding)."""
        out = []
        with self._lock:
            while self._steps and (wait or self._steps[0].ready()):
                out.append(self._steps.popleft().resolve())
        return out


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        backend,
        device: str,
        transfer: KVTransfer,
        decode_graphs: DecodeGraphConfig | None = None,
        cuda_graphs: bool = True,
        layer_timing: bool = False,
    ) -> None:
        """``decode_graphs``: run decode-only steps on static buffers (engine/decode_graphs.py)
        as configured. Without it, ``cuda_graphs`` turns on CUDA graphs where they apply: a
        CUDA KV cache and a backend with fixed decode plans (Triton); off everywhere else.
        ``layer_timing``: time each prefill step per layer group (:meth:`time_layers`)."""
        self.model, self.kv, self.backend, self.device = model, kv, backend, device
        self.transfer = transfer  # connector loads still copying: each layer waits for its part
        self._layers = kv.layers()
        if decode_graphs is None and cuda_graphs and kv.data.is_cuda and hasattr(backend, "decode_plans"):
            max_context = min(model.rope_cos.shape[0], kv.num_pages * kv.page_size)
            decode_graphs = DecodeGraphConfig(GRAPH_MAX_BATCH, max_context, capture=True)
        self.graphs = DecodeGraphs(model, kv, backend, decode_graphs) if decode_graphs else None
        self.layer_timer: LayerTimer | None = None
        self.time_layers(layer_timing)

    def time_layers(self, on: bool) -> None:
        """Turn layer timing on (a fresh :class:`LayerTimer` in ``layer_timer``) or off (None:
        steps run without any hook). Call between steps."""
        self.layer_timer = LayerTimer(self.kv.data.is_cuda) if on else None

    def run(self, items: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """Compute ``n`` tokens of each ``(seq, n)`` (its next uncomputed ones), writing their
        K/V into the seq's pages. Returns the sequences that now need a sample and their logits.
        With layer timing on, a step that prefills (any item but one decode token) is timed and
        runs eagerly, never as a decode graph."""
        ids: list[int] = []
        pos: list[int] = []
        qlens, clens, tables = [], [], []
        logits_idx: list[int] = []
        to_sample: list[Sequence] = []
        for seq, n in items:
            start = seq.num_computed
            ids += seq.tokens[start : start + n]
            pos += range(start, start + n)
            qlens.append(n)
            clens.append(start + n)
            tables.append(seq.page_table)
            if start + n == len(seq.tokens):
                logits_idx.append(len(ids) - 1)
                to_sample.append(seq)
        clock = None
        if self.layer_timer is not None:
            # as LLMEngine counts decode tokens: one token of a sequence past its prompt
            prefill = tuple(s.request_id for s, n in items if not (n == 1 and s.num_computed >= s.num_prompt))
            if prefill:
                clock = self.layer_timer.clock(self.transfer.step_groups(), prefill, len(ids))
        g = self.graphs
        if (
            clock is None
            and g is not None
            and len(ids) == len(items) == len(to_sample)
            and g.fits(len(items), max(clens))
        ):
            return to_sample, g.run(ids, pos, tables, self.transfer.step_barrier())
        meta = build_metadata(qlens, clens, tables, self.kv.page_size, self.device)
        dev = self.device
        args = (
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            self._layers,
            meta,
            self.backend,
            torch.tensor(logits_idx, dtype=torch.int64, device=dev),
        )
        if clock is None:
            return to_sample, self.model(*args, self.transfer.step_barrier())
        clock.mark()
        logits = self.model(*args, clock.before_layer(self.transfer.step_barrier()), clock.mark)
        clock.mark()
        self.layer_timer.add(clock)
        return to_sample, logits
