"""Every topology in the catalog validates, plans, and matches the exported schema."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from pdctl.launch.plan import load_checked, make_plan
from pdctl.topology.schema import topology_json_schema
from tests.conftest import CATALOG, REPO

IDS = [path.stem for path in CATALOG]


def test_catalog_has_the_required_topologies() -> None:
    names = {path.stem for path in CATALOG}
    assert {
        "cpu-p1d2-tcp",
        "cpu-p1d2-mooncake",
        "cpu-p1d2-nixl",
        "cuda-2gpu-p1d2-mooncake-staging",
        "cpu-p2d2-tcp",
        "cpu-p2d2-mooncake",
        "cpu-p1d4-tcp-staging",
        "cpu-p1d4-mooncake-staging",
        "cuda-3gpu-p1d2-tcp-staging",
        "cuda-3gpu-p1d2-mooncake-staging",
        "cuda-4gpu-p2d2-tcp",
        "cuda-4gpu-p2d2-mooncake",
        "cuda-4gpu-p1d4-tcp-staging",
        "cuda-4gpu-p1d4-mooncake-staging",
        "xpu-nightly-2-gpu",
        "xpu-nightly-4-gpu-staging",
        "xpu-manual-nixl-basic",
        "xpu-manual-nixl-staging",
    } <= names


@pytest.mark.parametrize("path", CATALOG, ids=IDS)
def test_catalog_file_is_valid_without_warnings_and_plans(path: Path) -> None:
    loaded = load_checked(path)
    assert loaded.warnings == ()
    assert loaded.topology.name == path.stem, "file name and topology name must agree"
    plan = make_plan(loaded)
    roles = [process.role for process in plan.processes]
    assert roles.count("router") == 1 and "prefill" in roles and "decode" in roles


@pytest.mark.parametrize("path", CATALOG, ids=IDS)
def test_catalog_file_matches_the_json_schema(path: Path) -> None:
    jsonschema.validate(yaml.safe_load(path.read_text()), topology_json_schema())


def test_schema_rejects_what_the_loader_rejects() -> None:
    schema = topology_json_schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "x", "roles": {"prefill": {"tpp": 1}, "decode": {}}}, schema)
    jsonschema.validate(
        {"name": "x", "roles": {"prefill": {}, "decode": {}}, "router": "builtin"}, schema
    )


def test_default_topology_goes_through_staging() -> None:
    topology = load_checked(REPO / Path("topologies/cpu-p1d2-tcp.yaml")).topology
    assert "default" in topology.suites and "cpu" in topology.suites
    assert topology.uses_staging and topology.transfer.backend == "tcp"
    assert (topology.roles.prefill.tp, topology.roles.decode.tp) == (1, 2)


def test_xpu_staging_topology_carries_the_inductor_override_on_decode_only() -> None:
    topology = load_checked(REPO / Path("topologies/xpu-nightly-4-gpu-staging.yaml")).topology
    assert topology.roles.decode.env == {"TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER": "0"}
    assert "TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER" not in topology.roles.prefill.env
    assert topology.env["MC_USE_TENT"] == "1" and topology.env["MOONCAKE_PROTOCOL"] == "tcp"
