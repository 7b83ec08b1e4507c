"""Verify's tests run their topologies with a small decode ring, as the default topology
does: the workload's segmented and ring-wrap prompts then really segment and wrap, in
a few hundred tokens. With staging's 64 MiB default both are capped at the tiny
model's context (4k tokens, seconds of CPU prefill each) and neither segments."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import deep_merge

SMALL_RING = {"transfer": {"staging": {"pool_size_mb": 2, "segment_size_mb": 0.5}}}


@pytest.fixture
def make_topology(make_topology: Callable[..., Path]) -> Callable[..., Path]:
    """The root factory, with SMALL_RING under whatever a test overrides."""

    def make(_name: str | None = None, **overrides: Any) -> Path:
        return make_topology(_name, **deep_merge(SMALL_RING, overrides))

    return make
