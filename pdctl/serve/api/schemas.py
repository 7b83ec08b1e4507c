"""Request bodies of SGLang's /generate (OpenAI's are in openai_schemas.py).

Unknown sampling keys are errors (a misspelt `max_new_token` must not silently use
the default); top-level keys SGLang clients and routers add are accepted. Penalties
and `n` are accepted at their neutral value only (fields.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from pdctl.serve.api.fields import HOST, check_neutral

MAX_TOP_LOGPROBS = 20


class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0, le=100.0)
    max_new_tokens: int = Field(128, ge=0, le=1_000_000)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    no_stop_trim: bool = False  # keep a matched stop string at the end of the text
    # accepted for compatibility, without effect here
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # accepted at their neutral value only (fields.py)
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0

    @field_validator(
        "n", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens"
    )
    @classmethod
    def _neutral(cls, value: object, info: ValidationInfo) -> object:
        return check_neutral(str(info.field_name), value)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (all tokens) or >= 1")
        return value

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingBody = Field(default_factory=SamplingBody)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    rid: str | None = Field(None, max_length=200)
    bootstrap_host: str | None = Field(None, max_length=255, pattern=HOST)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, le=2**63 - 1)
    # multimodal (see multimodal.py): from clients `image` / `images`; from an EPD router
    # the expanded prompt's `mm_items` and the `embedding_room` prefill received them in
    image: Any = None
    images: list[Any] | None = Field(None, max_length=8)
    mm_items: list[dict[str, int]] | None = Field(None, max_length=8)
    embedding_room: int | None = Field(None, ge=0, le=2**63 - 1)
