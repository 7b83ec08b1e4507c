"""`launcher: ray` on a local multi-node Ray cluster: two simulated nodes on this host,
every listener on 127.0.0.1, prefill and decode forced onto different nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdctl.launch.processes import pid_alive
from tests.conftest import REPO

pytest.importorskip("ray")

PDCTL = [sys.executable, "-m", "pdctl"]
# Ray resolves 127.0.0.1 to the host's routable address unless told this host is alone;
# the simulated cluster must stay on loopback (and report nothing anywhere).
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
LIST_ACTORS = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace="pdctl", log_to_driver=False)
print(json.dumps([a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]))
"""


@pytest.fixture(scope="module")
def node_b_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Node b keeps its servers' logs in a folder of its own, as a host that cannot
    write the driver's run directory does: pdctl must fetch them from there."""
    return tmp_path_factory.mktemp("node-b-logs")


@pytest.fixture(scope="module")
def cluster(node_b_logs: Path) -> Iterator[Any]:
    saved = {k: os.environ.get(k) for k in [*RAY_ENV, "PDCTL_NODE_LOG_DIR"]}
    os.environ.update(RAY_ENV)
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=False)
    try:
        nodes.add_node(num_cpus=2, node_ip_address="127.0.0.1", include_dashboard=False,
                       resources={"node-a": 1})  # fmt: skip
        os.environ["PDCTL_NODE_LOG_DIR"] = str(node_b_logs)  # node b's processes inherit it
        nodes.add_node(num_cpus=2, node_ip_address="127.0.0.1", resources={"node-b": 1})
        os.environ.pop("PDCTL_NODE_LOG_DIR")
        nodes.wait_for_nodes()
        yield nodes
    finally:
        nodes.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def env(tmp_path: Path, cluster: Any) -> dict[str, str]:
    return {**os.environ, **RAY_ENV, "PDCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200"}


def topology(tmp_path: Path, cluster: Any, **launcher: Any) -> Path:
    data = yaml.safe_load((REPO / "topologies" / "cpu-p1d2-tcp.yaml").read_text())
    data["name"] = "ray-p1d2"
    data["launcher"] = {
        "kind": "ray",
        "address": cluster.address,
        "run_dir": str(tmp_path / "runs"),
        "resources": {"prefill": {"node-a": 0.01}, "decode": {"node-b": 0.01}},
        **launcher,
    }
    path = tmp_path / "ray.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def pdctl(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*PDCTL, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)  # fmt: skip


def named_actors(cluster: Any, env: dict[str, str]) -> list[str]:
    result = subprocess.run([sys.executable, "-c", LIST_ACTORS, cluster.address], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout.strip().splitlines()[-1]))


def run_record(tmp_path: Path) -> dict[str, Any]:
    [record] = list((tmp_path / "runs").glob("*/run.json"))
    return dict(json.loads(record.read_text()))


def test_verify_with_prefill_and_decode_on_different_nodes(
    cluster: Any, env: dict[str, str], tmp_path: Path, node_b_logs: Path
) -> None:
    out = tmp_path / "verify.json"
    result = pdctl(env, "verify", str(topology(tmp_path, cluster)), "--serial-compare",
                   "--num-prompts", "6", "--max-new-tokens", "4", "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(out.read_text())["verdict"] == "pass"
    record = run_record(tmp_path)
    assert record["launcher"] == "ray"
    nodes = {p["name"]: p["node"]["node_id"] for p in record["processes"]}
    assert nodes["prefill-0"] != nodes["decode-0"]  # placed by the role resources
    assert all(p["node"]["ip"] == "127.0.0.1" for p in record["processes"])
    # every rank's log is in the run directory: decode's (both ranks) copied from node b
    logs = sorted(p.name for p in (tmp_path / "runs").glob("*/*.log"))
    assert logs == ["decode-0-tp0.log", "decode-0-tp1.log", "prefill-0-tp0.log", "router-tp0.log"]
    on_b = {p.name for p in (node_b_logs / record["name"]).glob("*.log")}
    assert {"decode-0-tp0.log", "decode-0-tp1.log"} <= on_b, on_b  # the router may be there too
    copied = (tmp_path / "runs" / record["name"] / "decode-0-tp1.log").read_text()
    assert copied == (node_b_logs / record["name"] / "decode-0-tp1.log").read_text()
    assert "ready on cpu (tp 2" in copied, copied[-500:]
    # teardown: no server process and no actor of the run is left on any node
    assert not any(pid_alive(int(p["pid"])) for p in record["processes"])
    assert not [a for a in named_actors(cluster, env) if a.startswith(record["name"])]


def test_up_detach_status_logs_down(cluster: Any, env: dict[str, str], tmp_path: Path) -> None:
    up = pdctl(env, "up", str(topology(tmp_path, cluster)), "--detach")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "listens beyond loopback" not in up.stderr
    record = run_record(tmp_path)
    try:
        status = json.loads(pdctl(env, "status", "--json").stdout)
        assert status[0]["state"] == "up", status
        assert {p["health"] for p in status[0]["processes"]} == {"healthy"}, status
        assert sorted(named_actors(cluster, env)) == sorted(
            f"{record['name']}/{name}" for name in ("prefill-0", "decode-0", "router")
        )
        # decode runs on node b, whose logs are not in the run directory: read there
        run_dir = Path(record["run_dir"])
        assert not list(run_dir.glob("decode-*.log"))
        logs = pdctl(env, "logs", "ray-p1d2", "decode-0", "--lines", "5")
        assert logs.returncode == 0, logs.stderr
        assert "==> decode-0 (on its node) <==" in logs.stdout and "tp0" in logs.stdout, logs.stdout
        both = pdctl(env, "logs", "ray-p1d2", "--lines", "3")
        assert "(on its node)" in both.stdout and "prefill-0-tp0.log" in both.stdout, both.stdout
    finally:
        down = pdctl(env, "down", "ray-p1d2")
    assert down.returncode == 0, down.stderr
    # `pdctl down` from another process ended the servers, then copied node b's logs here
    assert sorted(p.name for p in run_dir.glob("decode-*.log")) == [
        "decode-0-tp0.log",
        "decode-0-tp1.log",
    ]
    assert not any(pid_alive(int(p["pid"])) for p in record["processes"])
    assert not [a for a in named_actors(cluster, env) if a.startswith(record["name"])]
    assert json.loads(pdctl(env, "status", "--json").stdout) == []


def test_a_run_the_cluster_cannot_place_is_a_clear_error(
    cluster: Any, env: dict[str, str], tmp_path: Path
) -> None:
    path = topology(tmp_path, cluster, startup_timeout_s=5,
                    resources={"decode": {"node-z": 1}})  # fmt: skip
    up = pdctl(env, "up", str(path), "-q")
    assert up.returncode != 0
    assert "cannot place" in up.stderr and "node-z" in up.stderr, up.stderr
    assert "Traceback" not in up.stderr
    assert not [a for a in named_actors(cluster, env) if "ray-p1d2" in a]


def test_address_local_starts_a_loopback_instance(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env.update({"PDCTL_STATE_DIR": str(tmp_path / "state"), "RAY_USAGE_STATS_ENABLED": "0"})
    data = yaml.safe_load((REPO / "topologies" / "cpu-p1d2-tcp.yaml").read_text())
    data["launcher"] = {"kind": "ray", "address": "local", "run_dir": str(tmp_path / "runs")}
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = pdctl(env, "verify", str(path), "--num-prompts", "4", "--max-new-tokens", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    record = run_record(tmp_path)
    assert {p["node"]["ip"] for p in record["processes"]} == {"127.0.0.1"}
    assert not any(pid_alive(int(p["pid"])) for p in record["processes"])
