"""`pdctl nightly` over a directory of topologies: passes, skips with reasons, failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from junitparser import Error, Failure, JUnitXml, Skipped

from tests.conftest import REPO

PDCTL = [sys.executable, "-m", "pdctl"]
QUICK = ["--num-prompts", "4", "--max-new-tokens", "4"]


def nightly(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PDCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200"}
    return subprocess.run([*PDCTL, "nightly", *args, *QUICK], env=env, capture_output=True,
                          text=True, timeout=400)  # fmt: skip


def suites(junit: Path) -> dict[str, dict[str, object]]:
    """testsuite name -> {testcase name -> result element or None}."""
    found = {}
    for suite in JUnitXml.fromfile(str(junit)):
        found[suite.name.removeprefix("pdctl verify ")] = {
            case.name: (case.result[0] if case.result else None) for case in suite
        }
    return found


def test_a_nightly_passes_skips_and_fails_for_the_right_reasons(
    make_topology: Callable[..., Path], tmp_path: Path
) -> None:
    night = tmp_path / "suite"
    night.mkdir()
    cases = {
        "ok": {"suites": ["night", "green"]},
        "faulty": {"suites": ["night"], "faults": ["corrupt-kv"]},
        "no-module": {"suites": ["night", "green"], "requires": {"modules": ["no_such_mod"]}},
        "few-gpus": {"suites": ["night", "green"], "device": "cuda",
                     "model": {"preset": "tiny", "dtype": "bfloat16"}},
        "wrong-device": {"suites": ["night"], "device": "xpu",
                         "model": {"preset": "tiny", "dtype": "bfloat16"}},
        "elsewhere": {"suites": ["other"]},
    }  # fmt: skip
    for name, overrides in cases.items():
        make_topology(name, name=f"n-{name}", **overrides).rename(night / f"{name}.yaml")
    junit, summary = tmp_path / "nightly.xml", tmp_path / "nightly.json"
    result = nightly(tmp_path, str(night), "--suite", "night", "--junit", str(junit),
                     "--json", str(summary))  # fmt: skip
    assert result.returncode == 1, result.stderr + result.stdout
    assert "1 topology failed: n-faulty" in result.stderr

    data = json.loads(summary.read_text())
    verdicts = {t["name"]: (t["verdict"], t["reason"]) for t in data["topologies"]}
    assert set(verdicts) == {"n-ok", "n-faulty", "n-no-module", "n-few-gpus", "n-wrong-device"}
    assert verdicts["n-ok"] == ("pass", None)
    assert verdicts["n-faulty"] == ("fail", verdicts["n-faulty"][1])
    assert "kv-corruption" in verdicts["n-faulty"][1]
    assert verdicts["n-no-module"][0] == "skipped"
    assert "needs the Python module no_such_mod" in verdicts["n-no-module"][1]
    assert "needs 3 cuda device(s), this machine has 0" in verdicts["n-few-gpus"][1]
    assert "needs 3 xpu device(s), this machine has 0" in verdicts["n-wrong-device"][1]
    assert data["counts"] == {"pass": 1, "fail": 1, "skipped": 3} and data["verdict"] == "fail"

    found = suites(junit)
    assert set(found) == {"n-ok", "n-faulty", "n-no-module", "n-few-gpus", "n-wrong-device"}
    assert all(result is None or isinstance(result, Skipped)
               for result in found["n-ok"].values())  # fmt: skip
    assert found["n-ok"]["serial"] is None and found["n-ok"]["kv-digests"] is None
    digests = found["n-faulty"]["kv-digests"]
    assert isinstance(digests, Failure) and "kv-corruption" in digests.message
    skipped = found["n-few-gpus"]["serial"]
    assert isinstance(skipped, Skipped) and "cuda device" in skipped.message
    assert not any(isinstance(r, Error) for cases in found.values() for r in cases.values())


def test_skips_alone_keep_a_nightly_green(
    make_topology: Callable[..., Path], tmp_path: Path
) -> None:
    night = tmp_path / "suite"
    night.mkdir()
    make_topology("a", name="g-ok", suites=["green"]).rename(night / "a.yaml")
    make_topology("b", name="g-skip", suites=["green"],
                  requires={"modules": ["no_such_mod"]}).rename(night / "b.yaml")  # fmt: skip
    (night / "notes.txt").write_text("not a topology")
    result = nightly(tmp_path, str(night), "--suite", "green", "--json", "-")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["verdict"] == "pass" and data["counts"] == {"pass": 1, "skipped": 1}


def test_an_invalid_file_fails_the_nightly_with_its_location(tmp_path: Path) -> None:
    night = tmp_path / "suite"
    night.mkdir()
    (night / "bad.yaml").write_text("name: bad\nroles: {prefill: {tp: two}, decode: {tp: 1}}\n")
    junit = tmp_path / "n.xml"
    result = nightly(tmp_path, str(night), "--junit", str(junit))
    assert result.returncode == 1
    (suite,) = JUnitXml.fromfile(str(junit))
    (case,) = suite
    assert isinstance(case.result[0], Error) and "invalid topology" in case.result[0].message
    assert "bad.yaml:2:" in case.result[0].message and "prefill" in case.result[0].message


def test_the_four_device_layouts_pass_on_the_cpu(tmp_path: Path) -> None:
    """The gpu-4 layouts (prefill TP2 -> decode TP2, TP1 -> TP4) with the builtin
    transport and Mooncake, run on the CPU as suite `cpu-4`: every pass, KV moved the
    way the layout says, the colocated reference included."""
    out = tmp_path / "night.json"
    result = nightly(tmp_path, str(REPO / "topologies"), "--suite", "cpu-4", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    ran = {entry["name"]: entry for entry in summary["topologies"]}
    assert set(ran) == {"cpu-p2d2-tcp", "cpu-p2d2-mooncake", "cpu-p1d4-tcp-staging",
                        "cpu-p1d4-mooncake-staging"}  # fmt: skip
    for name, entry in ran.items():
        assert entry["verdict"] == "pass", (name, entry["reason"])
        passes = {p["name"]: p for p in entry["report"]["passes"]}
        assert passes["reference"]["skipped"] is None and passes["reference"]["requests"]
        transfers = [r["kv_transfer"] for r in passes["serial"]["requests"]]
        assert all(t["transport"] == name.split("-")[2] for t in transfers)
        assert all(t["digest_ok"] and t["bytes"] > 0 and t["write_ms"] > 0 for t in transfers)
        # equal TP writes pages directly; TP1 -> TP4 gathers each rank's head slice
        assert all(t["staging"] is name.startswith("cpu-p1d4") for t in transfers)
        # pdctl's transport tells a direct room's decode ranks by their doorbells
        bell = name == "cpu-p2d2-tcp"
        assert all(t["notice"] == ("bell" if bell else "message") for t in transfers), name


def test_the_gpu_4_suite_skips_here_naming_the_gpus_it_needs(tmp_path: Path) -> None:
    if _cuda_devices() >= 3:
        pytest.skip("this machine has CUDA devices: the gpu-4 suite would run")
    out = tmp_path / "night.json"
    result = nightly(tmp_path, str(REPO / "topologies"), "--suite", "gpu-4", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    entries = json.loads(out.read_text())["topologies"]
    names = {entry["name"] for entry in entries}
    layouts = {"3gpu-p1d2": 3, "4gpu-p2d2": 4, "4gpu-p1d4": 4}
    for layout in layouts:
        for backend in ("tcp", "mooncake"):
            assert any(name.startswith(f"cuda-{layout}-{backend}") for name in names), layout
    for entry in entries:
        assert entry["verdict"] == "skipped"
        need = layouts.get(entry["name"].removeprefix("cuda-")[:9], 3)
        assert entry["reason"].startswith(f"needs {need} cuda device(s), this machine has")


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def test_an_empty_selection_is_a_usage_error_naming_the_suites(
    make_topology: Callable[..., Path], tmp_path: Path
) -> None:
    night = tmp_path / "suite"
    night.mkdir()
    make_topology("a", name="e-a", suites=["green", "cpu"]).rename(night / "a.yaml")
    result = nightly(tmp_path, str(night), "--suite", "gpu-7")
    assert result.returncode == 2, result.stderr
    assert f"no topology in {night} is tagged 'gpu-7'" in result.stderr
    assert "hint: suites found: cpu, green" in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = nightly(tmp_path, str(empty))
    assert nothing.returncode == 2 and "was found" in nothing.stderr
    assert "Traceback" not in result.stderr + nothing.stderr


def test_the_gpu_1_suite_skips_here_naming_the_gpu_it_needs(tmp_path: Path) -> None:
    if _cuda_devices() >= 1:
        pytest.skip("this machine has a CUDA device: the gpu-1 suite would run")
    out = tmp_path / "night.json"
    result = nightly(tmp_path, str(REPO / "topologies"), "--suite", "gpu-1", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    entries = json.loads(out.read_text())["topologies"]
    backends = {entry["name"].removeprefix("cuda-1gpu-") for entry in entries}
    assert backends == {"p1d1-tcp", "p1d1-mooncake", "p1d1-nixl", "p1d2-tcp-staging"}
    for entry in entries:
        assert entry["verdict"] == "skipped"
        assert entry["reason"].startswith("needs 1 cuda device(s), this machine has 0")
