"""`pdctl up / status / logs / down` as a user runs them: the real binary, real processes."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdctl.launch.processes import group_alive, pid_alive, start_time
from tests.polling import wait_until

PDCTL = [sys.executable, "-m", "pdctl"]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A private state dir, so these runs never meet the user's (or each other's)."""
    yield {**os.environ, "PDCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200"}


def pdctl(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*PDCTL, *args], env=env, capture_output=True, text=True, timeout=timeout)


def runs(env: dict[str, str]) -> list[dict]:
    result = pdctl(env, "status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def recorded_pgids(env: dict[str, str]) -> list[int]:
    """The process groups a run recorded: its processes', and its forkserver's."""
    directory = Path(env["PDCTL_STATE_DIR"]) / "runs"
    records = [json.loads(f.read_text()) for f in directory.glob("*.json")]
    forkservers = [r["forkserver"]["pid"] for r in records if r.get("forkserver")]
    return [p["pgid"] for r in records for p in r["processes"]] + forkservers


def wait_gone(pgids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(group_alive(g) for g in pgids):
        assert time.monotonic() < deadline, f"still alive: {[g for g in pgids if group_alive(g)]}"
        time.sleep(0.1)


def test_up_detach_status_logs_down(
    env: dict[str, str], make_topology: Callable[..., Path], tmp_path: Path
) -> None:
    path = make_topology()
    result = pdctl(env, "up", str(path), "--detach", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert "is up" in result.stdout and "router (router)" in result.stdout
    assert "canary request through the router" in result.stderr
    (run,) = runs(env)
    assert run["state"] == "up" and run["topology"] == "test-topology"
    assert {p["name"]: p["health"] for p in run["processes"]} == {
        "prefill-0": "healthy", "decode-0": "healthy", "router": "healthy",
    }  # fmt: skip
    pgids = recorded_pgids(env)

    logs = pdctl(env, "logs", "test-topology", "decode", "-n", "5")
    assert logs.returncode == 0, logs.stderr
    assert "decode-0-tp0.log" in logs.stdout and "decode-0-tp1.log" in logs.stdout
    missing = pdctl(env, "logs", "test-topology", "encoder")
    assert missing.returncode == 2 and "has no process 'encoder'" in missing.stderr

    follower = subprocess.Popen(
        [*PDCTL, "logs", "test-topology", "router", "-f", "-n", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert follower.stdout is not None and follower.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(follower.stdout), daemon=True)
    reader.start()
    wait_until(lambda: any("router-tp0.log" in line for line in lines), 30, "logs -f to follow")
    down = pdctl(env, "down", "test-topology")
    assert down.returncode == 0, down.stderr
    follower.wait(timeout=10)  # -f ends by itself once the run is down
    reader.join(10)
    err = follower.stderr.read()
    assert "has stopped" in err, err
    assert "stopped " in down.stderr
    assert not any(group_alive(g) for g in pgids)
    assert runs(env) == []
    assert json.loads((tmp_path / "run" / "run.json").read_text())["canary"]["output_ids"]


def test_two_copies_of_one_topology_at_once(
    env: dict[str, str], make_topology: Callable[..., Path]
) -> None:
    path = make_topology()
    starts = [
        subprocess.Popen(
            [*PDCTL, "up", str(path), "--detach", "-q"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for process in starts:
        _, err = process.communicate(timeout=180)
        assert process.returncode == 0, err
    both = runs(env)
    assert len(both) == 2 and all(r["state"] == "up" for r in both)
    urls = [p["url"] for r in both for p in r["processes"]]
    assert len(set(urls)) == len(urls)  # no port shared
    pgids = recorded_pgids(env)
    assert pdctl(env, "down", "test-topology").returncode == 0  # both copies, by topology
    assert not any(group_alive(g) for g in pgids)


def test_a_role_crashing_at_startup_fails_fast_with_its_log(
    env: dict[str, str], make_topology: Callable[..., Path]
) -> None:
    path = make_topology(roles={"decode": {"tp": 1, "args": ["--no-such-flag"]}})
    started = time.monotonic()
    result = pdctl(env, "up", str(path))
    assert time.monotonic() - started < 30
    assert result.returncode == 3, result.stderr
    assert "decode-0 (decode, pid" in result.stderr and "exited with 2" in result.stderr
    assert "unrecognized arguments: --no-such-flag" in result.stderr
    assert runs(env) == []


def test_a_taken_fixed_port_is_refused(
    env: dict[str, str], make_topology: Callable[..., Path]
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        path = make_topology(roles={"prefill": {"tp": 1, "bootstrap_port": port}})
        result = pdctl(env, "up", str(path))
    assert result.returncode == 3
    assert (
        f"port {port} (bootstrap endpoint for decode, prefill-0.bootstrap) is already in use"
        in (result.stderr)
    )


def test_a_topology_this_machine_cannot_run_is_skipped(
    env: dict[str, str], make_topology: Callable[..., Path]
) -> None:
    path = make_topology(device="cuda", model={"preset": "tiny", "dtype": "bfloat16"})
    result = pdctl(env, "up", str(path))
    assert result.returncode == 4, result.stderr
    assert "cannot run on this machine: needs 3 cuda device(s), this machine has 0" in (
        result.stderr
    )


def start_blocking(env: dict[str, str], path: Path) -> subprocess.Popen:
    process = subprocess.Popen(
        [*PDCTL, "up", str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        listed = runs(env)
        if listed and listed[0]["state"] == "up":
            state = next((Path(env["PDCTL_STATE_DIR"]) / "runs").glob("*.json"))
            if json.loads(state.read_text()).get("canary"):
                return process
        time.sleep(0.3)
    process.kill()
    raise TimeoutError("pdctl up did not come up")


def all_pids(env: dict[str, str]) -> list[tuple[int, int | None]]:
    """Every process of the run, TP ranks included, with start times."""
    pgids = recorded_pgids(env)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) in pgids:
                    found.append((int(entry), start_time(int(entry))))
            except ProcessLookupError:
                continue
    return found


def assert_all_gone(pids: list[tuple[int, int | None]], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p, t in pids if pid_alive(p, t)]
        if not alive:
            return
        assert time.monotonic() < deadline, f"survivors: {alive}"
        time.sleep(0.1)


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"]
)
def test_no_process_survives_pdctl(
    env: dict[str, str], make_topology: Callable[..., Path], signum: int
) -> None:
    process = start_blocking(env, make_topology())
    pids = all_pids(env)
    assert len(pids) == 5  # prefill, decode rank 0 and 1, router; the forkserver
    process.send_signal(signum)
    _, err = process.communicate(timeout=30)
    if signum != signal.SIGKILL:
        assert process.returncode == 0, err
        assert f"{signal.Signals(signum).name}: stopped test-topology" in err
    assert_all_gone(pids)
    # after SIGKILL the record is left behind; status sees it is stale and cleans it
    assert runs(env) == [] or all(r["state"] == "stale" for r in runs(env))
    assert runs(env) == []


def test_a_process_killed_while_up_stops_the_run(
    env: dict[str, str], make_topology: Callable[..., Path]
) -> None:
    process = start_blocking(env, make_topology())
    pids = all_pids(env)
    decode = next(p for r in runs(env) for p in r["processes"] if p["name"] == "decode-0")
    os.killpg(decode["pid"], signal.SIGKILL)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 3
    assert f"decode-0 (decode, pid {decode['pid']}) killed by SIGKILL" in err
    assert "decode-0-tp0.log" in err  # the log tail follows
    assert_all_gone(pids)


def test_stale_records_are_reported_and_never_signalled(env: dict[str, str]) -> None:
    directory = Path(env["PDCTL_STATE_DIR"]) / "runs"
    directory.mkdir(parents=True)
    # a crashed run whose PID now belongs to someone else (this test process)
    record = {
        "name": "20260101-000000-ghost-abcd", "topology": "ghost", "started_at": 0,
        "run_dir": "/nonexistent", "router_url": None,
        "processes": [{"name": "prefill-0", "role": "prefill", "pid": os.getpid(),
                       "pgid": os.getpgid(0), "start_time": 1, "url": "http://127.0.0.1:1"}],
    }  # fmt: skip
    (directory / "ghost.json").write_text(json.dumps(record))
    down = pdctl(env, "down", "ghost")
    assert down.returncode == 0, down.stderr  # nothing alive to stop; this test survived
    (directory / "ghost.json").write_text(json.dumps(record))
    status = pdctl(env, "status")
    assert "no process of this run is alive" in status.stderr
    assert not (directory / "ghost.json").exists()


@pytest.mark.parametrize(
    ("name", "devices"),
    [
        ("xpu-nightly-2-gpu", "2 xpu"),
        ("xpu-manual-nixl-staging", "3 xpu"),
        ("cuda-2gpu-p1d2-mooncake-staging", "2 cuda"),
    ],
)
def test_catalog_accelerator_topologies_skip_cleanly(
    env: dict[str, str], name: str, devices: str
) -> None:
    """SGLang and GPU topologies say what is missing here and start nothing (exit 4)."""
    result = pdctl(env, "up", str(Path(__file__).parents[2] / "topologies" / f"{name}.yaml"))
    assert result.returncode == 4, result.stderr
    assert f"{name} cannot run on this machine: needs " in result.stderr
    assert f"needs {devices} device(s), this machine has 0" in result.stderr
    if name.startswith("xpu"):  # make installs SGLang (its parser, for the contract tests)
        missing = importlib.util.find_spec("sglang") is None
        assert ("needs the Python module sglang (engine: sglang)" in result.stderr) is missing
    assert "Traceback" not in result.stderr
    assert runs(env) == []


def test_a_checkpoint_the_servers_cannot_load_is_one_line_in_the_log_tail(
    env: dict[str, str], make_topology: Callable[..., Path], tmp_path: Path
) -> None:
    """config.json passes validate, but the checkpoint has no tokenizer: `pdctl up`
    ends naming the server, and its log tail says what is wrong, not a traceback."""
    from tests.conftest import REMOVE
    from tests.serve.checkpoints import write_checkpoint

    checkpoint = write_checkpoint(tmp_path, "llama")
    (checkpoint / "tokenizer.json").unlink()
    path = make_topology(model={"path": str(checkpoint), "preset": REMOVE})
    result = pdctl(env, "up", str(path))
    assert result.returncode == 3, result.stderr
    assert f"tp0: {checkpoint}: no tokenizer.json" in result.stderr
    assert "Traceback" not in result.stderr
    assert runs(env) == []
