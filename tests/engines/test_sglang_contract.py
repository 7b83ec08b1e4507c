"""What pdctl renders for `engine: sglang`, checked against the pinned SGLang package.

SGLang cannot serve here (it needs GPUs), but its argument parser and environment table
run on a CPU (`make` installs sglang with --no-deps and what its parser imports): every
command pdctl renders, for every catalog SGLang topology and a generated grid, parses
with SGLang's own parser and builds `ServerArgs`, with the values the topology says;
every SGLANG_* variable pdctl sets is in SGLang's table and parses there; every
endpoint pdctl probes or verify calls is in the route tables of the installed
package's servers. Those tables are read from the package's source: importing its
servers needs torchvision (through sglang.srt.configs), whose operators do not load
beside the CPU torch, and tvm_ffi, so no SGLang server runs here (docs/sglang.md).
SGLang itself is imported only in one child process (`sglang_probe.py`): importing it
changes process-wide Triton state the other tests rely on. A flag SGLang renames
fails here, not on a user's GPU box.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdctl.engines import get_engine
from pdctl.engines.command import PortRef, render_command
from pdctl.engines.sglang import SUPPORTED
from pdctl.launch.plan import LaunchPlan, ProcessPlan, load_checked, make_plan
from tests.conftest import CATALOG, REMOVE

_SPEC = importlib.util.find_spec("sglang")  # found, never imported in this process
assert _SPEC is not None and _SPEC.origin, "sglang is not installed: run `make setup`"
SOURCE = Path(_SPEC.origin).parent / "srt"
PROBE = Path(__file__).with_name("sglang_probe.py")
SGLANG_TOPOLOGIES = [p for p in CATALOG if "engine: sglang" in p.read_text()]
GRID = list(
    itertools.product(
        [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4)],  # prefill TP, decode TP
        [("mooncake", "tcp"), ("mooncake", "rdma"), ("nixl", None)],
        [True, False],  # staging
        ["cuda", "xpu"],
        [1, 2],  # decode replicas
        [True, False],  # deterministic
        [None, 2048],  # serving.max_model_len
    )
)


class SGLangProbe:
    """SGLang's parser and environment table in one child process (sglang_probe.py),
    asked one request at a time."""

    def __init__(self) -> None:
        self.child = subprocess.Popen([sys.executable, str(PROBE)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)  # fmt: skip

    def ask(self, argvs: list[list[str]], env: list[tuple[str, str]]) -> dict[str, Any]:
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(json.dumps({"argvs": argvs, "env": env}) + "\n")
        self.child.stdin.flush()
        line = self.child.stdout.readline()
        assert line, f"the SGLang probe ended (exit {self.child.wait(timeout=60)})"
        answer: dict[str, Any] = json.loads(line)
        assert answer["version"] == SUPPORTED  # the pinned release is the one installed
        return answer

    def close(self) -> None:
        if self.child.stdin is not None:
            self.child.stdin.close()  # the child's loop ends at end of input
        try:
            self.child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()


@pytest.fixture(scope="module")
def sglang() -> Iterator[SGLangProbe]:
    probe = SGLangProbe()
    try:
        yield probe
    finally:
        probe.close()


def fake_ports(command: Any) -> dict[str, int | str]:
    """A number for every port a command names (as launch would allocate them)."""
    keys = sorted({p.key for arg in command for p in arg.parts if isinstance(p, PortRef)})
    return {key: 20000 + i for i, key in enumerate(keys) if not key.endswith(".host")}


def sglang_argv(command: Any) -> tuple[list[str], dict[str, int | str]]:
    ports = fake_ports(command)
    argv = render_command(command, ports)
    assert argv[1:3] == ["-m", "sglang.launch_server"], argv[:3]
    return argv[3:], ports


def expected(plan: LaunchPlan, process: ProcessPlan, ports: dict[str, Any]) -> dict[str, Any]:
    """What ServerArgs must hold for this process, from the topology."""
    topology = plan.topology
    fields: dict[str, Any] = {
        "port": ports[f"{process.name}.http"],
        "disaggregation_mode": process.role,
        "disaggregation_transfer_backend": topology.transfer.backend,
        "tp_size": len(process.ranks),
        "device": topology.device,
        "page_size": topology.serving.page_size,
        "chunked_prefill_size": topology.serving.chunked_prefill_tokens,
        "enable_deterministic_inference": topology.serving.deterministic,
        "enable_metrics": True,  # verify proves the transfer from SGLang's own counters
        "context_length": topology.serving.max_model_len,
    }
    if process.role == "prefill":
        fields["disaggregation_bootstrap_port"] = ports[f"{process.name}.bootstrap"]
    return fields


def check_plans(sglang: SGLangProbe, plans: list[LaunchPlan], references: bool = False) -> None:
    """Every server command of `plans` (and each one's reference) through SGLang."""
    argvs: list[list[str]] = []
    wanted: list[dict[str, Any]] = []
    env: list[tuple[str, str]] = []
    for plan in plans:
        for process in (p for p in plan.processes if p.role != "router"):
            argv, ports = sglang_argv(process.command)
            argvs.append(argv)
            wanted.append(expected(plan, process, ports))
            env += [(e.name, e.value) for e in process.env if e.name.startswith("SGLANG_")]
        if references:
            reference = get_engine("sglang").reference(plan.topology, tp=1)
            argv, ports = sglang_argv(reference.command)
            argvs.append(argv)
            wanted.append({"disaggregation_mode": "null", "port": ports["reference.http"]})
    answer = sglang.ask(argvs, sorted(set(env)))
    for argv, want, got in zip(argvs, wanted, answer["parsed"], strict=True):
        assert "error" not in got, f"SGLang {SUPPORTED} refuses {argv}: {got['error']}"
        assert {k: got[k] for k in want} == want, argv
    for variable in answer["env"]:
        assert variable["known"], f"SGLang {SUPPORTED} has no {variable['name']}"
        assert variable["error"] is None, variable


def test_catalog_commands_parse_with_sglangs_parser(sglang: SGLangProbe) -> None:
    assert SGLANG_TOPOLOGIES, "the catalog has SGLang topologies to check"
    plans = [make_plan(load_checked(path)) for path in SGLANG_TOPOLOGIES]
    check_plans(sglang, plans, references=True)


def grid_topology(make_topology: Any, case: tuple[Any, ...]) -> Path:
    (
        (prefill_tp, decode_tp),
        (backend, protocol),
        staging,
        device,
        replicas,
        deterministic,
        longest,
    ) = case
    transfer: dict[str, Any] = {"backend": backend, "staging": {"enabled": staging}}
    if protocol is not None:
        transfer["protocol"] = protocol
        if protocol == "rdma":
            transfer["ib_devices"] = ["mlx5_0"]
    return make_topology(
        engine="sglang",
        device=device,
        model={"path": "Qwen/Qwen2.5-1.5B-Instruct", "preset": REMOVE},
        roles={"prefill": {"tp": prefill_tp}, "decode": {"tp": decode_tp, "replicas": replicas}},
        transfer=transfer,
        serving={"deterministic": deterministic, "max_model_len": longest},
    )


def test_a_grid_of_topologies_parses_with_sglangs_parser(
    sglang: SGLangProbe, make_topology: Any
) -> None:
    """TP sizes, backends, protocols, staging, devices, replicas, deterministic on and off:
    every server command and the reference's."""
    plans = [make_plan(load_checked(grid_topology(make_topology, case))) for case in GRID]
    check_plans(sglang, plans, references=True)


def test_a_renamed_flag_would_fail_here(sglang: SGLangProbe) -> None:
    """The check can fail: SGLang refuses a flag it does not have, and a bad value."""
    answer = sglang.ask(
        [["--model-path", "m", "--disaggregation-staging-buffer-mb", "64"]],
        [
            ("SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB", "64"),
            ("SGLANG_DISAGG_STAGING_POOL_SIZE_MB", "x"),
        ],
    )
    assert "error" in answer["parsed"][0]
    assert answer["env"][0]["known"] is False and answer["env"][1]["error"] is not None


def decorated_routes(path: Path) -> dict[str, set[str]]:
    """FastAPI routes of a module: `@app.get("/x")`, `@app.api_route("/x", methods=[...])`."""
    routes: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for decorator in node.decorator_list:
            if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
                continue
            verb = decorator.func.attr
            first = decorator.args[0] if decorator.args else None
            if not isinstance(first, ast.Constant) or not isinstance(first.value, str):
                continue
            if verb in ("get", "post", "put", "delete"):
                routes.setdefault(first.value, set()).add(verb.upper())
            elif verb == "api_route":
                methods = next((k.value for k in decorator.keywords if k.arg == "methods"), None)
                listed = ast.literal_eval(methods) if methods is not None else ["GET"]
                routes.setdefault(first.value, set()).update(listed)
    return routes


def aiohttp_routes(path: Path) -> dict[str, set[str]]:
    """aiohttp routes: `router.add_get("/x", ...)`, `router.add_route("*", "/x", ...)`."""
    routes: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, values = node.func.attr, [a.value for a in node.args if isinstance(a, ast.Constant)]
        if name in ("add_get", "add_post", "add_put") and values:
            routes.setdefault(values[0], set()).add(name.removeprefix("add_").upper())
        elif name == "add_route" and len(values) >= 2:
            routes.setdefault(values[1], set()).add(values[0])
    return routes


def test_every_endpoint_pdctl_calls_is_one_sglang_serves(make_topology: Any) -> None:
    http = decorated_routes(SOURCE / "entrypoints" / "http_server.py")
    bootstrap = aiohttp_routes(SOURCE / "disaggregation" / "common" / "conn.py")
    assert bootstrap["/route"] == {"*"} and "GET" in bootstrap["/health"]  # the table was read
    case = ((1, 2), ("mooncake", "tcp"), True, "cuda", 1, True, None)
    plan = make_plan(load_checked(grid_topology(make_topology, case)))
    for process in (p for p in plan.processes if p.role != "router"):
        for probe in process.probes:
            table = bootstrap if probe.port.key.endswith(".bootstrap") else http
            served = table.get(probe.path, set()) & {"GET", "*"}
            assert served, f"{process.name} probes {probe.path}: SGLang {SUPPORTED} has no GET"
    reference = get_engine("sglang").reference(plan.topology, tp=1)
    assert all("GET" in http.get(p.path, set()) for p in reference.probes)
    # what verify calls on the servers of a topology (and of a --url target)
    for path, method in (("/generate", "POST"), ("/flush_cache", "POST"),
                         ("/get_model_info", "GET"), ("/get_server_info", "GET")):  # fmt: skip
        assert method in http.get(path, set()), f"SGLang {SUPPORTED} serves no {method} {path}"


def test_the_transfer_proof_reads_counters_sglang_has() -> None:
    """`engines.proof.SGLangProof` reads prefill's kv_transfer_total_mb histogram (one
    observation per transfer sent) and both sides' num_transfer_failed_reqs_total: the
    metric names are SGLang's, and SGLang updates them where the proof says it does."""
    from pdctl.engines.proof import SGLangProof

    collector = (SOURCE / "observability" / "metrics_collector.py").read_text(encoding="utf-8")
    declared = set(re.findall(r'name="(sglang:[a-z_]+)"', collector))
    assert len(declared) > 50  # the table was read
    for counter in SGLangProof().counters:
        base = counter.metric.removesuffix("_count")  # a histogram's count of observations
        assert base in declared, f"SGLang {SUPPORTED} has no metric {base}"
    histogram = collector[collector.index('name="sglang:kv_transfer_total_mb"') - 200 :]
    assert "Histogram(" in histogram.split("name=")[0]
    prefill = (SOURCE / "disaggregation" / "prefill.py").read_text(encoding="utf-8")
    decode = (SOURCE / "disaggregation" / "decode.py").read_text(encoding="utf-8")
    assert "compute_and_observe_kv_transfer_metrics" in prefill  # prefill observes each send
    assert (
        "increment_transfer_failed_reqs" in prefill and "increment_transfer_failed_reqs" in decode
    )
