"""`pdctl bench staging` runs on the CPU and reports ratios measured in one run."""

from __future__ import annotations

import json

from pdctl.cli.app import app


def test_bench_staging_json_on_cpu(cli) -> None:
    result = cli.invoke(
        app, ["bench", "staging", "--json", "--repeats", "1", "--token-scale", "64"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["device"] == "cpu" and report["target_ratio"] == 0.6
    shapes = [row["shape"] for row in report["results"]]
    assert shapes == [
        "32 x 8 x 128, 4096 tokens, page 1",
        "32 x 8 x 128, 4096 tokens, page 64",
        "28 x 2 x 128, 8192 tokens, page 1",
        "61 x 8 x 128, 16384 tokens, page 64",
    ]
    for row in report["results"]:
        assert row["backend"] == "torch"
        assert row["gather_ratio"] > 0 and row["scatter_ratio"] > 0 and row["copy_gbps"] > 0
        assert row["tokens_run"] % int(row["shape"].rsplit(" ", 1)[1]) == 0


def test_bench_staging_on_a_missing_device_is_a_clear_error(cli) -> None:
    result = cli.invoke(app, ["bench", "staging", "--device", "npu", "--repeats", "1"])
    assert result.exit_code == 2
    assert "cannot run the staging benchmark on npu" in result.stderr
    assert "Traceback" not in result.output


def test_bench_transport_quick_checks_every_byte(cli) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "pdctl", "bench", "transport", "--quick", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["unavailable"] == {}
    variants = {row["variant"] for row in report["rows"]}
    assert variants == {
        "memcpy (ceiling)",
        "tcp (same-host direct)",
        "tcp (socket)",
        "mooncake (tcp)",
        "nixl (ucx)",
    }
    assert all(row["consistent"] for row in report["rows"])
    assert all(row["gbps"] > 0 and row["p99_ms"] >= row["p50_ms"] for row in report["rows"])
    assert {"direct_vs_best_library", "direct_vs_memcpy", "p50_4k_vs_nixl"} <= set(
        report["targets"]
    )
    firsts = [row for row in report["rows"] if row["label"] == "64 MiB, first"]
    assert {row["variant"] for row in firsts} == variants - {"memcpy (ceiling)"}
    assert all(row["connect_ms"] > 0 for row in firsts)  # a fresh endpoint each


def test_bench_pd_compares_pd_with_colocated(cli) -> None:
    """Real processes: the default topology over tcp and nixl, then a colocated server."""
    result = cli.invoke(
        app,
        ["bench", "pd", "--json", "--backends", "tcp,nixl", "--prompts", "2",
         "--prompt-len", "40", "--new-tokens", "3", "--concurrency", "2"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    configs = [row["config"] for row in report["rows"]]
    assert configs == ["PD tcp", "PD nixl", "colocated TP1"]
    for row in report["rows"][:2]:
        # 40 tokens -> 3 pages of 16; 4 layers x K,V x 4 heads x 32 dims x 4 bytes per token
        assert row["kv_bytes_per_request"] == 3 * 16 * 4 * 2 * 4 * 32 * 4
        assert row["digests_ok"] is True and row["staging"] is True
        assert row["write_ms_mean"] > 0 and row["ttft_vs_colocated"] > 0
        parts = row["gather_ms_mean"] + row["digest_ms_mean"]  # parts of the write time
        assert 0 < parts <= row["write_ms_mean"]
        assert "write_vs_bound" not in row  # no device copy to compare with on the CPU
        assert row["concurrent_tokens_per_s_vs_colocated"] > 0
    assert "transfer_ms_p50" not in report["rows"][2]
    assert report["copy_gbps"] is None


def test_bench_pd_rejects_an_unknown_backend(cli) -> None:
    result = cli.invoke(app, ["bench", "pd", "--backends", "tcp,carrier-pigeon"])
    assert result.exit_code == 2
    assert "unknown transport(s) carrier-pigeon" in result.stderr


def test_bench_pd_and_soak_refuse_another_engines_topology(cli) -> None:
    """They read what pdctl's servers report: a vLLM topology is named, never half-run."""
    vllm = "topologies/cpu-vllm-p1d1-nixl.yaml"
    for command in (["bench", "pd", vllm], ["bench", "soak", vllm]):
        result = cli.invoke(app, command)
        assert result.exit_code == 2, result.output
        assert "measures pdctl's own servers; cpu-vllm-p1d1-nixl runs engine vllm" in result.stderr
