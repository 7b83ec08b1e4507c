"""Staging's settings table: its tunables, typed, with their defaults and reasons.

Staging imports nothing else from pdctl, so it keeps a row type of its own (`Row`, the
shape of `pdctl.settings.Setting`). `StagingSettings` is frozen; it is built once and
handed in: to `kernels.captured.CapturedCalls(settings=...)` for the replay switches
(benchmarks and tests build one with a switch off, never an environment variable or a
patched module global), and `native_dir` to `kernels.native.build(directory=...)`.

Two `PDCTL_` variables are read, here only: PDCTL_NATIVE_DIR (a host path: where the
compiled C helpers are cached) and the launcher's hand-off PDCTL_RUN_SECRET. Where a
caller hands nothing in, the process's own values are parsed once, on first use
(`process_settings`), never at import.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

NATIVE_DIR_VAR = "PDCTL_NATIVE_DIR"
# The launcher's hand-off of the per-run secret; must equal pdctl.settings.RUN_SECRET_VAR
# (staging cannot import it; tests/staging/test_settings.py checks the two are equal).
RUN_SECRET_VAR = "PDCTL_RUN_SECRET"


@dataclass(frozen=True)
class Row:
    """One row of the table (the shape of `pdctl.settings.Setting`)."""

    name: str  # the field
    default: str  # as a user would write it; "" for none
    reason: str  # why it exists: what it changes, what was measured
    source: str  # where a value comes from: "env PDCTL_...", or "constructor" for code


def default_native_dir(environ: Mapping[str, str]) -> Path:
    """Where compiled C helpers go without PDCTL_NATIVE_DIR: the user's cache."""
    cache = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "pdctl" / "native"


@dataclass(frozen=True)
class StagingSettings:
    """Staging's tunables. Every switch defaults to the measured fast path; turning one
    off is for a benchmark's side-by-side or a test of the path beneath it."""

    # where the C staging copy and the replay's C call are compiled to, once per source
    # (None: the user's cache, `default_native_dir`)
    native_dir: Path | None = None
    # a checked gather, scatter or mapped write that comes back the same is replayed from
    # a CUDA graph (`kernels.captured`)
    graphs: bool = True
    # a replay's ids copied to the device ahead of its graph, on a stream of the slot's own
    upload_ahead: bool = True
    # inside a graph (no upload ahead), the ids brought by the upload kernel, not a copy node
    upload_kernel: bool = True
    # a replay's driver calls (and its page check) in one call into C (`held_replay`)
    replay_in_c: bool = True

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> StagingSettings:
        """The settings an environment gives: PDCTL_NATIVE_DIR, else the defaults."""
        configured = environ.get(NATIVE_DIR_VAR)
        native_dir = Path(configured) if configured else default_native_dir(environ)
        return cls(native_dir=native_dir)

    def library_dir(self) -> Path:
        """`native_dir`, or the user's cache where it is None."""
        return self.native_dir or default_native_dir(os.environ)

    @staticmethod
    def rows() -> tuple[Row, ...]:
        """The table, for `pdctl doctor` and docs/settings.md."""
        defaults = {item.name: item.default for item in fields(StagingSettings)}
        return tuple(
            Row(name, _shown(defaults.get(name)), reason, _SOURCES.get(name, "constructor"))
            for name, reason in _REASONS.items()
        )


def _shown(default: object) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return "" if default is None or not isinstance(default, (str, int)) else str(default)


# Why each field exists; its value comes from the constructor unless `_SOURCES` says.
_REASONS = {
    "native_dir": (
        "where the C staging copy (`kernels/native.py`) and a replay's C call "
        "(`held_replay.py`) are compiled, once per source version; default "
        "$XDG_CACHE_HOME/pdctl/native (~/.cache/pdctl/native)"
    ),
    "graphs": (
        "a repeated checked call replayed from a CUDA graph: a lookup, the page "
        "check and one launch instead of tens of us of host work; the host-bound 28 x 2 x "
        "128 page-1 gather went from 0.39 to 0.73 of a device copy on the H200 "
        "(`pdctl bench staging`); off: every call eager "
        "(`benchmarks/pd_write_profile.py` times both)"
    ),
    "upload_ahead": (
        "a replay's ids copied by the copy engine ahead of its graph while "
        "the call before still runs: the upload inside the graph cost each replay 5.5 us "
        "of an H200's 65 us on 28 x 2 x 128 (docs/benchmarks.md); off: the upload inside "
        "the graph"
    ),
    "upload_kernel": (
        "inside a graph, the ids brought by a kernel reading mapped host "
        "memory rather than a copy node: 5-9 us less a replay on an H200 "
        "(docs/benchmarks.md); off: a copy node"
    ),
    "replay_in_c": (
        "a replay's five driver calls, its slot's wait and page check in "
        "one call into C: from Python one by one they cost 20-27 us a call on the H200's "
        "host (docs/benchmarks.md; `benchmarks/staging_replay_ab.py` times both); off: "
        "one by one"
    ),
}
_SOURCES = {"native_dir": f"env {NATIVE_DIR_VAR}"}


@functools.cache
def process_settings() -> StagingSettings:
    """This process's settings from its environment, parsed once on first use: for the
    callers that hand none in (`pdctl doctor` names a PDCTL_ variable no table reads)."""
    return StagingSettings.from_environ(os.environ)


def run_secret(environ: Mapping[str, str]) -> bytes:
    """The per-run secret the launcher handed over (empty where none was)."""
    return environ.get(RUN_SECRET_VAR, "").encode()
