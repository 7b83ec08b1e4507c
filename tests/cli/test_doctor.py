"""`pdctl doctor` reports what was probed, truthfully, and always exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdctl.cli.app import app


def run_doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # A real process: NIXL writes to the file descriptors, which CliRunner cannot capture.
    return subprocess.run(
        [sys.executable, "-m", "pdctl", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_doctor_json_is_clean_and_truthful() -> None:
    result = run_doctor("--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # no library log line leaked into stdout
    transports = report["transports"]
    assert transports["tcp"]["importable"] and transports["tcp"]["same_host_direct"] is True
    assert transports["tcp"]["doorbells"] is True, transports["tcp"]["doorbells_detail"]
    assert transports["mooncake"]["importable"], transports["mooncake"]
    mooncake = transports["mooncake"]
    assert mooncake["tent_built"] is False  # the published CPU wheel has no TENT
    # asked for TENT, the engine itself showed its classic implementation running
    assert mooncake["tent_engine"]["implementation"] == "classic"
    assert "transfer_engine_impl.cpp" in mooncake["tent_engine"]["evidence"]
    assert mooncake["tent_available"] is False and mooncake["tent_engaged"] is False
    assert transports["nixl"]["importable"] and "UCX" in transports["nixl"]["usable_plugins"]
    assert {"nixl.ucx", "triton"} <= set(report["capabilities"])
    assert "mooncake.tent" not in report["capabilities"]
    assert report["devices"]["cpu"] >= 1 and report["torch"].startswith("2.")


def without_tent_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("MC_USE_TENT", "MC_USE_TEV1")}


def test_doctor_says_tent_is_not_available_when_not_asked() -> None:
    plain = run_doctor(env=without_tent_variables())
    assert plain.returncode == 0
    assert "TENT not available (asked for it, the engine ran its classic" in plain.stdout
    assert "TENT is not engaged" not in plain.stderr


@pytest.mark.parametrize(("name", "value"), [("MC_USE_TENT", "1"), ("MC_USE_TENT", "0"),
                                             ("MC_USE_TEV1", "")])  # fmt: skip
def test_doctor_says_tent_is_not_engaged_from_what_the_engine_ran(name: str, value: str) -> None:
    """Set to any value, "0" and "" included, the variable asks Mooncake for TENT; this
    wheel runs its classic engine anyway, and doctor says so from the engine's log."""
    result = run_doctor(env={**without_tent_variables(), name: value})
    assert result.returncode == 0
    assert "TENT requested, not engaged (the engine ran its classic implementation)" in (
        result.stdout
    )
    assert f"{name} is set, but the Transfer Engine ran its classic implementation" in (
        result.stderr
    )


def test_doctor_is_listed_in_help(cli) -> None:
    assert "doctor" in cli.invoke(app, ["--help"]).stdout


def test_doctor_shows_every_settings_table_with_the_values_in_effect(tmp_path) -> None:
    env = {**os.environ, "PDCTL_NATIVE_DIR": str(tmp_path), "PDCTL_RUN_SECRET": "hush"}
    env["PDCTL_STAGING_GRAPHS"] = "0"  # retired: nothing reads it now, and doctor says so
    result = run_doctor("--json", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["unknown_variables"] == ["PDCTL_STAGING_GRAPHS"]
    tables = report["settings"]
    assert set(tables) == {"handoff", "launch", "serve", "staging"}
    serve = {row["name"]: row for row in tables["serve"]}
    assert serve["switch_interval_us"]["default"] == "500"
    assert serve["bells"]["source"] == "--bells / --no-bells"
    staging = {row["name"]: row for row in tables["staging"]}
    assert staging["native_dir"]["value"] == str(tmp_path)
    secret = {row["name"]: row for row in tables["handoff"]}["PDCTL_RUN_SECRET"]
    assert secret["value"] == "(set)" and "hush" not in result.stdout
    text = run_doctor("-v", env=env).stdout
    assert "serve.notify_at = write  (--notify-at)" in text
    assert f"staging.native_dir = {tmp_path}" in text
    assert "PDCTL_STAGING_GRAPHS is set, but pdctl reads no such variable" in text


def test_a_transport_that_did_not_import_is_named_with_its_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What the text report says of each transport, from reports as the probes give them:
    one that failed names its error (and the fix where the probe has one), one that
    imported its version, lists and abilities."""
    from pdctl.cli import doctor
    from pdctl.console import out
    from pdctl.staging.capabilities import MooncakeReport, NixlReport, TcpReport

    tcp: TcpReport = {"importable": True, "version": "builtin", "protocols": ["tcp"]}
    tcp |= {"same_host_direct": False, "detail": "no pidfd here", "doorbells": False}
    tcp["doorbells_detail"] = "no futex"
    mooncake: MooncakeReport = {"importable": False, "error": "libibverbs.so.1: cannot open"}
    mooncake["fix"] = "apt-get x"
    nixl: NixlReport = {"importable": False, "error": "probe failed: boom"}
    file = out.file
    out.file = sys.stdout  # the console was made before capsys swapped stdout
    try:
        doctor._transports({"tcp": tcp, "mooncake": mooncake, "nixl": nixl})
    finally:
        out.file = file
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "tcp: builtin; protocols: tcp; TCP only; no doorbells: no futex",
        "  no pidfd here",
        "mooncake: not available - libibverbs.so.1: cannot open",
        "  fix: apt-get x",
        "nixl: not available - probe failed: boom",
    ]
