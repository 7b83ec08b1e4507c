"""`pdctl verify` end to end: real topologies, real faults, reports read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest
from junitparser import Error, Failure, JUnitXml, Skipped

from tests.conftest import REPO

PDCTL = [sys.executable, "-m", "pdctl"]
SCHEMA = json.loads((REPO / "docs" / "verify-report.schema.json").read_text())
QUICK = ["--num-prompts", "6", "--max-new-tokens", "4"]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    yield {**os.environ, "PDCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200"}


def verify(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PDCTL, "verify", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def report_of(path: Path) -> dict:
    report = json.loads(path.read_text())
    jsonschema.validate(report, SCHEMA)
    return report


def test_default_topology_passes_with_reports(env: dict[str, str], tmp_path: Path) -> None:
    out, junit = tmp_path / "verify.json", tmp_path / "verify.xml"
    result = verify(env, str(REPO / "topologies/cpu-p1d2-tcp.yaml"), "--serial-compare",
                    "--json", str(out), "--junit", str(junit))  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    assert "PASS" in result.stdout
    kv_line = next(line for line in result.stdout.splitlines() if line.startswith("KV: "))
    assert "12 transfers over tcp (staging, up to" in kv_line and "prefill write p50" in kv_line
    assert float(kv_line.rsplit("= ", 1)[1].removesuffix(" GB/s")) > 0.001, kv_line
    report = report_of(out)
    assert report["verdict"] == "pass" and report["findings"] == []
    names = [p["name"] for p in report["passes"]]
    assert names == ["serial", "serial-repeat", "concurrent", "prefix-hit", "reference"]
    serial = report["passes"][0]["requests"]
    assert len(serial) == 12 and all(r["ok"] for r in serial)
    transfers = [r["kv_transfer"] for r in serial]
    assert all(t["digest_ok"] and t["staging"] and t["transport"] == "tcp" for t in transfers)
    assert max(t["segments"] for t in transfers) >= 4  # the ring-wrap prompt went in segments
    hits = report["passes"][3]["requests"]
    assert hits and all(r["cached_tokens"] > 0 for r in hits)
    assert set(report["phases"]) == {"launch_s", "passes_s", "teardown_s", "total_s"}
    assert report["environment"]["decode-0"] and report["ports"]["router.http"] > 0
    suite = next(iter(JUnitXml.fromfile(str(junit))))
    cases = {case.name: case for case in suite}
    assert set(cases) == {"serial", "serial-repeat", "concurrent", "prefix-hit", "reference",
                          "kv-digests", "kv-transfer"}  # fmt: skip
    assert cases["serial"].is_passed and cases["kv-digests"].is_passed
    # pdctl's servers prove the transfer by digests; no engine accounting to read
    skipped = cases["kv-transfer"].result[0]
    assert isinstance(skipped, Skipped) and "KV digests prove" in skipped.message
    assert isinstance(cases["reference"].result[0], Skipped)
    assert suite.failures == 0 and suite.errors == 0


@pytest.mark.parametrize("name", ["cpu-p1d2-mooncake", "cpu-p1d2-nixl"])
def test_catalog_transports_pass_against_the_colocated_reference(
    env: dict[str, str], tmp_path: Path, name: str
) -> None:
    out = tmp_path / "verify.json"
    result = verify(env, str(REPO / f"topologies/{name}.yaml"), "--reference", *QUICK,
                    "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    report = report_of(out)
    reference = report["passes"][-1]
    assert reference["name"] == "reference" and reference["skipped"] is None
    assert len(reference["requests"]) == 6 and all(r["ok"] for r in reference["requests"])
    assert report["passes"][0]["requests"][0]["kv_transfer"]["transport"] == name.split("-")[-1]


def faulty(make_topology: Callable[..., Path]) -> Path:
    """The default shape with short timeouts, so transfer faults fail fast."""
    return make_topology(
        transfer={"backend": "tcp", "staging": {"pool_size_mb": 2, "segment_size_mb": 0.5},
                  "timeouts": {"bootstrap_s": 3, "transfer_s": 3, "request_s": 20}},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("fault", "classification", "detail"),
    [
        ("corrupt-kv:every=2", "kv-corruption", "in the staging ring, segment 0"),
        ("drop-scatter:every=2", "kv-corruption", "after the scatter of segment 0"),
        ("delay-transfer:every=12,seconds=8", "request-failed", "decode"),
        ("kill-role:role=decode,after=2", "role-died", "decode"),
    ],
)
def test_each_fault_is_caught_and_classified(
    env: dict[str, str], make_topology: Callable[..., Path], tmp_path: Path,
    fault: str, classification: str, detail: str,
) -> None:  # fmt: skip
    out, junit = tmp_path / "verify.json", tmp_path / "verify.xml"
    result = verify(env, str(faulty(make_topology)), "--inject", fault, *QUICK,
                    "--json", str(out), "--junit", str(junit))  # fmt: skip
    report = report_of(out)
    assert result.returncode == 1, (result.stderr, report["findings"], report["passes"])
    assert "FAIL" in result.stdout and "problem(s) found" in result.stderr
    assert report["verdict"] == "fail"
    assert report["settings"]["faults"][0]["name"] == fault.split(":")[0]
    found = [f for f in report["findings"] if f["classification"] == classification]
    assert found, report["findings"]
    if classification == "kv-corruption":
        assert all(f["evidence"]["where"] == detail for f in found), found
        assert all(f["classification"] == "kv-corruption" for f in report["findings"]), found
    else:
        assert any(detail in f["message"] or f["evidence"].get("role") == detail for f in found)
    suite = next(iter(JUnitXml.fromfile(str(junit))))
    failed = [c for c in suite if c.result and isinstance(c.result[0], Failure)]
    assert failed and classification in failed[0].result[0].message
    assert not any(c.result and isinstance(c.result[0], Error) for c in suite)


def test_verify_a_running_topology_and_a_router_url(
    env: dict[str, str], make_topology: Callable[..., Path]
) -> None:
    path = make_topology()
    up = subprocess.run([*PDCTL, "up", str(path), "--detach", "-q"], env=env,
                        capture_output=True, text=True, timeout=180)  # fmt: skip
    assert up.returncode == 0, up.stderr
    try:
        running = verify(env, *QUICK, "--json", "-")
        assert running.returncode == 0, running.stderr
        report = json.loads(running.stdout)
        jsonschema.validate(report, SCHEMA)
        assert report["target"]["mode"] == "running" and report["verdict"] == "pass"
        url = report["target"]["router_url"]
        by_url = verify(env, "--url", url, *QUICK)
        assert by_url.returncode == 0, by_url.stderr
        assert "PASS" in by_url.stdout
        status = subprocess.run([*PDCTL, "status", "--json"], env=env, capture_output=True,
                                text=True, timeout=60)  # fmt: skip
        assert json.loads(status.stdout)[0]["state"] == "up"  # verify left it running
    finally:
        subprocess.run([*PDCTL, "down", "test-topology", "-q"], env=env, timeout=60)


def test_usage_errors_are_clear(env: dict[str, str], make_topology: Callable[..., Path]) -> None:
    nothing_up = verify(env)
    assert nothing_up.returncode == 2
    assert "no topology is up on this host" in nothing_up.stderr
    no_file = verify(env, "--url", "http://127.0.0.1:9", "--inject", "corrupt-kv")
    assert no_file.returncode == 2 and "give the topology file" in no_file.stderr
    unknown = verify(env, str(make_topology()), "--inject", "melt-gpu")
    assert unknown.returncode == 2
    assert "(with --inject)" in unknown.stderr and "faults[0].name" in unknown.stderr
    equal_tp = verify(env, str(make_topology(roles={"prefill": {"tp": 2}, "decode": {"tp": 2}})),
                      "--inject", "drop-scatter")  # fmt: skip
    assert equal_tp.returncode == 2 and "drop-scatter needs staging" in equal_tp.stderr
    assert "Traceback" not in nothing_up.stderr + no_file.stderr + unknown.stderr


def test_an_unrunnable_topology_is_skipped_in_the_reports(
    env: dict[str, str], make_topology: Callable[..., Path], tmp_path: Path
) -> None:
    out, junit = tmp_path / "verify.json", tmp_path / "verify.xml"
    path = make_topology(device="cuda", model={"preset": "tiny", "dtype": "bfloat16"})
    result = verify(env, str(path), "--json", str(out), "--junit", str(junit))
    assert result.returncode == 4, result.stderr
    report = report_of(out)
    assert report["verdict"] == "skipped" and "cuda device" in report["reason"]
    suite = next(iter(JUnitXml.fromfile(str(junit))))
    assert all(isinstance(c.result[0], Skipped) for c in suite)


@pytest.mark.parametrize("deterministic", [True, False])
def test_engine_numerics_are_never_blamed_on_the_kv_path(
    env: dict[str, str], make_topology: Callable[..., Path], tmp_path: Path,
    deterministic: bool,
) -> None:  # fmt: skip
    """An engine that is not invariant to a prefix hit (every server of it, the colocated
    reference too) diverges in the prefix-hit pass with matching digests. The control
    reproduces it without KV transfer: engine-numerics, failing only when the topology
    asked for deterministic serving."""
    path = make_topology(serving={"deterministic": deterministic})
    out, junit = tmp_path / "verify.json", tmp_path / "verify.xml"
    result = verify(env, str(path), "--inject", "perturb-prefix-hit", *QUICK,
                    "--json", str(out), "--junit", str(junit))  # fmt: skip
    report = report_of(out)
    assert result.returncode == (1 if deterministic else 0), (result.stderr, report["findings"])
    findings = report["findings"]
    assert findings and {f["classification"] for f in findings} == {"engine-numerics"}
    assert any(f["pass"] == "prefix-hit" for f in findings)
    for finding in findings:
        control = finding["evidence"]["control"]
        assert control["ran"] and control["output_ids"] != control["baseline_state_output_ids"]
        assert finding["blocking"] is deterministic and "not PD" in finding["message"]
    assert report["settings"]["deterministic"] is deterministic
    every_digest = [r["kv_transfer"]["digest_ok"] for p in report["passes"] for r in p["requests"]
                    if r["kv_transfer"]]  # fmt: skip
    assert every_digest and all(every_digest)
    assert "control (no KV transfer) from 0" in result.stdout
    cases = {case.name: case for case in next(iter(JUnitXml.fromfile(str(junit))))}
    if deterministic:
        assert cases["prefix-hit"].result[0].type == "engine-numerics"
    else:
        assert cases["prefix-hit"].is_passed and "engine numerics" in cases["prefix-hit"].system_out


def test_a_server_without_digests_or_a_big_vocabulary_passes_nothing_by_absence(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A colocated server of a 272-token checkpoint: the workload asks it for its
    vocabulary and context (every request answered), and the JUnit digest case is
    skipped, not passed, since no answer carries a KV digest."""
    from tests.serve.checkpoints import write_checkpoint
    from tests.serve.conftest import start_server

    server = start_server("--model-path", str(write_checkpoint(tmp_path, "llama")))
    try:
        out, junit = tmp_path / "verify.json", tmp_path / "verify.xml"
        result = verify(env, "--url", server.url, *QUICK, "--json", str(out), "--junit",
                        str(junit))  # fmt: skip
        report = report_of(out)
        assert result.returncode == 0, (result.stderr, report["findings"])
        assert report["workload"]["vocab_size"] == 272
        assert all(r["ok"] for p in report["passes"] for r in p["requests"])
        cases = {case.name: case for case in next(iter(JUnitXml.fromfile(str(junit))))}
        (skipped,) = cases["kv-digests"].result
        assert isinstance(skipped, Skipped) and "no KV digests" in skipped.message
    finally:
        server.stop()
