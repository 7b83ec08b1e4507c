"""How a request is phrased to an engine's servers, and how their answer is read.

verify and the launcher's canary speak to every engine through its `Dialect`:
pdctl's servers and SGLang take `/generate` with `sampling_params` and answer with
`output_ids` and `meta_info` (logprobs, cached tokens, pdctl's `kv_transfer`); vLLM
takes OpenAI completions with a token-id prompt and answers with `token_ids`, its
logprobs keyed `token_id:N` (`return_tokens_as_token_ids`) and the prompt tokens
its prefix cache served in `usage.prompt_tokens_details`. A dialect also names the
POST that empties a server's prefix cache. Nothing here sends a request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypedDict

from pdctl.records import JSONValue, KVTransfer


class PromptBody(TypedDict, total=False):
    """A prompt as the workload phrases it: token ids or text, images optional."""

    input_ids: list[int]
    text: str | None
    images: list[Any]  # each a base64 image ({data, dtype, shape}) or nested lists of floats


class SamplingParams(TypedDict, total=False):
    temperature: int
    max_new_tokens: int
    ignore_eos: bool


class GenerateBody(PromptBody, total=False):
    """`/generate` (pdctl's servers, SGLang)."""

    sampling_params: SamplingParams
    return_logprob: bool
    top_logprobs_num: int


class CompletionsBody(TypedDict, total=False):
    """OpenAI `/v1/completions` as vLLM takes it (token ids as the prompt)."""

    prompt: list[int] | str | None
    max_tokens: int
    temperature: int
    ignore_eos: bool
    return_token_ids: bool
    logprobs: int
    return_tokens_as_token_ids: bool


RequestBody: TypeAlias = GenerateBody | CompletionsBody


class AnswerError(ValueError):
    """An answer (HTTP 200) that does not say what verify needs; the message says what."""


@dataclass
class Answer:
    """What one generation request got back, in every engine's terms."""

    output_ids: list[int]
    logprobs: list[float] = field(default_factory=list)  # the chosen token's, per position
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per position, best first
    logits: list[float | None] = field(default_factory=list)  # the chosen token's (pdctl only)
    cached_tokens: int = 0  # prompt tokens prefill's prefix cache served
    kv_transfer: KVTransfer | None = None  # pdctl's servers: digests of the KV sent
    embedding_transfer: JSONValue = None  # EPD: what the encoder wrote, as it said it
    finish_reason: str | None = None


class Dialect(ABC):
    """One engine's request and answer format."""

    name: str
    flush_path: str  # POST: empty the server's prefix cache

    @abstractmethod
    def request(self, prompt: PromptBody, max_new_tokens: int, top: int) -> tuple[str, RequestBody]:
        """(path, body) of a greedy request for `prompt` ({"input_ids": [...]} or
        {"text": ...}, images optional): ignore EOS, logprobs of the `top` best."""

    @abstractmethod
    def read(self, body: Any) -> Answer:
        """A 200 answer's body; AnswerError when it is not one this dialect reads."""

    def canary(self) -> tuple[str, RequestBody]:
        """(path, body) of the 1-token request that proves a run serves."""
        path, body = self.request({"text": "pdctl canary"}, 1, 0)
        return path, body


def _object(body: Any, what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise AnswerError(f"{what} is not a JSON object")
    return body


class GenerateDialect(Dialect):
    """pdctl's servers and SGLang: `/generate` (SGLang's native API)."""

    name = "generate"
    flush_path = "/flush_cache"

    def request(
        self, prompt: PromptBody, max_new_tokens: int, top: int
    ) -> tuple[str, GenerateBody]:
        greedy = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
        body: GenerateBody = {**prompt, "sampling_params": greedy}
        if top:
            body |= {"return_logprob": True, "top_logprobs_num": top}
        return "/generate", body

    def canary(self) -> tuple[str, GenerateBody]:
        one_token = SamplingParams(max_new_tokens=1, temperature=0)
        return "/generate", {"text": "pdctl canary", "sampling_params": one_token}

    def read(self, body: Any) -> Answer:
        answer = _object(body, "the answer")
        meta = answer.get("meta_info") or {}
        if not isinstance(meta, dict):
            raise AnswerError("the answer's meta_info is not an object")
        transfer = None
        if meta.get("kv_transfer") is not None:
            transfer = KVTransfer.from_json(meta["kv_transfer"], "meta_info.kv_transfer")
        try:
            return Answer(
                output_ids=[int(i) for i in answer.get("output_ids") or []],
                logprobs=[float(e[0]) for e in meta.get("output_token_logprobs") or []],
                top=[
                    [(int(e[1]), float(e[0])) for e in position or []]
                    for position in meta.get("output_top_logprobs") or []
                ],
                logits=[
                    None if v is None else float(v) for v in meta.get("output_token_logits") or []
                ],
                cached_tokens=int(meta.get("cached_tokens", 0) or 0),
                kv_transfer=transfer,
                embedding_transfer=meta.get("embedding_transfer"),
                finish_reason=_reason(meta.get("finish_reason")),
            )
        except (TypeError, ValueError, IndexError) as exc:
            raise AnswerError(f"the answer's tokens or logprobs are malformed ({exc})") from None


def _reason(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("type"))
    return None if value is None else str(value)


TOKEN_ID = "token_id:"  # vLLM's spelling of a token under return_tokens_as_token_ids


class CompletionsDialect(Dialect):
    """vLLM: OpenAI `/v1/completions` with the prompt as token ids (or text), greedy, the
    generated ids (`return_token_ids`) and logprobs keyed by token id."""

    name = "completions"
    flush_path = "/reset_prefix_cache"  # a development endpoint (VLLM_SERVER_DEV_MODE=1)

    def request(
        self, prompt: PromptBody, max_new_tokens: int, top: int
    ) -> tuple[str, CompletionsBody]:
        if prompt.get("images"):
            raise AnswerError("vLLM topologies take no images from pdctl's workload")
        text = prompt.get("input_ids")
        body: CompletionsBody = {
            "prompt": text if text is not None else prompt.get("text", ""),
            "max_tokens": max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if top:
            body |= {"logprobs": top, "return_tokens_as_token_ids": True}
        return "/v1/completions", body

    def read(self, body: Any) -> Answer:
        answer = _object(body, "the answer")
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            raise AnswerError("the answer does not hold exactly one choice")
        choice = _object(choices[0], "the answer's choice")
        ids = choice.get("token_ids")
        if not isinstance(ids, list):
            raise AnswerError("the answer's choice has no token_ids (return_token_ids)")
        usage = answer.get("usage")
        details = (usage.get("prompt_tokens_details") if isinstance(usage, dict) else None) or {}
        try:
            logprobs = choice.get("logprobs") or {}
            return Answer(
                output_ids=[int(i) for i in ids],
                logprobs=[float(v) for v in logprobs.get("token_logprobs") or []],
                top=[_ranked(position) for position in logprobs.get("top_logprobs") or []],
                cached_tokens=int(details.get("cached_tokens") or 0),
                finish_reason=_reason(choice.get("finish_reason")),
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise AnswerError(f"the answer's tokens or logprobs are malformed ({exc})") from None


def _ranked(position: Mapping[str, float] | None) -> list[tuple[int, float]]:
    """{"token_id:7": -0.1, ...} as [(7, -0.1), ...], best first."""
    pairs = []
    for key, value in (position or {}).items():
        if not key.startswith(TOKEN_ID):
            raise ValueError(f"top logprob key {key!r} is not a token id")
        pairs.append((int(key.removeprefix(TOKEN_ID)), float(value)))
    return sorted(pairs, key=lambda pair: -pair[1])


DIALECTS: dict[str, Dialect] = {d.name: d for d in (GenerateDialect(), CompletionsDialect())}
