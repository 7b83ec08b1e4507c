"""A request's state inside the engine, and the events it reports to its caller."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, TypedDict

import torch

from pdctl.records import KVTransfer
from pdctl.serve.engine.radix import Node
from pdctl.serve.engine.sampling import SamplingParams, TokenChoice


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    TRANSFER = "transfer"  # decode: pages reserved, KV arriving from prefill
    SENDING = "sending"  # prefill: prompt computed, KV leaving for decode
    DECODE = "decode"
    DONE = "done"


class _Finished(TypedDict):
    type: Literal["stop", "length", "abort", "kv_sent"]  # kv_sent: prefill's PD request


class FinishReason(_Finished, total=False):
    """How a request ended, as /generate's meta_info says it (SGLang's shape)."""

    matched: int | str  # stop: the token id or the stop string that ended it
    length: int  # length: the max_new_tokens it reached


@dataclass
class Event:
    """What a request reports: new tokens, then a final event with `finish_reason`."""

    rid: str
    token: int | None = None
    choice: TokenChoice | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    return_logprob: bool = False
    top_logprobs_num: int = 0
    created: float = field(default_factory=time.monotonic)
    # engine state
    phase: Phase = Phase.WAITING
    slot: int | None = None
    pages: list[int] = field(default_factory=list)  # pages this request owns
    cached_nodes: list[Node] = field(default_factory=list)  # locked prefix pages
    cached_tokens: int = 0
    computed: int = 0  # tokens whose KV is in the pool
    output_ids: list[int] = field(default_factory=list)
    choices: list[TokenChoice] = field(default_factory=list)
    generator: torch.Generator | None = None
    aborted: bool = False
    first_token_at: float | None = None
    room: int | None = None  # PD: the bootstrap room
    bootstrap: str | None = None  # PD: "host:port" of the prefill bootstrap endpoint
    kv_transfer: KVTransfer | None = None  # PD: the transfer of the prompt's KV
    # multimodal: (prompt offset, [n, hidden] rows) replacing those positions' embeddings
    embeds: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def max_tokens(self) -> int:
        """Tokens this request may ever hold in the KV pool."""
        return self.prompt_len + self.params.max_new_tokens

    def pages_needed(self, page_size: int) -> int:
        return -(-self.max_tokens // page_size)
