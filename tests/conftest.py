"""Shared fixtures: topology factories on tmp_path and the CLI runner."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent

# The order `make test` hands files to its two workers (--dist loadfile with
# --no-loadscope-reorder keeps this order): the real-vLLM file first, about 6 minutes on
# one worker, so that it overlaps the rest of the suite instead of running alone at the
# end; then the files with the most tests first, as xdist's own reordering would, so the
# small ones fill the end.
SLOW_FIRST = ("tests/engines/test_vllm_serving.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    count: dict[str, int] = {}
    for item in items:
        count[file_of(item)] = count.get(file_of(item), 0) + 1
    items.sort(key=lambda item: (not file_of(item).startswith(SLOW_FIRST), -count[file_of(item)]))


CATALOG = sorted((REPO / "topologies").glob("*.yaml"))

BASE_TOPOLOGY: dict[str, Any] = {
    "name": "test-topology",
    "model": {"preset": "tiny"},
    "device": "cpu",
    "roles": {"prefill": {"tp": 1}, "decode": {"tp": 2}},
    "transfer": {"backend": "tcp"},
}


REMOVE = "<remove this key>"  # an override value that deletes the key from the base topology


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if value == REMOVE:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


@pytest.fixture
def make_topology(tmp_path: Path) -> Callable[..., Path]:
    """Write BASE_TOPOLOGY with overrides (nested dicts merge) to a YAML file."""
    counter = iter(range(1_000_000))

    def make(_name: str | None = None, **overrides: Any) -> Path:
        data = deep_merge(BASE_TOPOLOGY, overrides)
        path = tmp_path / f"{_name or 'topology'}-{next(counter)}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        return path

    return make


@pytest.fixture(autouse=True, scope="session")
def private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Runs started by tests are recorded in a private state dir, never the user's."""
    os.environ["PDCTL_STATE_DIR"] = str(tmp_path_factory.mktemp("pdctl-state"))
    # One port reservation table for all xdist workers of this test run (the parent of
    # each worker's base temp is shared), so no two workers are handed the same port.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    os.environ["PDCTL_PORTS_DIR"] = str(shared / "pdctl-ports")


@pytest.fixture
def cli() -> CliRunner:
    return CliRunner()
