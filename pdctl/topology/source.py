"""YAML text -> plain Python data plus a map from key paths to source positions.

PyYAML's safe constructor loses positions and silently keeps the last of two equal
keys. This module composes the node graph itself so that every key and value keeps
its line and column, duplicate keys are errors, and alias bombs or recursive
aliases are refused. It knows nothing about what a topology contains.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any

import yaml

from pdctl.topology.issues import Issue, KeyPath

MAX_NODES = 20_000  # far above any real topology; stops alias expansion bombs
MAX_DEPTH = 64


@dataclass(frozen=True)
class Position:
    line: int  # 1-based
    column: int  # 1-based

    @staticmethod
    def of(mark: yaml.Mark | None) -> Position:
        if mark is None:
            return Position(1, 1)
        return Position(mark.line + 1, mark.column + 1)


@dataclass
class SourceMap:
    """Where each key path's key and value sit in the file."""

    keys: dict[KeyPath, Position] = field(default_factory=dict)
    values: dict[KeyPath, Position] = field(default_factory=dict)

    def locate(self, path: KeyPath, *, prefer_key: bool = False) -> Position:
        """The position of `path`, or of its deepest ancestor present in the file."""
        for end in range(len(path), -1, -1):
            prefix = path[:end]
            table = self.keys if prefer_key and prefix in self.keys else self.values
            if prefix in table:
                return table[prefix]
        return Position(1, 1)


class SourceProblem(Exception):
    """The text is not a YAML document pdctl can read; carries one located issue."""

    def __init__(self, issue: Issue) -> None:
        super().__init__(issue.message)
        self.issue = issue


def _problem(message: str, position: Position, hint: str | None = None) -> SourceProblem:
    return SourceProblem(Issue((), message, hint, line=position.line, column=position.column))


def kind_of(value: Any) -> str:
    """How YAML read a value, in words a topology author recognises."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (date, datetime)):
        return "a date"
    return type(value).__name__


def decode_text(data: bytes) -> str:
    """UTF-8 bytes -> text, with a located error instead of a UnicodeDecodeError."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise _problem(
            f"the file is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
            Position(line, column),
            "save the file as UTF-8",
        ) from None


def _offset_position(text: str, offset: int) -> Position:
    line = text.count("\n", 0, offset) + 1
    return Position(line, offset - (text.rfind("\n", 0, offset) + 1) + 1)


def parse(text: str) -> tuple[Any, SourceMap]:
    """Parse one YAML document, keeping positions. Raises SourceProblem."""
    if "\x00" in text:
        raise _problem("the file contains a NUL byte; it is not a text file", Position(1, 1))
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        if node is None:
            raise _problem(
                "the file is empty",
                Position(1, 1),
                "a topology needs at least `name` and `roles`; copy one from topologies/",
            )
        builder = _Builder(loader)
        data = builder.build(node, ())
        return data, builder.source
    except yaml.reader.ReaderError as exc:
        raise _problem(
            f"the file contains a control character (#x{exc.character:04x}) YAML does not allow",
            _offset_position(text, exc.position),
            "remove it; topology files are plain text",
        ) from None
    except yaml.constructor.ConstructorError as exc:
        found = re.search(r"tag '([^']*)'", exc.problem or "")
        tag = found.group(1).replace("tag:yaml.org,2002:", "!!") if found else ""
        what = f"tag '{tag}'" if found else f"value ({exc.problem})"
        raise _problem(
            f"unsupported YAML {what}",
            Position.of(exc.problem_mark),
            "pdctl reads plain YAML (mappings, lists, text, numbers, booleans); remove the tag",
        ) from None
    except yaml.composer.ComposerError as exc:
        if "expected a single document" in str(exc.context or ""):
            raise _problem(
                "the file holds more than one YAML document; a topology is one document",
                Position.of(exc.problem_mark),
                "remove the `---` line and what follows, or split it into its own file",
            ) from None
        raise _problem(f"YAML error: {exc.problem}", Position.of(exc.problem_mark)) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "invalid YAML"
        raise _problem(f"YAML syntax error: {what}", Position.of(mark)) from None
    except yaml.YAMLError as exc:
        raise _problem(f"YAML error: {exc}", Position(1, 1)) from None
    except RecursionError:
        raise _problem("the document nests too deeply", Position(1, 1)) from None
    finally:
        if loader is not None:
            loader.dispose()


class _Builder:
    """Turns a composed node graph into dicts, lists and scalars."""

    def __init__(self, loader: yaml.SafeLoader) -> None:
        self.loader = loader
        self.source = SourceMap()
        self.count = 0
        self.active: set[int] = set()  # nodes on the current path (recursive aliases)

    def build(self, node: yaml.Node, path: KeyPath) -> Any:
        self.count += 1
        position = Position.of(node.start_mark)
        if self.count > MAX_NODES:
            raise _problem(
                f"the document expands to more than {MAX_NODES} nodes",
                position,
                "anchors and aliases multiply nodes; write the values out",
            )
        if len(path) > MAX_DEPTH:
            raise _problem(f"the document nests deeper than {MAX_DEPTH} levels", position)
        if id(node) in self.active:
            raise _problem("an alias refers to a node that contains it (recursive alias)", position)
        self.source.values[path] = position
        self.active.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                return self._mapping(node, path)
            if isinstance(node, yaml.SequenceNode):
                return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
            return self.loader.construct_object(node, deep=True)
        finally:
            self.active.discard(id(node))

    def _mapping(self, node: yaml.MappingNode, path: KeyPath) -> dict[str, Any]:
        num_explicit = sum(1 for key, _ in node.value if key.tag != "tag:yaml.org,2002:merge")
        self.loader.flatten_mapping(node)  # resolves `<<` merge keys, merged entries first
        num_merged = len(node.value) - num_explicit
        result: dict[str, Any] = {}
        first_seen: dict[str, Position] = {}
        merged: set[str] = set()
        for index, (key_node, value_node) in enumerate(node.value):
            position = Position.of(key_node.start_mark)
            if not isinstance(key_node, yaml.ScalarNode):
                raise _problem(
                    "a mapping key must be a plain name, not a list or mapping", position
                )
            key = self.loader.construct_object(key_node)
            if not isinstance(key, str):
                raise _problem(
                    f"the key {key_node.value!r} is read as {kind_of(key)}, not a name",
                    position,
                    f"quote it: '{key_node.value}'",
                )
            if index < num_merged:
                if key in merged:
                    continue  # several merged mappings: the first one wins (YAML merge spec)
                merged.add(key)
            elif key in merged:
                merged.discard(key)  # an explicit key overrides a merged one
                first_seen.pop(key, None)
            if key in first_seen:
                earlier = first_seen[key]
                raise _problem(
                    f"duplicate key '{key}' (first at line {earlier.line})",
                    position,
                    "YAML keeps only one of them; remove or merge the other",
                )
            first_seen[key] = position
            child = (*path, key)
            self.source.keys[child] = position
            result[key] = self.build(value_node, child)
        return result
