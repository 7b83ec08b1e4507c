"""Loopback topologies listen on loopback only, including what their libraries open."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdctl.launch.listeners import listeners
from pdctl.launch.loopback import confine, is_loopback, shim_library
from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.processes import group_members
from pdctl.launch.run import Run
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("PDCTL_STATE_DIR", str(tmp_path / "state"))
    yield


@pytest.mark.parametrize(
    ("host", "expected"),
    [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("10.0.0.7", False), ("::", False), ("node-3", False)],
)  # fmt: skip
def test_is_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_confine_sets_interfaces_and_preloads_the_shim_keeping_what_was_set() -> None:
    env = {"UCX_NET_DEVICES": "mlx5_0:1", "LD_PRELOAD": "/opt/other.so"}
    assert confine(env, "127.0.0.1") is None
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"  # the topology's own choice wins
    shim, other = env["LD_PRELOAD"].split(":")
    assert Path(shim).is_file() and other == "/opt/other.so"
    confine(env, "127.0.0.1")  # idempotent
    assert env["LD_PRELOAD"].count(shim) == 1


def test_confine_leaves_other_hosts_and_an_opt_out_alone() -> None:
    env: dict[str, str] = {}
    confine(env, "10.0.0.7")
    assert env == {}
    env = {}
    confine(env, "127.0.0.1", shim=False)
    assert "LD_PRELOAD" not in env and env["GLOO_SOCKET_IFNAME"] == "lo"


def test_a_missing_compiler_is_a_warning_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    env: dict[str, str] = {}
    warning = confine(env, "127.0.0.1")
    assert warning is not None and "Mooncake" in warning and "LD_PRELOAD" not in env


PROBE = """
import socket
out = []
CASES = [(socket.AF_INET, "0.0.0.0", None), (socket.AF_INET, "127.0.0.1", None),
         (socket.AF_INET6, "::", 0), (socket.AF_INET6, "::", 1)]
for family, address, v6only in CASES:
    s = socket.socket(family, socket.SOCK_STREAM)
    if v6only is not None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
    s.bind((address, 0))
    out.append(s.getsockname()[0])
print(" ".join(out))
"""


def test_the_shim_rewrites_wildcard_binds_only() -> None:
    env = {**os.environ, "LD_PRELOAD": str(shim_library())}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["127.0.0.1", "127.0.0.1", "::ffff:127.0.0.1", "::1"]
    plain = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    assert plain.stdout.split()[0] == "0.0.0.0"  # without the shim: the wildcard


def test_listeners_reads_this_process_group() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        found = listeners(os.getpgid(0))
    assert any(x.port == port and x.pid == os.getpid() and x.loopback for x in found)


def _run(backend: str, tmp_path: Path) -> Run:
    plan = make_plan(load_checked(REPO / "topologies" / f"cpu-p1d2-{backend}.yaml"))
    return Run(plan, tmp_path / f"run-{backend}")


@pytest.mark.parametrize("backend", ["tcp", "nixl", "mooncake"])
def test_every_listener_of_a_loopback_topology_is_on_loopback(backend: str, tmp_path: Path) -> None:
    run = _run(backend, tmp_path)
    run.start()
    try:
        run.wait_ready(timeout=180)
        found = run.listeners()
        cmdlines = [
            Path(f"/proc/{pid}/cmdline").read_bytes()
            for s in run.states if s.spawned for pid in group_members(s.spawned.pid)
        ]  # fmt: skip
    finally:
        assert run.stop() == []
    assert run.warnings == []
    # the per-run secret travels in the environment only: never argv, never a log
    assert len(cmdlines) >= 4 and not any(run.secret.encode() in c for c in cmdlines)
    assert not any(run.secret in p.read_text(errors="replace") for p in run.dir.glob("*.log"))
    # http + bootstrap + transport + TP rendezvous, at least; all of them on loopback
    assert sum(len(v) for v in found.values()) >= 6
    assert [str(x) for v in found.values() for x in v if not x.loopback] == []


def test_without_the_shim_mooncake_is_caught_listening_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDCTL_LOOPBACK_SHIM", "0")
    run = _run("mooncake", tmp_path)
    run.start()
    try:
        run.wait_ready(timeout=180)
    finally:
        assert run.stop() == []
    exposed = [w for w in run.warnings if "listens beyond loopback" in w]
    assert exposed and all("prefill-0" in w or "decode-0" in w for w in exposed)
