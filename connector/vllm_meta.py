"""What vLLM's scheduler-side connector tells the worker side each step (vLLM pickles it to
the workers): the blocks to load before this step's forward and the blocks to save after it,
per request, with the prompt's keys as the scheduler's lookup hashed them (the worker takes
them when its namespace is the same, so a prompt is hashed once)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from connector.prompt_lookup import PromptLookup
from connector.vllm_format import PageFormat


@dataclass(frozen=True)
class BlockMove:
    """Blocks ``first .. first + len(block_ids) - 1`` of request ``req_id``'s prompt, in vLLM's
    blocks ``block_ids``; ``token_ids``: the prompt through the last of them."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    first: int
    record: PromptLookup | None = None


@dataclass
class TierkvMetadata(KVConnectorMetadata):
    loads: list[BlockMove] = field(default_factory=list)
    saves: list[BlockMove] = field(default_factory=list)


@dataclass(frozen=True)
class TierkvHandshake(KVConnectorHandshakeMetadata):
    """A worker's page format, handed to the scheduler side once the KV tensors exist."""

    fmt: PageFormat
