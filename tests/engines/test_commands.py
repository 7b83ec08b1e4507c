"""Command-line snapshots: what pdctl would run for each engine and router.

SGLang cannot run on CI machines, so its exact command lines are pinned here.
"""

from __future__ import annotations

import sys

import pytest

from pdctl.engines.base import engine_python
from pdctl.engines.command import render_command, shell_line
from pdctl.launch.plan import LaunchPlan, ProcessPlan, load_checked, make_plan
from tests.conftest import REMOVE, REPO

PY = sys.executable


def plan_of(name: str) -> LaunchPlan:
    return make_plan(load_checked(REPO / "topologies" / f"{name}.yaml"))


def process(plan: LaunchPlan, name: str) -> ProcessPlan:
    return next(p for p in plan.processes if p.name == name)


def line(plan: LaunchPlan, name: str) -> str:
    """The command, with pdctl's interpreter as `python` and the engine's (python3 on
    PATH, or engine_python) as `python3`."""
    text = shell_line(process(plan, name).command, plan.fixed_ports)
    return text.replace(engine_python(plan.topology), "python3").replace(PY, "python")


def test_sglang_staging_prefill_command() -> None:
    plan = plan_of("xpu-nightly-4-gpu-staging")
    assert line(plan, "prefill-0") == (
        "python3 -m sglang.launch_server --model-path Qwen/Qwen2.5-1.5B-Instruct "
        "--host 127.0.0.1 --port '<prefill-0.http>' --disaggregation-mode prefill "
        "--disaggregation-transfer-backend mooncake "
        "--disaggregation-bootstrap-port '<prefill-0.bootstrap>' --tp-size 1 --base-gpu-id 0 "
        "--device xpu --nccl-port '<prefill-0.nccl>' --page-size 16 --max-running-requests 32 "
        "--chunked-prefill-size 512 --random-seed 0 --enable-metrics"
    )


def test_sglang_staging_decode_command_and_env() -> None:
    plan = plan_of("xpu-nightly-4-gpu-staging")
    assert line(plan, "decode-0") == (
        "python3 -m sglang.launch_server --model-path Qwen/Qwen2.5-1.5B-Instruct "
        "--host 127.0.0.1 --port '<decode-0.http>' --disaggregation-mode decode "
        "--disaggregation-transfer-backend mooncake --tp-size 2 --base-gpu-id 0 --device xpu "
        "--nccl-port '<decode-0.nccl>' --dist-init-addr '127.0.0.1:<decode-0.dist>' "
        "--page-size 16 --max-running-requests 32 --chunked-prefill-size 512 --random-seed 0 "
        "--enable-metrics"
    )
    env = process(plan, "decode-0").env_values()
    assert env["ZE_AFFINITY_MASK"] == "1,2"
    assert env["SGLANG_DISAGG_STAGING_BUFFER"] == "1"
    assert env["SGLANG_DISAGG_STAGING_POOL_SIZE_MB"] == "4096"
    assert "SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB" not in env  # SGLang 0.5.23 has no such knob
    assert env["TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER"] == "0"
    assert env["MC_USE_TENT"] == "1" and env["MOONCAKE_PROTOCOL"] == "tcp"
    assert "TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER" not in process(plan, "prefill-0").env_values()


def test_sglang_without_staging_sets_no_staging_env() -> None:
    plan = plan_of("xpu-nightly-2-gpu")
    for name in ("prefill-0", "decode-0"):
        env = process(plan, name).env_values()
        assert "SGLANG_DISAGG_STAGING_BUFFER" not in env
    assert process(plan, "decode-0").env_values()["ZE_AFFINITY_MASK"] == "1"


def test_sglang_nixl_selects_the_plugin_by_env() -> None:
    env = process(plan_of("xpu-manual-nixl-staging"), "decode-0").env_values()
    assert env["SGLANG_DISAGGREGATION_NIXL_BACKEND"] == "UCX"
    assert "--disaggregation-transfer-backend nixl" in line(
        plan_of("xpu-manual-nixl-basic"), "prefill-0"
    )


def test_sglang_router_command() -> None:
    plan = plan_of("xpu-nightly-2-gpu")
    assert line(plan, "router") == (
        "python -m sglang_router.launch_router --pd-disaggregation "
        "--prefill 'http://127.0.0.1:<prefill-0.http>' '<prefill-0.bootstrap>' "
        "--decode 'http://127.0.0.1:<decode-0.http>' --host 127.0.0.1 --port '<router.http>' "
        "--request-timeout-secs 120 --prometheus-host 127.0.0.1 --prometheus-port "
        "'<router.metrics>'"
    )


def test_embedded_decode_command() -> None:
    plan = plan_of("cpu-p1d2-tcp")
    assert line(plan, "decode-0") == (
        "python -m pdctl.serve --role decode --topology-name cpu-p1d2-tcp --replica 0 "
        "--host 127.0.0.1 --port '<decode-0.http>' --tp 2 --dist-port '<decode-0.dist>' "
        "--device cpu --model-preset tiny --dtype float32 --seed 0 --page-size 16 "
        "--max-running-requests 32 --chunked-prefill-tokens 512 --deterministic "
        "--transfer-backend tcp "
        "--transport-ports '<decode-0.transport.tp0>,<decode-0.transport.tp1>' --staging "
        "--staging-pool-mb 2 --staging-segment-mb 0.5 --connect-timeout 10 "
        "--bootstrap-timeout 30 --transfer-timeout 30"
    )


def test_embedded_mooncake_and_builtin_router() -> None:
    plan = plan_of("cpu-p1d2-mooncake")
    assert "--transfer-backend mooncake" in line(plan, "prefill-0")
    assert "--mooncake-protocol tcp" in line(plan, "prefill-0")
    assert line(plan, "router") == (
        "python -m pdctl.serve --role router --topology-name cpu-p1d2-mooncake "
        "--prefill 'http://127.0.0.1:<prefill-0.http>' '<prefill-0.bootstrap>' "
        "--decode 'http://127.0.0.1:<decode-0.http>' --host 127.0.0.1 --port '<router.http>' "
        "--request-timeout 120 --pd-flow bootstrap"
    )


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's cores as pdctl sees them, fixed: plans place servers on them."""
    monkeypatch.setattr("pdctl.engines.vllm_env.available_cores", lambda: (0, 1, 2, 3))


def test_vllm_commands_env_and_builtin_router(four_cores: None) -> None:
    plan = plan_of("cpu-vllm-p1d1-nixl")
    folder = REPO / "runs" / "models" / "tiny-seed0-float32"
    kv = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu",'
    kv += '"kv_load_failure_policy":"fail"}'
    assert line(plan, "prefill-0") == (
        f"python3 -m vllm.entrypoints.openai.api_server --model {folder} "
        "--served-model-name tiny --host 127.0.0.1 --port '<prefill-0.http>' "
        "--tensor-parallel-size 1 --dtype float32 --seed 0 --block-size 32 --max-num-seqs 32 "
        "--max-num-batched-tokens 512 --enable-prefix-caching --enable-prompt-tokens-details "
        f"--max-model-len 2048 --kv-transfer-config '{kv}' --enforce-eager"
    )
    assert plan.engine_python.endswith(".venv-vllm/bin/python")
    env = {p.name: p.env_values() for p in plan.processes}
    assert env["prefill-0"]["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"  # two cores a rank
    assert env["decode-0"]["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    assert env["decode-0"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "<decode-0.side>"
    assert env["decode-0"]["TMPDIR"] == "<workdir>/tmp" and env["decode-0"]["HF_HUB_OFFLINE"] == "1"
    assert [p.cores for p in plan.processes] == [(0, 1), (2, 3), ()]
    assert plan.requirements.cpu_cores == 2
    assert plan.requirements.engine_modules == ("vllm", "nixl")
    assert [step.argv[1:3] for step in plan.preparations] == [("-m", "pdctl.serve.export")]
    assert line(plan, "router").endswith(
        "--decode 'http://127.0.0.1:<decode-0.http>' --host 127.0.0.1 --port '<router.http>' "
        "--request-timeout 120 --pd-flow vllm"
    )
    assert "--prefill 'http://127.0.0.1:<prefill-0.http>' --decode" in line(plan, "router")


def test_vllm_router_from_the_engines_environment(four_cores: None) -> None:
    plan = plan_of("cpu-vllm-p1d1-nixl-vllm-router")
    assert line(plan, "router") == (
        "python3 -m vllm_router.launch_router --vllm-pd-disaggregation --kv-connector nixl "
        "--worker-startup-check-interval 1 --worker-startup-timeout-secs 300 "
        "--prefill 'http://127.0.0.1:<prefill-0.http>' --decode 'http://127.0.0.1:<decode-0.http>' "
        "--host 127.0.0.1 --port '<router.http>' --request-timeout-secs 120 "
        "--prometheus-host 127.0.0.1 --prometheus-port '<router.metrics>'"
    )
    assert plan.requirements.engine_modules == ("vllm", "nixl", "vllm_router")


def test_vllm_reference_has_no_connector_and_the_first_servers_cores(four_cores: None) -> None:
    from pdctl.engines import get_engine

    plan = plan_of("cpu-vllm-p1d1-nixl")
    spec = get_engine("vllm").reference(plan.topology, tp=1)
    argv = render_command(spec.command, {"reference.http": 1})
    assert "--kv-transfer-config" not in argv and "--enforce-eager" in argv
    env = {entry.name: entry.value for entry in spec.env}
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and spec.cores == (0, 1)
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env


def test_ports_render_when_allocated() -> None:
    plan = plan_of("cpu-p1d2-tcp")
    prefill = process(plan, "prefill-0")
    ports = {slot.key: 40000 + i for i, slot in enumerate(prefill.ports)}
    rendered = render_command(prefill.command, ports)
    assert rendered[rendered.index("--port") + 1] == "40000"
    assert rendered[rendered.index("--bootstrap-port") + 1] == "40001"
    assert not any("<" in arg for arg in rendered)


def test_replicas_get_their_own_slots_titles_and_router_entries(make_topology) -> None:
    path = make_topology(roles={"prefill": {"tp": 1, "replicas": 2}, "decode": {"tp": 2}})
    plan = make_plan(load_checked(path))
    assert [p.name for p in plan.processes] == ["prefill-0", "prefill-1", "decode-0", "router"]
    assert process(plan, "prefill-1").ranks[0].title.endswith(":prefill-1:tp0")
    router = line(plan, "router")
    assert "'<prefill-0.bootstrap>'" in router and "'<prefill-1.bootstrap>'" in router


@pytest.mark.parametrize("deterministic", [True, False])
def test_serving_deterministic_reaches_every_server(make_topology, deterministic) -> None:
    """The embedded servers get --deterministic or --no-deterministic, SGLang gets
    --enable-deterministic-inference or nothing, and plan shows the mode."""
    serving = {"deterministic": deterministic}
    embedded = make_plan(load_checked(make_topology(serving=serving)))
    for name in ("prefill-0", "decode-0"):
        flags = render_command(process(embedded, name).command)
        assert ("--deterministic" in flags) is deterministic
        assert ("--no-deterministic" in flags) is not deterministic
    sglang = make_plan(load_checked(make_topology(
        engine="sglang", device="cuda", serving=serving, transfer={"backend": "mooncake"},
        model={"path": "org/model", "preset": REMOVE},
    )))  # fmt: skip
    for name in ("prefill-0", "decode-0"):
        flags = render_command(process(sglang, name).command)
        assert ("--enable-deterministic-inference" in flags) is deterministic
    assert sglang.to_json()["deterministic"] is deterministic
