"""The JSON the generating endpoints answer, typed once: SGLang's /generate results and
OpenAI's completions, chats and the chunks of their streams.

Shapes only: the handlers fill them in the order their keys go out, and they are
serialized as they are. Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from pdctl.records import JSONValue

if TYPE_CHECKING:  # the type only
    from pdctl.serve.engine.request import FinishReason

Ranked = list[float | int | None]  # SGLang's [logprob, token id, None]


class _MetaInfo(TypedDict):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None
    e2e_latency: float


class MetaInfo(_MetaInfo, total=False):
    """/generate's `meta_info`: the counts always; the transfer and logprobs when there."""

    kv_transfer: dict[str, JSONValue]  # a PD request's `KVTransfer`
    output_token_logprobs: list[Ranked]
    output_top_logprobs: list[list[Ranked]]
    output_token_logits: list[float | None]  # pdctl's own: each chosen token's logit


class GenerateResult(TypedDict):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]  # cached_tokens


class Head(TypedDict):
    """What a completion, a chat and each chunk of their streams start with."""

    id: str
    object: str  # text_completion, chat.completion, chat.completion.chunk
    created: int
    model: str


class CompletionLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # token text -> logprob
    text_offset: list[int]


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(Head):
    choices: list[CompletionChoice]
    usage: Usage


class TokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]


class ChatChoice(TypedDict):
    index: int
    message: dict[str, str]  # role, content
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(Head):
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(TypedDict):
    index: int
    delta: dict[str, str]  # the role first, then content
    logprobs: None
    finish_reason: str | None


class _Chunk(Head):
    choices: list[CompletionChoice] | list[ChatChunkChoice]


class Chunk(_Chunk, total=False):
    """One event of a streamed choice; `usage` only when the client asked for usage."""

    usage: Usage | None
