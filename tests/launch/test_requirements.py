"""The quick CUDA probe (`nvidia-smi`, no torch) against a stand-in nvidia-smi on PATH."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pdctl.launch import requirements
from pdctl.topology.resolve import Requirements


def _fake_smi(folder: Path, output: str, code: int = 0) -> None:
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\nprintf '{output}'\nexit {code}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def smi_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return tmp_path


def test_devices_and_free_memory_come_from_nvidia_smi(smi_path: Path) -> None:
    _fake_smi(smi_path, "0, 81920\\n1, 2048\\n2, 40960\\n")
    assert requirements.cuda_devices() == {
        "devices": {"cuda": 3},
        "device_memory_free_gb": {"cuda": [80.0, 2.0, 40.0]},
    }
    assert requirements.cuda_devices("2,0") == {  # the mask's devices, in its order
        "devices": {"cuda": 2},
        "device_memory_free_gb": {"cuda": [40.0, 80.0]},
    }
    assert requirements.cuda_devices("1,7,0")["devices"] == {"cuda": 1}  # stops at 7, as CUDA


def test_what_nvidia_smi_cannot_answer_is_left_to_doctor(smi_path: Path) -> None:
    _fake_smi(smi_path, "0, 81920\\n")
    assert requirements.cuda_devices("GPU-1234abcd") is None  # a UUID mask
    assert requirements.cuda_devices("5") is None  # nothing visible: let CUDA say
    _fake_smi(smi_path, "garbage\\n")
    assert requirements.cuda_devices() is None
    _fake_smi(smi_path, "", code=9)
    assert requirements.cuda_devices() is None


def test_a_cuda_topology_is_judged_by_the_quick_probe(
    smi_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_smi(smi_path, "0, 10240\\n")
    monkeypatch.setattr(requirements, "machine", lambda: pytest.fail("doctor was asked"))
    needs = Requirements("cuda", 1, 20.0, (), ())
    assert requirements.unmet(needs) == [
        "needs 20 GiB free on each of 1 cuda device(s); free: cuda:0 10 GiB"
    ]
    assert requirements.unmet(Requirements("cuda", 1, None, (), ())) == []
    two = Requirements("cuda", 2, None, (), ())
    assert requirements.unmet(two) == ["needs 2 cuda device(s), this machine has 1"]
