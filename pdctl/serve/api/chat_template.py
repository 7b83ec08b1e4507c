"""A chat's messages rendered into prompt text with the checkpoint's Jinja chat template.

Rendered in a sandboxed Jinja environment set up the way transformers renders
`apply_chat_template` (trimmed blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII), so a prompt here is the prompt
transformers builds. Models without a template (the presets) use PLAIN_TEMPLATE,
documented in docs/http-api.md. Knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdctl.records import JSONValue

# Each message as `<|role|>` and its content on the next line; the prompt ends with an
# open assistant turn.
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TemplateError(Exception):
    """The template refused the chat (raise_exception) or failed to render."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker):
    rendered as its body; the mask itself is not needed to serve."""

    tags = {"generation"}  # noqa: RUF012

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=4)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    messages: Sequence[Mapping[str, JSONValue]],
    template: str | None,
    special_tokens: dict[str, str],
) -> str:
    """The prompt text for `messages`, ending with the assistant's turn opened."""
    try:
        compiled = _compiled(template or PLAIN_TEMPLATE)
        return compiled.render(
            messages=messages,
            add_generation_prompt=True,
            tools=None,
            documents=None,
            **special_tokens,
        )
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"{type(exc).__name__}: {exc}") from None
