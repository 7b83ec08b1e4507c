"""Staging's settings table (`staging/settings.py`): parsed from an environment only
for the two variables it reads, every row with a default and a reason, and the
hand-off's name the same as the launcher's."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest

from pdctl import settings as pdctl_settings
from pdctl.staging import settings
from pdctl.staging.settings import StagingSettings


def test_the_run_secret_variable_is_the_launchers() -> None:
    assert settings.RUN_SECRET_VAR == pdctl_settings.RUN_SECRET_VAR


def test_the_environment_sets_the_native_dir_and_nothing_else(tmp_path: Path) -> None:
    parsed = StagingSettings.from_environ(
        {settings.NATIVE_DIR_VAR: str(tmp_path), "PDCTL_STAGING_GRAPHS": "0"}
    )
    assert parsed == StagingSettings(native_dir=tmp_path)
    assert parsed.graphs and parsed.library_dir() == tmp_path
    cache = StagingSettings.from_environ({"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert cache.native_dir == tmp_path / "cache" / "pdctl" / "native"


def test_the_run_secret_comes_from_its_variable() -> None:
    assert settings.run_secret({settings.RUN_SECRET_VAR: "abc"}) == b"abc"
    assert settings.run_secret({}) == b""


def test_every_field_has_a_row_with_a_reason() -> None:
    rows = StagingSettings.rows()
    assert [row.name for row in rows] == [item.name for item in fields(StagingSettings)]
    assert all(row.reason and row.source for row in rows)
    switches = [row for row in rows if row.name != "native_dir"]
    assert all(row.default == "on" and row.source == "constructor" for row in switches)
    assert [row.source for row in rows if row.name == "native_dir"] == [
        f"env {settings.NATIVE_DIR_VAR}"
    ]


def test_settings_are_frozen() -> None:
    with pytest.raises(FrozenInstanceError):
        StagingSettings().graphs = False  # type: ignore[misc]
