"""The servers' and the router's OpenAPI documents, fuzzed with the real tool.

schemathesis (pinned in pyproject.toml) reads each server's own /openapi.json and
throws every phase at it (examples, coverage, fuzzing, stateful): the router, the
prefill server and a decode server of a PD topology on loopback. None may answer a
server error, a status code or content type its document does not name, or a body
that breaks the document, and none may take longer than the bound the router's
document states. Afterwards the same run verifies token for token with every KV
digest matching: the fuzzing poisoned nothing. The topology keeps requests short
(a KV pool of 1,024 tokens bounds every request's length) and failures quick (3 s
bootstrap and transfer timeouts); each server's run has a time budget, a seed fixes
what it sends.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.run import Run

CHECKS = ",".join(("not_a_server_error", "status_code_conformance", "content_type_conformance",
                   "response_schema_conformance"))  # fmt: skip
BOUND_S = 20  # the topology's transfer.timeouts.request_s: what the router's document states
BUDGET_S = 25  # each server's fuzz run: every phase, cut at this budget (a few hundred cases)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Run, Path]]:
    folder = tmp_path_factory.mktemp("fuzz")
    topology = folder / "fuzz-p1d2-tcp.yaml"
    topology.write_text(
        """
name: fuzz-p1d2-tcp
model: {preset: tiny, dtype: float32}
device: cpu
roles: {prefill: {tp: 1}, decode: {tp: 2}}
transfer:
  backend: tcp
  staging: {pool_size_mb: 2, segment_size_mb: 0.5}
  timeouts: {connect_s: 2, bootstrap_s: 3, transfer_s: 3, request_s: 20}
serving: {kv_pool_tokens: 1024, chunked_prefill_tokens: 128}
"""
    )
    started = Run(make_plan(load_checked(topology)), folder / "run")
    with started.serving():
        yield started, topology


def fuzz(url: str, report: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert tool, "schemathesis is not installed: run `make setup`"
    return subprocess.run(
        [tool, "run", f"{url}/openapi.json", "--checks", CHECKS, "--max-examples", "30",
         "--max-time", str(BUDGET_S),
         "--max-response-time", str(BOUND_S), "--request-timeout", str(BOUND_S + 10),
         "--workers", "1", "--seed", "7", "--no-color", "--report", "junit",
         "--report-junit-path", str(report)],
        capture_output=True, text=True, timeout=600, cwd=report.parent,  # its state stays there
    )  # fmt: skip


@pytest.mark.parametrize("name", ["router", "prefill-0", "decode-0"])
def test_no_server_error_nothing_undocumented(
    run: tuple[Run, Path], name: str, tmp_path: Path
) -> None:
    started, _ = run
    url = started.state(name).url
    document = httpx.get(f"{url}/openapi.json", timeout=10).json()
    operations = [(m, p) for p, ops in document["paths"].items() for m in ops]
    assert len(operations) >= 8
    for path, ops in document["paths"].items():
        for method, operation in ops.items():
            assert "422" not in operation["responses"], (method, path)  # 400 is answered
            if "requestBody" in operation:  # the guards' answers are documented
                assert {"400", "411", "413"} <= set(operation["responses"]), (method, path)
    generate = document["paths"]["/generate"]["post"]
    assert (
        "requestBody" in generate and "text/event-stream" in generate["responses"]["200"]["content"]
    )
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    done = fuzz(url, tmp_path / "fuzz.xml")
    summary = done.stdout[-3000:]
    assert done.returncode == 0, summary
    assert " passed" in summary and "failures" not in summary.split("SUMMARY")[-1], summary


def test_the_router_documents_its_bound_and_refuses_what_it_cannot_forward(
    run: tuple[Run, Path],
) -> None:
    started, _ = run
    document = httpx.get(f"{started.router_url}/openapi.json", timeout=10).json()
    completions = document["paths"]["/v1/completions"]["post"]
    assert completions["x-pdctl-answers-within-s"] == BOUND_S
    assert {"502", "503", "504"} <= set(completions["responses"])
    refused = httpx.get(f"{started.router_url}/v1/models/a%04b", timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == 400
    missing = httpx.get(f"{started.router_url}/v1/models/no%20such%20model", timeout=10)
    assert (
        missing.status_code == 404
        and "no model 'no such model'" in missing.json()["error"]["message"]
    )


def test_a_bootstrap_host_a_url_cannot_carry_is_refused_at_once(run: tuple[Run, Path]) -> None:
    """Found by the fuzzer: a control character in bootstrap_host once left decode's
    receiver dead and the request waiting forever."""
    started, _ = run
    body = {"input_ids": [5], "bootstrap_host": "\x12", "bootstrap_port": 1, "bootstrap_room": 9}
    answer = httpx.post(f"{started.state('decode-0').url}/generate", json=body, timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "bootstrap_host"


def test_nothing_poisoned_after_the_fuzzing(run: tuple[Run, Path], tmp_path: Path) -> None:
    """Runs last in this module (pytest keeps the file's order): the same run, verified."""
    started, _ = run
    report = tmp_path / "verify.json"
    done = subprocess.run(
        [sys.executable, "-m", "pdctl", "verify", "--running", started.name, "--no-reference",
         "--json", str(report)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    verdict = json.loads(report.read_text())
    assert done.returncode == 0, [f["message"] for f in verdict["findings"]]
    assert verdict["verdict"] == "pass"
    transfers = [r["kv_transfer"] for p in verdict["passes"] for r in p["requests"]]
    assert transfers and all(t and t["digest_ok"] for t in transfers)
    ok, held, _ = started.pools_back()
    assert ok, held
