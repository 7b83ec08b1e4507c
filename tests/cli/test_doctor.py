"""`pdctl doctor` reports what was probed, truthfully, and always exits 0."""

from __future__ import annotations

import json
import subprocess
import sys

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
    assert transports["mooncake"]["importable"], transports["mooncake"]
    assert transports["mooncake"]["tent_built"] is False  # the published CPU wheel has no TENT
    assert transports["nixl"]["importable"] and "UCX" in transports["nixl"]["usable_plugins"]
    assert {"nixl.ucx", "triton"} <= set(report["capabilities"])
    assert "mooncake.tent" not in report["capabilities"]
    assert report["devices"]["cpu"] >= 1 and report["torch"].startswith("2.")


def test_doctor_warns_when_tent_is_requested_but_missing() -> None:
    import os

    result = run_doctor(env={**os.environ, "MC_USE_TENT": "1"})
    assert result.returncode == 0
    assert "TENT not built in" in result.stdout
    assert "MC_USE_TENT=1 is set but this Mooncake has no TENT engine" in result.stderr


def test_doctor_is_listed_in_help(cli) -> None:
    assert "doctor" in cli.invoke(app, ["--help"]).stdout
