"""Fields clients send that pdctl accepts only at their neutral value.

OpenAI clients and benchmark harnesses send penalties, `n`, `best_of`, `logit_bias`
and the like on every request, most often at the value that changes nothing. Those
are accepted; any other value is a 400 that names the field and the value pdctl
supports, never a silent difference from what the client asked for. Fields pdctl
implements (seed, stop, logprobs, top_k, ...) are ordinary fields of the models.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

# a host a router names for a PD request: a name or an IPv4 / IPv6 address, nothing a URL
# cannot carry (a control character once left decode's receiver waiting forever)
HOST = r"^[A-Za-z0-9._:\[\]-]+$"

# field -> (the neutral values, what pdctl supports, in words)
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "frequency_penalty": ((None, 0), "only 0 is supported (pdctl applies no frequency penalty)"),
    "presence_penalty": ((None, 0), "only 0 is supported (pdctl applies no presence penalty)"),
    "repetition_penalty": ((None, 1), "only 1 is supported (pdctl applies no repetition penalty)"),
    "n": ((None, 1), "only 1 is supported (one choice per request)"),
    "best_of": ((None, 1), "only 1 is supported (one choice per request)"),
    "min_new_tokens": ((None, 0), "only 0 is supported (no minimum length)"),
    "min_tokens": ((None, 0), "only 0 is supported (no minimum length)"),
    "logit_bias": ((None, {}), "only none or {} is supported (pdctl applies no logit bias)"),
    "suffix": ((None, ""), "only none is supported (no insertion after the completion)"),
    "echo": ((None, False), "only false is supported (the prompt is not echoed)"),
    "response_format": (
        (None, {"type": "text"}),
        'only {"type": "text"} is supported (no JSON mode or schemas)',
    ),
    "tools": ((None, []), "only none or [] is supported (pdctl calls no tools)"),
    "tool_choice": ((None, "none", "auto"), 'only "none" is supported (pdctl calls no tools)'),
    "functions": ((None, []), "only none or [] is supported (pdctl calls no functions)"),
    "function_call": ((None, "none", "auto"), 'only "none" is supported (no function calls)'),
}


def check_neutral(name: str, value: Any) -> Any:
    """`value` when it is `name`'s neutral value; otherwise the 400 that says what is."""
    accepted, supported = NEUTRAL[name]
    if any(value is ok or (value == ok and not isinstance(value, bool)) for ok in accepted):
        return value
    raise PydanticCustomError(
        "unsupported_value", "{supported}, got {got}", {"supported": supported, "got": repr(value)}
    )
