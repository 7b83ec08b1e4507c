"""What pdctl renders for `engine: vllm`, checked against the pinned vLLM and vllm-router.

vLLM lives in an environment of its own (.venv-vllm, `make setup-vllm`; it pins its own
torch), so it is imported only in one child process under that interpreter
(`vllm_probe.py`), never here. What the child checks, with the packages' own code:
every server command pdctl renders, for every catalog vLLM topology, a generated grid
and each one's colocated reference, parses with vLLM's server parser and builds
`AsyncEngineArgs` holding the values the topology says (KV connector and role
included); every VLLM_* variable pdctl sets is in vLLM's environment table and its
getter takes the value; the vllm-router command parses with vllm-router's own parser
and carries the servers' URLs; the bodies verify and the builtin router post are
fields of vLLM's CompletionRequest (its models accept unknown keys and drop them).
What is read from the installed source instead (starting a server needs a model and
minutes): the routes of vLLM's API server that pdctl probes or calls, the Prometheus
counters verify's transfer proof reads, and the KV buffer devices vLLM's NIXL worker
takes. A flag or variable vLLM renames fails here, not on a user's GPU box.
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import math
import re
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pdctl.engines import get_engine
from pdctl.engines.command import PLACEHOLDER, PortSlot, render_command, render_value
from pdctl.engines.proof import VLLMProof
from pdctl.engines.vllm import SUPPORTED, preset_folder
from pdctl.launch.plan import LaunchPlan, load_checked, make_plan
from pdctl.serve.router.vllm_flow import prefill_body
from tests.conftest import CATALOG, REMOVE, REPO

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
if not VLLM_PYTHON.exists():
    pytest.fail(f"{VLLM_PYTHON} is missing: run `make setup-vllm`", pytrace=False)
(SITE,) = (REPO / ".venv-vllm" / "lib").glob("python3.*/site-packages")
SOURCE = SITE / "vllm"
PROBE = Path(__file__).with_name("vllm_probe.py")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ROUTER_MODULE = "vllm_router.launch_router"
COUNTER_CALLS = ("self._counter_cls", "Counter", "prometheus_client.Counter")
ROUTER_PIN = re.search(
    r"^ROUTER_VERSION=(\S+)", (REPO / "scripts" / "setup_vllm.sh").read_text(), re.M
)
VLLM_TOPOLOGIES = [p for p in CATALOG if "engine: vllm" in p.read_text()]
CONNECTORS = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
PLACES = [  # device, backend, nixl_backend (vLLM's MooncakeConnector is refused on cpu)
    ("cpu", "nixl", None), ("cpu", "nixl", "UCX"), ("cuda", "nixl", None),
    ("cuda", "nixl", "UCX"), ("cuda", "mooncake", None), ("xpu", "nixl", None),
    ("xpu", "nixl", "UCX"), ("xpu", "mooncake", None),
]  # fmt: skip
STRUCTURE = [
    (tps, place, deterministic, replicas)
    for tps, place, deterministic, replicas in itertools.product(
        [(1, 1), (1, 2), (2, 1), (2, 2)],  # prefill TP, decode TP
        PLACES,
        [True, False],  # deterministic (refused on cpu)
        [1, 2],  # decode replicas
    )
    if not (deterministic and place[0] == "cpu")
]
KNOBS = list(
    itertools.product(
        [True, False],  # overlap
        [None, 4096],  # kv_pool_tokens
        [None, 1024],  # max_model_len
        [True, False],  # the tiny preset, or a checkpoint path
    )
)
# Each layout with two opposite settings of the knobs (KNOBS[15 - k] flips all four of
# KNOBS[k]): every knob's both values meet every layout, every combination of knobs
# occurs, in 224 topologies rather than the 1792 of the full product.
GRID = [
    (*layout, *KNOBS[k])
    for i, layout in enumerate(STRUCTURE)
    for k in (i % len(KNOBS), len(KNOBS) - 1 - i % len(KNOBS))
]


class VLLMProbe:
    """vLLM's and vllm-router's parsers in one child under .venv-vllm's interpreter."""

    def __init__(self) -> None:
        self.child = subprocess.Popen([str(VLLM_PYTHON), str(PROBE)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)  # fmt: skip

    def ask(self, **request: Any) -> dict[str, Any]:
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(json.dumps(request) + "\n")
        self.child.stdin.flush()
        line = self.child.stdout.readline()
        assert line, f"the vLLM probe ended (exit {self.child.wait(timeout=60)})"
        answer: dict[str, Any] = json.loads(line)
        assert answer["version"] == SUPPORTED  # the pinned release is the one installed
        assert ROUTER_PIN and answer["router_version"] == ROUTER_PIN.group(1)
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
def vllm() -> Iterator[VLLMProbe]:
    probe = VLLMProbe()
    try:
        yield probe
    finally:
        probe.close()


def fake_ports(slots: Iterable[PortSlot]) -> dict[str, int | str]:
    """A number for every port of a plan (as launch would allocate them)."""
    return {slot.key: 20000 + i for i, slot in enumerate(slots)}


def plan_ports(plan: LaunchPlan) -> dict[str, int | str]:
    return fake_ports(slot for process in plan.processes for slot in process.ports)


@functools.cache
def resolved(path: str) -> Path:
    return Path(path).resolve()


def launched(command: Any, ports: dict[str, int | str], module: str) -> list[str]:
    """The argv after `python -m module`, checked to be .venv-vllm's python running it."""
    argv = render_command(command, ports)
    wanted = resolved(str(VLLM_PYTHON))
    assert resolved(argv[0]) == wanted and argv[1:3] == ["-m", module], (argv[:3], wanted)
    return argv[3:]


def expected(
    plan: LaunchPlan, name: str, role: str | None, tp: int, ports: dict[str, int | str]
) -> dict[str, Any]:
    """What vLLM must make of a server's command (role None: the colocated reference)."""
    topology, serving = plan.topology, plan.topology.serving
    model, transfer = topology.model, topology.transfer
    extra = [*serving.args, *(getattr(topology.roles, role).args if role else [])]
    kv = None
    if role is not None:
        kv = {
            "kv_connector": CONNECTORS[transfer.backend],
            "kv_role": KV_ROLES[role],
            "kv_buffer_device": topology.device,
            "kv_load_failure_policy": "fail",  # never recompute in silence
            "kv_connector_extra_config": (
                {"backends": [transfer.nixl_backend]} if transfer.nixl_backend else {}
            ),
        }
    pool = serving.kv_pool_tokens
    return {
        "host": topology.host,
        "port": ports[f"{name}.http"],
        "model": str(preset_folder(topology)) if model.uses_preset else model.path,
        "served_model_name": [model.preset if model.uses_preset else Path(model.path).name],
        "tensor_parallel_size": tp,
        "dtype": topology.effective_dtype,
        "seed": model.seed,
        "block_size": serving.page_size,
        "max_num_seqs": serving.max_running_requests,
        "max_num_batched_tokens": serving.chunked_prefill_tokens,
        "max_model_len": serving.max_model_len,
        "num_gpu_blocks_override": None if pool is None else math.ceil(pool / serving.page_size),
        "async_scheduling": None if serving.overlap else False,  # None: vLLM's choice
        "enable_prefix_caching": True,  # verify's prefix-hit pass
        "enable_prompt_tokens_details": True,  # verify reads cached tokens
        "enforce_eager": "--enforce-eager" in extra,
        "kv_transfer_config": kv,
    }


def filled_env(
    entries: Iterable[Any], ports: dict[str, int | str], name: str
) -> set[tuple[str, str]]:
    """The variables as launch sets them: ports and the server's folder filled in."""
    values = {**ports, "workdir": f"/tmp/pdctl-run/{name}"}
    return {(entry.name, render_value(entry.value, values)) for entry in entries}


Problem = tuple[str, str]  # (its kind, one instance of it)


def differences(who: str, argvs: list, wanted: list, parsed: list) -> list[Problem]:
    """Each argv the parser refused, or whose parsed values are not the wanted ones."""
    problems = []
    for argv, want, got in zip(argvs, wanted, parsed, strict=True):
        if "error" in got:
            problems.append((got["error"], f"{who} refuses {argv}: {got['error']}"))
        elif {key: got[key] for key in want} != want:
            wrong = {key: (want[key], got[key]) for key in want if got[key] != want[key]}
            problems.append((str(sorted(wrong)), f"{argv}: (topology, {who}) differ: {wrong}"))
    return problems


def report(problems: list[Problem]) -> str:
    """The first instance of each kind of problem, and how many there are of it."""
    kinds: dict[str, list[str]] = {}
    for kind, text in problems:
        kinds.setdefault(kind, []).append(text)
    return "\n".join(f"{texts[0]} ({len(texts)} like it)" for texts in kinds.values())


def check_plans(vllm: VLLMProbe, plans: list[LaunchPlan]) -> None:
    """Every server command and variable of `plans`, and each one's reference's."""
    argvs, wanted, env = [], [], set()
    for plan in plans:
        ports = plan_ports(plan)
        for process in (p for p in plan.processes if p.role != "router"):
            tp = getattr(plan.topology.roles, process.role).tp
            argvs.append(launched(process.command, ports, SERVER_MODULE))
            wanted.append(expected(plan, process.name, process.role, tp, ports))
            env |= filled_env(process.env, ports, process.name)
        reference = get_engine("vllm").reference(plan.topology, tp=1)
        ports = fake_ports(reference.slots)
        argvs.append(launched(reference.command, ports, SERVER_MODULE))
        wanted.append(expected(plan, "reference", None, 1, ports))
        env |= filled_env(reference.env, ports, "reference")
    answer = vllm.ask(serve=argvs, env=sorted(env), modules=[SERVER_MODULE])
    assert answer["modules"] == [True], f"vLLM {SUPPORTED} has no {SERVER_MODULE}"
    problems = differences(f"vLLM {SUPPORTED}", argvs, wanted, answer["serve"])
    for (name, value), variable in zip(sorted(env), answer["env"], strict=True):
        if name.startswith("VLLM_") and not variable["known"]:
            problems.append((name, f"vLLM {SUPPORTED} has no {name}"))
        if variable["error"] is not None:
            refusal = f"vLLM {SUPPORTED} refuses {name}={value!r}: {variable['error']}"
            problems.append((name, refusal))
        elif name.startswith("VLLM_") and PLACEHOLDER.search(value):
            problems.append((name, f"{name}={value!r}: a placeholder launch does not fill"))
    assert not problems, report(problems)
    assert any(name.startswith("VLLM_") for name, _ in env)  # there were variables to check


def test_catalog_commands_parse_with_vllms_parser(vllm: VLLMProbe) -> None:
    assert VLLM_TOPOLOGIES, "the catalog has vLLM topologies to check"
    check_plans(vllm, [make_plan(load_checked(path)) for path in VLLM_TOPOLOGIES])


def grid_topology(make_topology: Any, case: tuple[Any, ...], **overrides: Any) -> Path:
    (prefill_tp, decode_tp), (device, backend, nixl), deterministic, replicas, *knobs = case
    overlap, pool, max_len, preset = knobs
    transfer = {"backend": backend, **({"nixl_backend": nixl} if nixl else {})}
    model = {"preset": "tiny"} if preset else {"path": "/nonexistent/llama", "preset": REMOVE}
    serving = {"deterministic": deterministic, "overlap": overlap, "kv_pool_tokens": pool,
               "max_model_len": max_len}  # fmt: skip
    if backend == "mooncake":  # the builtin router speaks NixlConnector's flow only
        overrides.setdefault("router", "vllm-router")
    return make_topology(
        engine="vllm", engine_python=str(VLLM_PYTHON), device=device, model=model,
        roles={"prefill": {"tp": prefill_tp}, "decode": {"tp": decode_tp, "replicas": replicas}},
        transfer=transfer | overrides.pop("transfer", {}), serving=serving, **overrides,
    )  # fmt: skip


def test_a_grid_of_topologies_parses_with_vllms_parser(vllm: VLLMProbe, make_topology: Any) -> None:
    """TP sizes, devices, connectors, NIXL plugins, deterministic, overlap, KV pool,
    context length, replicas, preset or path: every server command and the reference's."""
    plans = [make_plan(load_checked(grid_topology(make_topology, case))) for case in GRID]
    check_plans(vllm, plans)


def test_a_renamed_flag_would_fail_here(vllm: VLLMProbe) -> None:
    """The checks can fail: vLLM refuses a flag it does not have (vllm-router's, here) and
    a connector setting it does not know, its table has no retired variable and refuses a
    placeholder left unfilled, vllm-router refuses sglang-router's flag, and a request
    key vLLM would drop is named; the same requests done right pass."""
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    unknown_policy = json.dumps(kv | {"kv_load_failure_policy": "abort"})
    serve = [
        ["--model", "m", "--kv-transfer-config", json.dumps(kv)],
        ["--model", "m", "--kv-connector", "nixl"],
        ["--model", "m", "--kv-transfer-config", unknown_policy],
    ]
    port = "VLLM_NIXL_SIDE_CHANNEL_PORT"
    env = [(port, "20001"), ("VLLM_USE_V1", "1"), (port, "<prefill-0.side>")]
    workers = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    router = [["--vllm-pd-disaggregation", *workers], ["--pd-disaggregation", *workers]]
    completions = [{"prompt": [1], "max_tokens": 2}, {"prompt": [1], "max_new_tokens": 2}]
    answer = vllm.ask(serve=serve, env=env, router=router, completions=completions)
    good, unknown_flag, unknown_value = answer["serve"]
    assert "error" not in good and good["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert "error" in unknown_flag and "error" in unknown_value
    known_and_taken = [(v["known"], v["error"] is None) for v in answer["env"]]
    assert known_and_taken == [(True, True), (False, True), (True, False)]
    assert "error" not in answer["router"][0] and "error" in answer["router"][1]
    assert [c["unknown"] for c in answer["completions"]] == [[], ["max_new_tokens"]]


def bootstrap_port(process: Any, ports: dict[str, int | str]) -> int | None:
    """Where the prefill server's MooncakeConnector serves its engine ids (its
    VLLM_MOONCAKE_BOOTSTRAP_PORT): vllm-router's mooncake mode asks there, at the port
    after the --prefill URL (8998, vLLM's default, when none)."""
    value = process.env_values().get("VLLM_MOONCAKE_BOOTSTRAP_PORT")
    return None if value is None else int(render_value(value, ports))


def router_expected(plan: LaunchPlan, ports: dict[str, int | str]) -> dict[str, Any]:
    topology = plan.topology
    urls = {p.name: f"http://{topology.host}:{ports[f'{p.name}.http']}" for p in plan.processes}
    prefill = [p for p in plan.processes if p.role == "prefill"]
    return {
        "host": topology.host,
        "port": ports["router.http"],
        "vllm_pd_disaggregation": True,
        "prefill_urls": [[urls[p.name], bootstrap_port(p, ports)] for p in prefill],
        "decode_urls": [urls[p.name] for p in plan.processes if p.role == "decode"],
        "kv_connector": topology.transfer.backend,
        "prometheus_host": topology.host,
        "prometheus_port": ports["router.metrics"],
        "request_timeout_secs": math.ceil(topology.transfer.timeouts.request_s),
        "worker_startup_check_interval": 1,  # serves as soon as the workers answer
        "worker_startup_timeout_secs": math.ceil(topology.launcher.startup_timeout_s),
    }


def test_vllm_router_parses_the_router_command(vllm: VLLMProbe, make_topology: Any) -> None:
    """The catalog's vllm-router topologies and a grid (layouts, connectors, replicas,
    request timeouts): vllm-router's own parser takes the command, with every server
    (and, with mooncake, where each prefill server's bootstrap listens)."""
    paths = [path for path in VLLM_TOPOLOGIES if "router: vllm-router" in path.read_text()]
    assert paths, "the catalog has a vllm-router topology to check"
    for layout, timeout in itertools.product(STRUCTURE[::3], [120, 30.5]):
        timeouts = {"timeouts": {"request_s": timeout}}
        case = (*layout, *KNOBS[0])
        paths.append(grid_topology(make_topology, case, router="vllm-router", transfer=timeouts))
    plans = [make_plan(load_checked(path)) for path in paths]
    argvs = [launched(plan.router.command, plan_ports(plan), ROUTER_MODULE) for plan in plans]
    wanted = [router_expected(plan, plan_ports(plan)) for plan in plans]
    answer = vllm.ask(router=argvs, modules=[ROUTER_MODULE])
    assert answer["modules"] == [True], f"vllm-router has no {ROUTER_MODULE}"
    problems = differences("vllm-router", argvs, wanted, answer["router"])
    assert not problems, report(problems)


def test_verify_and_the_router_post_what_vllm_reads(vllm: VLLMProbe) -> None:
    """The completions verify sends (with logprobs or not, the canary) and what the
    builtin router sends prefill: every key is a field of vLLM's CompletionRequest."""
    dialect = get_engine("vllm").dialect
    bodies = [
        dialect.request({"input_ids": [1, 2, 3]}, 4, 2)[1],
        dialect.request({"text": "pdctl"}, 4, 0)[1],
        dialect.canary()[1],
    ]
    bodies.append(prefill_body(bodies[0]))
    answer = vllm.ask(completions=bodies)
    for body, got in zip(bodies, answer["completions"], strict=True):
        assert got == {"error": None, "unknown": []}, (body, got)


def declared_routes(path: Path) -> dict[str, set[str]]:
    """A module's routes: `@router.get("/x")` (post, put, delete) and Starlette's
    `Mount("/x", app)`, which takes every method ("*")."""
    routes: dict[str, set[str]] = {}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for call in (d for d in node.decorator_list if isinstance(d, ast.Call)):
                verb = call.func.attr if isinstance(call.func, ast.Attribute) else ""
                if verb in ("get", "post", "put", "delete") and literal(call) is not None:
                    routes.setdefault(literal(call), set()).add(verb.upper())
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "Mount" and literal(node):
            routes.setdefault(literal(node), set()).add("*")
    return routes


def literal(call: ast.Call) -> Any:
    """The call's first argument where it is a string written out, else None."""
    first = call.args[0] if call.args else None
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def dev_routes_need_dev_mode(path: Path) -> bool:
    """Whether the API server registers its development routes under `if
    envs.VLLM_SERVER_DEV_MODE:` (launchers/api_server/routers.py)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "envs.VLLM_SERVER_DEV_MODE":
            calls = [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]
            return "register_vllm_dev_api_routers" in calls
    return False


def test_every_endpoint_pdctl_calls_is_one_vllm_serves(make_topology: Any) -> None:
    """The routes of vLLM's API server are those of its route modules (entrypoints/openai,
    entrypoints/serve); those under serve/dev only with VLLM_SERVER_DEV_MODE=1."""
    entrypoints = SOURCE / "entrypoints"
    served: dict[tuple[str, str], list[str]] = {}  # (path, method) -> declaring modules
    for module in sorted([*(entrypoints / "openai").rglob("*.py"),
                          *(entrypoints / "serve").rglob("*.py")]):  # fmt: skip
        for path, methods in declared_routes(module).items():
            for method in methods:
                served.setdefault((path, method), []).append(str(module.relative_to(SOURCE)))
    assert ("/v1/chat/completions", "POST") in served  # the tables were read
    plan = make_plan(load_checked(grid_topology(make_topology, GRID[0])))
    reference = get_engine("vllm").reference(plan.topology, tp=1)
    servers = [(p.probes, p.env) for p in plan.processes if p.role != "router"]
    servers.append((reference.probes, reference.env))
    dialect = get_engine("vllm").dialect
    calls = {(probe.path, "GET") for probes, _ in servers for probe in probes}
    calls |= {
        (dialect.request({"input_ids": [1]}, 1, 0)[0], "POST"),
        (dialect.canary()[0], "POST"),
        (dialect.flush_path, "POST"),
        ("/metrics", "GET"),  # verify's transfer proof (verify/transfer.py)
    }
    assert {path for path, _ in calls} >= {"/health", "/v1/models", "/v1/completions"}
    for path, method in sorted(calls):
        where = served.get((path, method), []) + served.get((path, "*"), [])
        assert where, f"vLLM {SUPPORTED} serves no {method} {path}"
        if all("/serve/dev/" in module for module in where):  # a development route
            assert dev_routes_need_dev_mode(entrypoints / "launchers/api_server/routers.py")
            for _, env in servers:
                assert ("VLLM_SERVER_DEV_MODE", "1") in {(e.name, e.value) for e in env}, path


def declared_counters(folder: Path) -> tuple[dict[str, set[str]], set[str]]:
    """vLLM's Prometheus counters, `self._counter_cls(name=..., labelnames=...)` (or
    `Counter(...)`), with the label names written out in their labelnames; and every
    string constant of the folder (where the label values are spelt)."""
    counters: dict[str, set[str]] = {}
    constants: set[str] = set()
    for module in folder.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                constants.add(node.value)
            if not isinstance(node, ast.Call) or ast.unparse(node.func) not in COUNTER_CALLS:
                continue
            keywords = {keyword.arg: keyword.value for keyword in node.keywords}
            name, labels = keywords.get("name"), keywords.get("labelnames")
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                written = ast.walk(labels) if labels is not None else ()
                counters[name.value] = {c.value for c in written if isinstance(c, ast.Constant)}
    return counters, constants


def test_the_transfer_proof_reads_counters_vllm_exports() -> None:
    """verify's proof (decode's prompt tokens by source, requests finished) names
    counters vLLM declares, with label names and values it uses; prometheus_client
    exposes a counter `x` as `x_total`."""
    counters, constants = declared_counters(SOURCE / "v1" / "metrics")
    assert "source" in counters["vllm:prompt_tokens_by_source"]  # the table was read
    for counter in VLLMProof().counters:
        assert counter.metric.endswith("_total"), counter
        declared = counters.get(counter.metric.removesuffix("_total"))
        assert declared is not None, f"vLLM {SUPPORTED} declares no counter {counter.metric}"
        for label, value in counter.labels:
            assert label in declared, f"vLLM {SUPPORTED}'s {counter.metric} has no {label}"
            assert value in constants, f"vLLM {SUPPORTED} never labels {label}={value!r}"


def test_nixl_takes_the_kv_buffer_device_pdctl_renders(make_topology: Any) -> None:
    """vLLM's NIXL worker refuses at start a KV buffer device its table does not pair with
    the platform's device (nixl/utils.py): the pairs pdctl renders are in it."""
    utils = SOURCE / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl" / "utils.py"
    supported = next(
        ast.literal_eval(node.value)
        for node in ast.walk(ast.parse(utils.read_text(encoding="utf-8")))
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_NIXL_SUPPORTED_DEVICE"
    )
    assert "cuda" in supported["cuda"]  # the table was read
    for device in ("cpu", "cuda", "xpu"):
        case = ((1, 1), (device, "nixl", None), False, 1, *KNOBS[0])
        plan = make_plan(load_checked(grid_topology(make_topology, case)))
        for process in (p for p in plan.processes if p.role != "router"):
            argv = render_command(process.command)
            config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
            assert config["kv_buffer_device"] in supported[device], (device, config)
