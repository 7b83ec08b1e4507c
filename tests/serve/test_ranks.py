"""Rank 0's other ranks: forked on the CPU once the modules are imported, spawned on an
accelerator; a forked rank is held like a spawned one (poll, wait, signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdctl.serve.args import parse
from pdctl.serve.ranks import ForkedRank, fork_ranks, forks_ranks
from pdctl.serve.settings import Handoff

TINY = ["--role", "decode", "--port", "1", "--model-preset", "tiny"]


@pytest.mark.parametrize(
    ("extra", "forks"),
    [
        (["--tp", "2"], True),
        (["--tp", "4", "--device", "cpu"], True),
        (["--tp", "2", "--no-fork-ranks"], False),
        (["--tp", "2", "--device", "cuda"], False),  # a driver cannot cross a fork
        (["--tp", "2", "--device", "xpu"], False),
        (["--tp", "1"], False),  # no other rank
        (["--tp", "2", "--tp-rank", "1"], False),  # only rank 0 starts them
    ],
)
def test_forks_only_on_the_cpu_from_rank_0(extra: list[str], forks: bool) -> None:
    assert forks_ranks(parse([*TINY, *extra])) is forks


def _fork_child(code: str) -> ForkedRank:
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.execv(sys.executable, [sys.executable, "-c", code])
    return ForkedRank(pid)


def test_a_forked_rank_reports_its_exit_as_popen_does() -> None:
    child = _fork_child("import sys; sys.exit(3)")
    assert child.wait(timeout=30) == 3
    assert child.poll() == 3 and child.returncode == 3

    sleeper = _fork_child("import time; time.sleep(60)")
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.05)
    sleeper.send_signal(signal.SIGKILL)
    assert sleeper.wait(timeout=30) == -signal.SIGKILL  # a signal, negative, as Popen
    sleeper.send_signal(signal.SIGKILL)  # ended: nothing to signal, no error


def test_fork_ranks_gives_each_rank_its_number_and_log(tmp_path) -> None:
    """Ranks 1..3 forked: each child knows its rank and writes its own log; rank 0
    holds the three and sees them end."""
    rank, children = fork_ranks(4, Handoff(log_dir=tmp_path, process_name="decode-0"))
    if rank:  # pragma: no cover (a forked rank)
        os.write(1, f"rank {rank} of pid {os.getppid()}\n".encode())  # fd 1: the log
        os._exit(0)
    assert rank == 0 and len(children) == 3
    for child in children:
        assert child.wait(timeout=30) == 0
    for number in (1, 2, 3):
        text = (tmp_path / f"decode-0-tp{number}.log").read_text()
        assert text == f"rank {number} of pid {os.getpid()}\n"


def test_a_forked_rank_dies_with_rank_0(tmp_path) -> None:
    """Rank 0 killed: its forked ranks get SIGKILL from the kernel (no orphans)."""
    marker = tmp_path / "rank1.pid"
    script = f"""
import os, sys, time
sys.path.insert(0, {os.getcwd()!r})
from pdctl.serve.ranks import fork_ranks
from pdctl.serve.settings import Handoff
rank, children = fork_ranks(2, Handoff())
if rank:
    open({str(marker)!r}, "w").write(str(os.getpid()))
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""
    leader = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.read_text()):
            assert time.monotonic() < deadline and leader.poll() is None
            time.sleep(0.05)
        orphan = int(marker.read_text())
    finally:
        leader.kill()
        leader.wait()
    deadline = time.monotonic() + 10
    while _alive(orphan):
        assert time.monotonic() < deadline, "the forked rank outlived rank 0"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
