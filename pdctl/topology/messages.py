"""Pydantic validation errors -> issues a topology author can act on.

Pydantic's messages name Python types ("Input should be a valid integer"); a YAML
author needs "expected an integer, got the text '2'" and, for a misspelt key, the
key they meant. This module only rewrites wording; it decides nothing.
"""

from __future__ import annotations

import difflib
import re
import types
from dataclasses import replace
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from pdctl.topology.issues import Issue, KeyPath
from pdctl.topology.model import MODULE_NAME, NAME_PATTERN, Topology
from pdctl.topology.source import kind_of

_EXPECTED = {
    "int_type": "an integer",
    "int_from_float": "a whole number",
    "int_parsing": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "text",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}
_PATTERNS = {
    NAME_PATTERN: "a name of letters, digits, '.', '_' and '-' (at most 63, starting with a "
    "letter or digit)",
    MODULE_NAME: "a Python module name such as mooncake.engine",
}
_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType) or hasattr(annotation, "__metadata__"):
        for arg in get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def model_at(path: KeyPath) -> type[BaseModel] | None:
    """The model class that validates the mapping at `path`, if it is a model."""
    model: type[BaseModel] | None = Topology
    for part in path:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _model_in(model.model_fields[part].annotation)
    return model


def suggest(word: str, choices: list[str]) -> str | None:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown_key(loc: KeyPath) -> Issue:
    key = str(loc[-1])
    model = model_at(loc[:-1])
    allowed = sorted(model.model_fields) if model else []
    guess = suggest(key, allowed)
    if guess:
        hint = f"did you mean '{guess}'?"
    elif allowed:
        hint = "allowed keys here: " + ", ".join(allowed)
    else:
        hint = None
    return Issue(loc, f"unknown key '{key}'", hint, at_key=True)


def _wrong_type(loc: KeyPath, expected: str, value: Any) -> Issue:
    hint = None
    if isinstance(value, bool) and expected == "text":
        hint = "YAML reads yes/no/on/off/true/false as booleans; quote the value"
    elif isinstance(value, str) and expected in ("an integer", "a number", "true or false"):
        hint = f"remove the quotes: {value}" if value.strip() else None
    elif value is None:
        hint = "the key has no value; give one or remove the key"
    got = "the text" if isinstance(value, str) else kind_of(value)
    shown = f" {value!r}" if isinstance(value, (str, int, float)) and len(repr(value)) < 40 else ""
    return Issue(loc, f"expected {expected}, got {got}{shown}", hint)


def _literal(loc: KeyPath, value: Any, ctx: dict[str, Any]) -> Issue:
    choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
    shown = repr(value) if isinstance(value, str) else kind_of(value)
    guess = suggest(value, choices) if isinstance(value, str) else None
    hint = f"did you mean '{guess}'?" if guess else None
    return Issue(loc, f"{shown} is not one of: {', '.join(choices)}", hint)


def translate(error: ErrorDetails) -> Issue:
    loc: KeyPath = tuple(error["loc"])
    kind = error["type"]
    value = error.get("input")
    ctx: dict[str, Any] = dict(error.get("ctx") or {})
    if loc and loc[-1] == "[key]":
        issue = translate({**error, "loc": loc[:-1]})
        return replace(issue, at_key=True)
    if kind == "extra_forbidden":
        return _unknown_key(loc)
    if kind == "missing":
        return Issue(loc[:-1], f"missing required key '{loc[-1]}'")
    if kind == "literal_error":
        return _literal(loc, value, ctx)
    if kind in _EXPECTED:
        return _wrong_type(loc, _EXPECTED[kind], value)
    if kind in _BOUNDS:
        symbol, name = _BOUNDS[kind]
        return Issue(loc, f"must be {symbol} {ctx.get(name)}, got {value!r}")
    if kind == "string_pattern_mismatch":
        what = _PATTERNS.get(str(ctx.get("pattern")), f"text matching {ctx.get('pattern')}")
        return Issue(loc, f"{value!r} is not {what}")
    if kind == "pdctl":
        message = error["msg"]
        return Issue(loc, message, ctx.get("hint"))
    message = error["msg"]
    if kind == "value_error":
        message = message.removeprefix("Value error, ")
    return Issue(loc, message[:1].lower() + message[1:])


def translate_all(exc: ValidationError) -> list[Issue]:
    return [translate(error) for error in exc.errors(include_url=False)]
