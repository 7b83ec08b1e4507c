"""`pdctl bench soak` on real CPU topologies: small numbers here, the full soak is
10,000 requests at concurrency 64 (docs/benchmarks.md). Each test proves one way the
soak passes or fails: nothing lost, a corrupted transfer, an answer that differs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pdctl.cli.app import app
from pdctl.launch.processes import group_alive
from pdctl.launch.run import Run

REPO = Path(__file__).resolve().parents[2]


def soak(cli, *args: str):
    return cli.invoke(app, ["bench", "soak", *args, "--json", "-", "-q"])


def test_soak_of_the_default_topology(cli) -> None:
    """200 requests, 16 in flight: 0 failed, token-exact, pools back, every process's RSS
    sampled at the warm-up request and at the end. The RSS limit is loose here: 40
    requests are no warm-up (the real soak's limit is 3 % from request 2,000)."""
    result = soak(cli, "--requests", "200", "--concurrency", "16", "--backends", "tcp",
                  "--pool-mb", "0.25", "--rss-limit-pct", "15")  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["topology"] == "cpu-p1d2-tcp"
    (row,) = report["rows"]
    assert row["completed"] == 200 and row["failed"] == 0 and row["mismatches"] == 0, row
    assert row["pools_back"] and row["held"] == [], row
    assert max(row["ring_wraps"].values()) >= 3, row  # the small ring wrapped
    assert row["vocab"] == 512  # the tiny preset's, as the servers report it
    assert 0 < row["latency_ms_p50"] <= row["latency_ms_p99"]
    assert row["rss_warmup_request"] == 40 and row["rss_problems"] == []
    titles = sorted(p["title"].split(":", 2)[-1] for p in row["rss"])
    assert titles == ["decode:tp0", "decode:tp1", "prefill:tp0", "router:tp0"], row["rss"]
    for process in row["rss"]:
        assert process["rss_warm_mib"] > 10 and process["rss_end_mib"] > 10, process
        assert process["threads_warm"] >= 1 and process["threads_end"] >= 1, process
        assert process["growth_pct"] < 15
        assert list(process["trace_mib"]) == [str(n) for n in range(20, 201, 20)]  # tenths


def test_soak_of_mooncake_and_nixl(cli) -> None:
    result = soak(cli, "--requests", "48", "--concurrency", "16", "--unique", "12", "--backends",
                  "mooncake,nixl", "--pool-mb", "0.25", "--rss-limit-pct", "50")  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["skipped"] == {}
    assert [row["transport"] for row in report["rows"]] == ["mooncake", "nixl"]
    for row in report["rows"]:
        assert row["failed"] == 0 and row["mismatches"] == 0 and row["pools_back"], row
        assert len(row["rss"]) == 4 and row["rss_problems"] == [], row


def test_soak_fails_on_a_corrupted_transfer(cli, make_topology) -> None:
    path = make_topology(faults=[{"name": "corrupt-kv", "every": 3}])
    result = soak(cli, str(path), "--requests", "24", "--concurrency", "4", "--unique", "6",
                  "--backends", "tcp")  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "the soak failed: tcp:" in result.stderr and "failed (first:" in result.stderr
    row = json.loads(result.stdout)["rows"][0]
    assert row["failed"] > 0 and "KV corruption" in row["first_failure"] and not row["passed"]
    assert row["pools_back"], row  # failed requests gave everything back too


def test_soak_fails_when_an_answer_differs(cli, make_topology) -> None:
    """Requests that succeed with other tokens (a prefix hit picks the second-best first
    token) are mismatches: the comparison with the reference is not a formality."""
    path = make_topology(faults=["perturb-prefix-hit"])
    result = soak(cli, str(path), "--requests", "24", "--concurrency", "4", "--unique", "6",
                  "--backends", "tcp")  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "answers differ from their reference" in result.stderr
    row = json.loads(result.stdout)["rows"][0]
    assert row["failed"] == 0 and row["mismatches"] > 0 and not row["passed"], row
    mismatch = row["first_mismatch"]
    assert mismatch["got"] != mismatch["expected"] and len(mismatch["got"]) == 8


def test_soak_rejects_a_warmup_past_the_requests(cli) -> None:
    result = soak(cli, "--requests", "10", "--warmup", "20", "--backends", "tcp")
    assert result.exit_code == 2
    assert "--warmup 20 is more than --requests 10" in result.stderr


def test_the_soak_figures_are_named_as_bench_soak_takes_them() -> None:
    """The command hands its figures to `bench_soak` by name: each is one of its
    keywords and one of the command's parameters."""
    import inspect
    from dataclasses import fields

    from pdctl.cli.bench_soak import SoakFigures, soak
    from pdctl.launch.soak import bench_soak

    names = {f.name for f in fields(SoakFigures)}
    assert names <= set(inspect.signature(bench_soak).parameters)
    assert names <= set(inspect.signature(soak).parameters)


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_mid_soak_tears_the_topology_down(tmp_path) -> None:
    """SIGINT while requests are in flight: pdctl exits 130 and no process of the run is
    left (the run's own record names their process groups)."""
    env = {**os.environ, "PDCTL_STATE_DIR": str(tmp_path / "state"), "NO_COLOR": "1"}
    argv = [sys.executable, "-m", "pdctl", "bench", "soak", "--requests", "100000",
            "--concurrency", "8", "--backends", "tcp"]  # fmt: skip
    # as from a terminal: SIGINT at its default (a suite started in the background by a
    # non-interactive shell ignores it, and Python then keeps ignoring it)
    child = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True,
                             preexec_fn=_sigint_default)  # fmt: skip
    try:
        assert child.stderr is not None
        seen = []
        for line in child.stderr:  # ends when the child does
            seen.append(line)
            if "in flight" in line:
                break
        assert any("in flight" in line for line in seen), "".join(seen)
        (record,) = (tmp_path / "state" / "runs").glob("*.json")
        groups = [p["pgid"] for p in json.loads(record.read_text())["processes"]]
        assert len(groups) == 3  # prefill, decode, router
        child.send_signal(signal.SIGINT)
        tail: list[str] = []  # the rest of stderr, read beside a bounded wait
        reader = threading.Thread(target=lambda: tail.append(child.stderr.read()), daemon=True)
        reader.start()
        code = child.wait(timeout=120)
        reader.join(30)
        rest = "".join(tail)
        assert code == 130, rest
        assert "interrupted" in rest
        assert not any(group_alive(pgid) for pgid in groups)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.fixture
def stopped_groups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The process groups of every run the soak stopped (each checked gone after)."""
    groups: list[int] = []
    stop = Run.stop

    def recording(self: Run, grace: float = 5.0) -> list[str]:
        groups.extend(s.spawned.pid for s in self.states if s.spawned is not None)
        left = stop(self, grace)
        assert left == [], left
        return left

    monkeypatch.setattr(Run, "stop", recording)
    return groups


def _nothing_left_running(groups: list[int], runs: int) -> None:
    assert len(groups) == 3 * runs  # prefill, decode, router (TP ranks in their groups)
    assert not any(group_alive(pgid) for pgid in groups)


def _abort_row_is_clean(row: dict) -> None:
    """Aborted requests really were aborted; every other one is exact, no digest failed
    (a late write into memory someone else now holds), every pool came back, and the
    fences that held memory meanwhile were all released on prefill's word."""
    figures = json.dumps({k: v for k, v in row.items() if k not in ("rss",)})
    assert row["aborted"] >= 20, figures
    assert row["failed"] == 0 and row["digest_mismatches"] == 0, figures
    assert row["mismatches"] == 0, figures
    assert row["completed"] == row["requests"] and row["pools_back"], figures
    assert row["fences"]["released"] > 0 and row["fences"]["unconfirmed"] == 0, figures


def test_aborts_mid_transfer_poison_no_page(cli, stopped_groups: list[int]) -> None:
    """Issue 36: decode aborts every other room while prefill's direct page write is in
    flight (it lands after decode gave up), in a KV pool so small that a freed page is
    handed out again at once. Without a fence the late write lands in another request's
    pages: its tokens differ, or its digests do."""
    result = soak(cli, str(REPO / "topologies/cpu-p2d2-tcp.yaml"), "--requests", "160",
                  "--concurrency", "16", "--unique", "8", "--backends", "tcp",
                  "--abort-every", "2", "--rss-limit-pct", "50")  # fmt: skip
    report = json.loads(result.stdout)
    assert report["abort_every"] == 2 and report["decode_pool_tokens"] == 2048
    (row,) = report["rows"]
    _abort_row_is_clean(row)
    assert result.exit_code == 0, result.output
    _nothing_left_running(stopped_groups, 1)


def test_aborts_mid_transfer_poison_no_ring_region(cli, stopped_groups: list[int]) -> None:
    """The same through the staging ring (prefill TP1, decode TP2) on every transport:
    a late write into a region the ring handed to another room fails that room's
    digests, unless the region waits until its writer stopped."""
    result = soak(cli, "--requests", "120", "--concurrency", "16", "--unique", "8",
                  "--backends", "tcp,mooncake,nixl", "--pool-mb", "0.25",
                  "--abort-every", "2", "--rss-limit-pct", "50")  # fmt: skip
    report = json.loads(result.stdout)
    assert report["skipped"] == {}
    assert [row["transport"] for row in report["rows"]] == ["tcp", "mooncake", "nixl"]
    for row in report["rows"]:
        _abort_row_is_clean(row)
    assert result.exit_code == 0, result.output
    _nothing_left_running(stopped_groups, 3)
