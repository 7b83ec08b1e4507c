"""Request bodies of OpenAI's /v1/completions and /v1/chat/completions.

Unknown keys are errors. What pdctl implements is honoured (temperature, top_p,
top_k, max_tokens, stop, seed, logprobs, stream with `stream_options.include_usage`,
ignore_eos, stop_token_ids); what clients send at a neutral value (penalties, n,
best_of, logit_bias, tools, ...) is accepted at that value only (fields.py); `user`
and `metadata` are accepted and ignored, as any server may.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from pdctl.serve.api.fields import HOST, NEUTRAL, check_neutral

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class OpenAIBody(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=1000)
    max_tokens: int | None = Field(None, ge=0, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: bool = False
    user: str | None = Field(None, max_length=1000)
    metadata: dict[str, str] | None = None
    skip_special_tokens: bool = True
    # accepted at their neutral value only
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    n: int | None = None
    best_of: int | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    # PD: added by the router
    bootstrap_host: str | None = Field(None, max_length=255, pattern=HOST)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, le=2**63 - 1)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (all tokens) or >= 1")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOPS or any(not s or len(s) > 200 for s in stops):
            raise ValueError(f"at most {MAX_STOPS} stop strings of 1 to 200 characters each")
        return value

    @field_validator(*NEUTRAL, check_fields=False)  # those of the subclasses' fields too
    @classmethod
    def _neutral(cls, value: object, info: ValidationInfo) -> object:
        return check_neutral(str(info.field_name), value)

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(OpenAIBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatBody(OpenAIBody):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=0, le=1_000_000)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
