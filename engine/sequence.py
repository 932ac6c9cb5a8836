"""A request as the scheduler sees it, and its sampling parameters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy. ``stop`` strings end the text (excluded from it);
    ``stop_token_ids`` and EOS (unless ``ignore_eos``) end generation."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(
                f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature!r}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k!r}", "top_k")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class Status(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # pages allocated, a connector load in flight
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. ``tokens`` = prompt + generated; ``num_computed`` of them have K/V in the
    pages of ``page_table``. ``page_keys[i]`` is the prefix-cache key of full page ``i``;
    ``prompt_keys`` the keys of the prompt's full pages, hashed once when the request is added
    (the prefix-cache match and registration reuse them on every step and after preemption);
    ``engine_keys`` the same keys packed (``engine.kv_connector.EngineKeys``), handed to the
    connector so that it does not hash the prompt again."""

    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    page_table: list[int] = field(default_factory=list)
    page_keys: list = field(default_factory=list)
    status: Status = Status.WAITING
    num_cached_tokens: int | None = None  # prompt tokens served from a cache on first admission
    external_hit_tokens: int = 0  # what the connector's lookup reported
    connector_lookup: object = None  # its record, handed back to the connector's load and save
    finish_reason: str | None = None
    generator: object = None  # torch.Generator for seeded sampling
    saved: bool = False
    prompt_keys: list = field(default_factory=list)
    engine_keys: object = None
    queued_at: float | None = None  # perf_counter when it entered the queue (timeline)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_tokens)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_tokens)

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[len(self.prompt_tokens) :]

    @property
    def remaining(self) -> int:
        """Tokens whose K/V must still be computed before the next sample."""
        return len(self.tokens) - self.num_computed
