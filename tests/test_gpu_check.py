"""scripts/gpu_check.sh is what a scarce GPU session runs: its plumbing (stage
selection, suite and topology knobs, reports, the transfer table) is checked here on
the CPU, so a broken script never costs device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_the_nightly_stage_runs_a_suite_and_writes_its_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    venv_bin = str(Path(sys.executable).parent)  # `python3` in the script is this one
    env = {
        **os.environ,
        "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
        "OUT": str(out),
        "STAGES": "nightly",
        "SUITE": "default",
        "TOPOLOGIES": "topologies/cpu-p1d2-tcp.yaml",
        "NIGHTLY_TIMEOUT": "300",
        "DEVICE": "cpu",
        "CARRIED": "0",  # the wheels a developer carries for the device are not for here
    }
    result = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=420)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {"machine.txt", "nightly.json", "nightly.xml", "kv-transfer.md"} <= {
        p.name for p in out.iterdir()
    }
    summary = json.loads((out / "nightly.json").read_text())
    assert summary["verdict"] == "pass" and summary["counts"] == {"pass": 1}, summary["counts"]
    table = (out / "kv-transfer.md").read_text().splitlines()
    assert table[0].startswith("| topology | transport | path |"), table
    rows = [line for line in table[2:] if line.startswith("| cpu-p1d2-tcp | tcp | staging |")]
    assert rows and len(rows) == len(table) - 2, table
    assert "torch" in (out / "machine.txt").read_text()
