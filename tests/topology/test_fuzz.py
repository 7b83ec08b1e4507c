"""Hypothesis: no YAML document, byte string or mutated topology produces a traceback.

Every input either loads (and then plans) or raises TopologyError whose issues
carry a position inside the file.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdctl.launch.plan import check_engine, make_plan
from pdctl.topology import TopologyError, load_text
from pdctl.topology.source import decode_text
from tests.conftest import CATALOG

KEYS = [
    "name", "roles", "prefill", "decode", "encoder", "tp", "devices", "replicas", "env", "args",
    "port", "transfer", "backend", "protocol", "staging", "enabled", "pool_size_mb", "device",
    "engine", "model", "preset", "path", "router", "kind", "requires", "verify", "serving",
    "page_size", "MC_USE_TENT", "bootstrap_port", "segment_size_mb", "host", "launcher",
]  # fmt: skip
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["tcp", "mooncake", "nixl", "cuda", "cpu", "xpu", "tiny", "1", "sglang"]),
)
documents = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), children, max_size=5
        ),
    ),
    max_leaves=30,
)


def check_outcome(text: str) -> None:
    lines = text.count("\n") + 1
    try:
        loaded = check_engine(load_text(text, "fuzz.yaml", Path("/nonexistent")))
    except TopologyError as exc:
        assert exc.issues
        for issue in exc.issues:
            assert issue.file == "fuzz.yaml"
            assert issue.line is not None and 1 <= issue.line <= lines + 1
            assert issue.message
        return
    plan = make_plan(loaded)
    plan.to_json({})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_arbitrary_yaml_documents_never_crash(document: Any) -> None:
    check_outcome(yaml.safe_dump(document, allow_unicode=True))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    try:
        text = decode_text(data)
    except Exception as exc:  # decode_text raises only SourceProblem
        assert type(exc).__name__ == "SourceProblem"
        return
    check_outcome(text)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("{}[]:,-&*!|>'\"#%@` \n\tabc01")), max_size=80))
def test_yaml_punctuation_soup_never_crashes(text: str) -> None:
    check_outcome(text)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


@st.composite
def mutated_topologies(draw: st.DrawFn) -> Any:
    source = draw(st.sampled_from(CATALOG))
    data = yaml.safe_load(source.read_text())
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(data)))
        if not path:
            continue
        parent = data
        for part in path[:-1]:
            parent = parent[part]
        last = path[-1]
        action = draw(st.sampled_from(["replace", "delete", "rename", "add"]))
        if action == "replace":
            parent[last] = draw(documents)
        elif action == "delete":
            del parent[last]
        elif action == "rename" and isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYS))] = parent.pop(last)
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYS))] = draw(documents)
    return copy.deepcopy(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_topologies())
def test_mutated_catalog_topologies_never_crash(document: Any) -> None:
    check_outcome(yaml.safe_dump(document, allow_unicode=True, sort_keys=False))
