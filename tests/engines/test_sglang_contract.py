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
A flag SGLang renames fails here, not on a user's GPU box.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sglang
from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs

from pdctl.engines import get_engine
from pdctl.engines.base import PortRef, render_command
from pdctl.engines.sglang import SUPPORTED
from pdctl.launch.plan import LaunchPlan, load_checked, make_plan
from tests.conftest import CATALOG, REMOVE

SOURCE = Path(sglang.__file__).parent / "srt"
SGLANG_TOPOLOGIES = [p for p in CATALOG if "engine: sglang" in p.read_text()]


def test_the_pinned_sglang_is_the_one_installed() -> None:
    assert importlib.metadata.version("sglang") == SUPPORTED
    assert SGLANG_TOPOLOGIES, "the catalog has SGLang topologies to check"


def parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def fake_ports(command: Any) -> dict[str, int | str]:
    """A number for every port a command names (as launch would allocate them)."""
    keys = sorted({p.key for arg in command for p in arg.parts if isinstance(p, PortRef)})
    return {key: 20000 + i for i, key in enumerate(keys) if not key.endswith(".host")}


def sglang_argv(command: Any) -> tuple[list[str], dict[str, int | str]]:
    ports = fake_ports(command)
    argv = render_command(command, ports)
    assert argv[1:3] == ["-m", "sglang.launch_server"], argv[:3]
    return argv[3:], ports


def servers(plan: LaunchPlan) -> Iterator[Any]:
    return (p for p in plan.processes if p.role != "router")


def check_process(plan: LaunchPlan, process: Any) -> None:
    topology = plan.topology
    argv, ports = sglang_argv(process.command)
    args = parse(argv)  # SGLang's own parser and ServerArgs: a renamed flag fails here
    assert args.port == ports[f"{process.name}.http"]
    assert args.disaggregation_mode == process.role
    assert args.disaggregation_transfer_backend == topology.transfer.backend
    assert args.tp_size == len(process.ranks) and args.device == topology.device
    assert args.page_size == topology.serving.page_size
    assert args.chunked_prefill_size == topology.serving.chunked_prefill_tokens
    assert args.enable_deterministic_inference is topology.serving.deterministic
    if process.role == "prefill":
        assert args.disaggregation_bootstrap_port == ports[f"{process.name}.bootstrap"]
    for entry in process.env:
        if entry.name.startswith("SGLANG_"):
            variable = getattr(envs, entry.name, None)
            assert variable is not None, f"SGLang {SUPPORTED} has no {entry.name}"
            variable.parse(entry.value)  # the value is one SGLang reads


@pytest.mark.parametrize("path", SGLANG_TOPOLOGIES, ids=[p.stem for p in SGLANG_TOPOLOGIES])
def test_catalog_commands_parse_with_sglangs_parser(path: Path) -> None:
    plan = make_plan(load_checked(path))
    for process in servers(plan):
        check_process(plan, process)


GRID = list(
    itertools.product(
        [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4)],  # prefill TP, decode TP
        [("mooncake", "tcp"), ("mooncake", "rdma"), ("nixl", None)],
        [True, False],  # staging
        ["cuda", "xpu"],
        [1, 2],  # decode replicas
        [True, False],  # deterministic
    )
)


def grid_topology(make_topology: Any, case: tuple[Any, ...]) -> Path:
    (prefill_tp, decode_tp), (backend, protocol), staging, device, replicas, deterministic = case
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
        serving={"deterministic": deterministic},
    )


def test_a_grid_of_topologies_parses_with_sglangs_parser(make_topology: Any) -> None:
    """TP sizes, backends, protocols, staging, devices, replicas, deterministic on and off:
    every server command and the reference's."""
    for case in GRID:
        plan = make_plan(load_checked(grid_topology(make_topology, case)))
        for process in servers(plan):
            check_process(plan, process)
        reference = get_engine("sglang").reference(plan.topology, tp=case[0][0])
        argv, ports = sglang_argv(reference.command)
        args = parse(argv)
        assert args.disaggregation_mode == "null" and args.port == ports["reference.http"]
        assert args.model_path == "Qwen/Qwen2.5-1.5B-Instruct"


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
    case = ((1, 2), ("mooncake", "tcp"), True, "cuda", 1, True)
    plan = make_plan(load_checked(grid_topology(make_topology, case)))
    for process in servers(plan):
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
