"""Cross-field rules and derived values, through real YAML files from the factory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdctl.engines.command import render_command
from pdctl.launch.plan import load_checked, make_plan
from pdctl.topology import TopologyError
from pdctl.topology.resolve import assign_devices, requirements
from tests.conftest import REMOVE, deep_merge


def messages(path: Path) -> list[str]:
    with pytest.raises(TopologyError) as caught:
        load_checked(path)
    return [f"{issue.key}: {issue.message}" for issue in caught.value.issues]


def test_minimal_topology_gets_documented_defaults(make_topology) -> None:
    topology = load_checked(make_topology()).topology
    assert topology.engine == "embedded" and topology.device == "cpu"
    assert topology.router.kind == "builtin" and topology.launcher.kind == "local"
    assert topology.effective_dtype == "float32"
    assert topology.transfer.staging.effective_segment_mb == 16
    assert topology.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (1, 4), (4, 2), (2, 2), (8, 1)]
)
def test_tp_pairs_that_shard_the_tiny_model_are_valid(make_topology, prefill_tp, decode_tp) -> None:
    path = make_topology(roles={"prefill": {"tp": prefill_tp}, "decode": {"tp": decode_tp}})
    topology = load_checked(path).topology
    assert topology.uses_staging == (prefill_tp != decode_tp)


def test_gqa_replication_beyond_kv_heads_needs_a_multiple(make_topology) -> None:
    # tiny has 8 query heads and 4 KV heads: TP 8 replicates each KV head twice.
    load_checked(make_topology(roles={"decode": {"tp": 8}}))
    assert messages(make_topology(roles={"decode": {"tp": 6}})) == [
        "roles.decode.tp: 6 does not divide the model's 8 attention heads (the tiny preset)"
    ]


def test_the_encoder_tp_must_split_its_heads(make_topology) -> None:
    for tp in (1, 2, 4):
        load_checked(make_topology(roles={"encoder": {"tp": tp}}))
    assert messages(make_topology(roles={"encoder": {"tp": 8}})) == [
        "roles.encoder.tp: the encoder model's 4 attention heads do not split over 8 ranks "
        "(TP sizes that work: 1, 2, 4)"
    ]


CONFIG = {  # a Llama checkpoint's config.json (shape only)
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
}


def test_checkpoint_shape_is_read_from_config_json(make_topology, tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(CONFIG))
    good = make_topology(model={"path": str(checkpoint), "preset": REMOVE})
    assert load_checked(good).topology.model.path == str(checkpoint)
    bad = make_topology(
        model={"path": str(checkpoint), "preset": REMOVE}, roles={"decode": {"tp": 3}}
    )
    assert any("KV heads" in m or "attention heads" in m for m in messages(bad))


def test_a_relative_checkpoint_reaches_the_servers_from_any_folder(
    make_topology, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.path is relative to the topology file; servers get it absolute."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(CONFIG))
    path = make_topology(model={"path": "ckpt", "preset": REMOVE})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_checked(Path("..") / path.name)
    assert loaded.topology.model.path == str(checkpoint.resolve())
    commands = [render_command(p.command) for p in make_plan(loaded).processes]
    given = [c[c.index("--model-path") + 1] for c in commands if "--model-path" in c]
    assert given and set(given) == {str(checkpoint.resolve())}


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"architectures": ["GemmaForCausalLM"]},
         "architectures ['GemmaForCausalLM'] is not one the embedded engine computes (supported: "
         "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
         "rope_scaling.rope_type 'yarn' is not supported (supported: default, llama3)"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6}},
         "rope_parameters.rope_type 'longrope' is not supported (supported: default, llama3)"),
    ],
)  # fmt: skip
def test_validate_refuses_a_checkpoint_the_embedded_engine_cannot_compute(
    cli, make_topology, tmp_path: Path, changes, words
) -> None:
    """`pdctl validate` runs the loader's own config reader: file, key and supported list."""
    from pdctl.cli.app import app

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({**CONFIG, **changes}))
    path = make_topology(model={"path": "ckpt", "preset": REMOVE})
    result = cli.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    text = " ".join(result.stderr.split())  # the console may wrap long lines
    assert f"{path}:" in text and f"model.path: 'ckpt/config.json': {words}" in text, text
    assert "hint: the embedded engine runs architectures LlamaForCausalLM" in text
    assert "rope_type default, llama3" in text and "Traceback" not in result.output
    sglang = make_topology(engine="sglang", model={"path": str(checkpoint), "preset": REMOVE},
                           transfer={"backend": "mooncake"})  # fmt: skip
    load_checked(sglang)  # SGLang runs many more: its own business


def test_validate_accepts_every_architecture_the_engine_computes(make_topology, tmp_path) -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    for name, extra in [
        ("Qwen3ForCausalLM", {"head_dim": 32}),
        ("MistralForCausalLM", {"sliding_window": 4096}),
        ("LlamaForCausalLM", {"rope_scaling": llama3, "rope_theta": 500000.0}),
        ("LlamaForCausalLM", {"rope_parameters": {**llama3, "rope_theta": 500000.0}}),
    ]:
        checkpoint = tmp_path / f"ckpt-{len(list(tmp_path.iterdir()))}"
        checkpoint.mkdir()
        config = {**CONFIG, "architectures": [name], **extra}
        (checkpoint / "config.json").write_text(json.dumps(config))
        load_checked(make_topology(model={"path": str(checkpoint), "preset": REMOVE}))


def test_a_hub_id_stays_as_written_for_sglang(make_topology) -> None:
    path = make_topology(
        engine="sglang",
        model={"path": "Qwen/Qwen3-0.6B", "preset": REMOVE},
        transfer={"backend": "mooncake"},
    )
    assert load_checked(path).topology.model.path == "Qwen/Qwen3-0.6B"


def test_each_engine_answers_for_its_checkpoints(make_topology, tmp_path: Path) -> None:
    """vLLM and SGLang take hub ids and many architectures, but a local folder must
    still be a checkpoint; pdctl's servers read local checkpoints only (their reader
    refuses what they cannot compute): each engine's own `model_issues`."""
    folder = tmp_path / "weights"
    folder.mkdir()  # no config.json
    vllm = {
        "engine": "vllm",
        "engine_python": "python3",
        "transfer": {"backend": "nixl"},
        "serving": {"deterministic": False},
    }
    words = "model.path: 'weights' has no config.json, so it is not a Hugging Face checkpoint"
    assert words in messages(make_topology(model={"path": "weights", "preset": REMOVE}, **vllm))
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(
        json.dumps({**CONFIG, "architectures": ["GemmaForCausalLM"]})
    )
    loaded = load_checked(make_topology(model={"path": "gemma", "preset": REMOVE}, **vllm))
    assert loaded.topology.model.path == str(gemma.resolve())  # absolute for the servers
    hub = load_checked(make_topology(model={"path": "org/model", "preset": REMOVE}, **vllm))
    assert hub.topology.model.path == "org/model" and hub.warnings == ()
    embedded = load_checked(make_topology(model={"path": "org/model", "preset": REMOVE}))
    assert [w.key for w in embedded.warnings] == ["model.path"]
    assert embedded.topology.model.path == str((tmp_path / "org" / "model").resolve())


def test_missing_checkpoint_is_a_warning_not_an_error(make_topology) -> None:
    loaded = load_checked(make_topology(model={"path": "/nonexistent/ckpt", "preset": REMOVE}))
    assert [w.key for w in loaded.warnings] == ["model.path"]


def test_devices_are_assigned_in_order_when_omitted(make_topology) -> None:
    path = make_topology(
        device="cuda", roles={"prefill": {"tp": 1}, "decode": {"tp": 2, "replicas": 2}}
    )
    topology = load_checked(path).topology
    assert assign_devices(topology) == {"prefill": [(0,)], "decode": [(1, 2), (3, 4)]}
    assert requirements(topology).device_count == 5


def test_explicit_devices_may_be_shared_between_roles(make_topology) -> None:
    path = make_topology(
        device="cuda",
        roles={"prefill": {"tp": 1, "devices": [0]}, "decode": {"tp": 2, "devices": [0, 1]}},
    )
    plan = make_plan(load_checked(path))
    decode = next(p for p in plan.processes if p.role == "decode")
    assert decode.env_values()["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert [r.device for r in decode.ranks] == [0, 1]


def test_ranks_share_a_device_only_when_the_topology_says_so(make_topology) -> None:
    one_gpu = {"prefill": {"tp": 1, "devices": [0]}, "decode": {"tp": 2, "devices": [0, 0]}}
    refused = messages(make_topology(device="cuda", roles=one_gpu))
    assert refused == [
        "roles.decode.devices[1]: device 0 is listed twice; each rank of decode needs its own "
        "device"
    ]
    shared = deep_merge(one_gpu, {"decode": {"share_devices": True}})
    plan = make_plan(load_checked(make_topology(device="cuda", roles=shared)))
    decode = next(p for p in plan.processes if p.role == "decode")
    assert decode.env_values()["CUDA_VISIBLE_DEVICES"] == "0"  # the mask lists it once
    assert [r.device for r in decode.ranks] == [0, 0]
    argv = render_command(decode.command)
    assert argv[argv.index("--rank-devices") + 1] == "0,0"
    prefill = next(p for p in plan.processes if p.role == "prefill")
    assert "--rank-devices" not in render_command(prefill.command)
    sglang = make_topology(device="cuda", engine="sglang", roles=shared,
                           model={"path": "org/model", "preset": REMOVE},
                           transfer={"backend": "mooncake"})  # fmt: skip
    assert any("share_devices: sglang runs one rank per device" in m for m in messages(sglang))


def test_derived_devices_skip_indices_taken_explicitly(make_topology) -> None:
    path = make_topology(
        device="xpu", roles={"prefill": {"tp": 1, "devices": [1]}, "decode": {"tp": 2}}
    )
    topology = load_checked(path).topology
    assert assign_devices(topology)["decode"] == [(0, 2)]


def test_env_layers_role_wins_and_plan_shows_the_merge(make_topology) -> None:
    path = make_topology(
        env={"FOO": "global", "BAR": 1},
        roles={"decode": {"tp": 2, "env": {"FOO": "decode"}}},
    )
    plan = make_plan(load_checked(path))
    decode = next(p for p in plan.processes if p.role == "decode")
    prefill = next(p for p in plan.processes if p.role == "prefill")
    foo = next(e for e in decode.env if e.name == "FOO")
    assert (foo.value, foo.source, foo.overrides) == ("decode", "roles.decode.env", "env")
    assert prefill.env_values()["FOO"] == "global"
    assert prefill.env_values()["BAR"] == "1"  # YAML integers become their text


def test_requirements_are_derived_from_backend_env_and_router(make_topology) -> None:
    path = make_topology(
        transfer={"backend": "mooncake", "protocol": "tcp"},
        env={"MC_USE_TENT": "1"},
        router="sglang-router",
    )
    reqs = make_plan(load_checked(path)).requirements  # pdctl's servers import the transport
    assert reqs.modules == ("mooncake.engine", "sglang_router")
    assert reqs.capabilities == ("mooncake.tent",)
    assert "MC_USE_TENT" in reqs.reasons["mooncake.tent"]
    nixl = make_plan(load_checked(make_topology(transfer={"backend": "nixl"}))).requirements
    assert nixl.modules == ("nixl",) and nixl.capabilities == ("nixl.ucx",)
    generic = requirements(load_checked(path).topology)  # what every engine's servers need
    assert generic.modules == ("sglang_router",) and generic.capabilities == ()


def test_tent_is_asked_for_by_setting_the_variable_at_all(make_topology) -> None:
    """Mooncake engages TENT whenever MC_USE_TENT or MC_USE_TEV1 is set: any setting pdctl
    accepts requires the capability; "off" spellings are refused (tests/topology/bad)."""
    mooncake = {"backend": "mooncake", "protocol": "tcp"}
    legacy = make_topology(transfer=mooncake, roles={"decode": {"env": {"MC_USE_TEV1": "1"}}})
    reqs = make_plan(load_checked(legacy)).requirements
    assert (
        reqs.capabilities == ("mooncake.tent",) and "MC_USE_TEV1" in reqs.reasons["mooncake.tent"]
    )
    odd = load_checked(make_topology(transfer=mooncake, env={"MC_USE_TENT": "yes please"}))
    assert make_plan(odd).requirements.capabilities == ("mooncake.tent",)
    assert [w.message for w in odd.warnings] == [
        "MC_USE_TENT='yes please' asks for TENT (Mooncake reads only whether it is set)"
    ]
    unset = make_plan(load_checked(make_topology(transfer=mooncake))).requirements
    assert unset.capabilities == ()


def test_env_for_another_backend_is_a_warning(make_topology) -> None:
    loaded = load_checked(make_topology(env={"MC_USE_TENT": "1"}))
    assert [w.message for w in loaded.warnings] == [
        "MC_USE_TENT has no effect: transfer.backend is tcp"
    ]


def test_explicit_staging_with_equal_tp_warns(make_topology) -> None:
    path = make_topology(roles={"decode": {"tp": 1}}, transfer={"staging": {"enabled": True}})
    loaded = load_checked(path)
    assert loaded.topology.uses_staging is False
    assert [w.key for w in loaded.warnings] == ["transfer.staging.enabled"]


def test_all_errors_are_reported_together(make_topology) -> None:
    path = make_topology(
        roles={"prefill": {"tp": 3}, "decode": {"tp": 2, "args": ["--tp=2"]}},
        serving={"chunked_prefill_tokens": 100},
    )
    found = messages(path)
    assert any(m.startswith("roles.prefill.tp:") for m in found)
    assert any(m.startswith("serving.chunked_prefill_tokens:") for m in found)


def test_non_loopback_host_warns(make_topology) -> None:
    loaded = load_checked(make_topology(host="0.0.0.0"))
    assert [w.key for w in loaded.warnings] == ["host"]


def test_yaml_merge_keys_and_overrides_are_supported(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text(
        "name: merged\n"
        "x-role: &role {tp: 2, env: {A: '1'}}\n"
        "roles:\n"
        "  prefill: {tp: 1}\n"
        "  decode:\n"
        "    <<: *role\n"
        "    tp: 4\n"
    )
    # `x-role` is an unknown top-level key: anchors must live inside known keys.
    assert messages(path) == ["x-role: unknown key 'x-role'"]
    path.write_text(
        "name: merged\n"
        "roles:\n"
        "  prefill: &role {tp: 2, env: {A: '1'}}\n"
        "  decode:\n"
        "    <<: *role\n"
        "    tp: 4\n"
    )
    topology = load_checked(path).topology
    assert topology.roles.decode.tp == 4 and topology.roles.decode.env == {"A": "1"}


def test_a_role_may_have_a_kv_pool_of_its_own(make_topology) -> None:
    """Decode's pool smaller than prefill's (the abort soak's layout): the role's value
    goes on its servers' command lines, the topology's on the others'."""
    path = make_topology(serving={"kv_pool_tokens": 8192},
                         roles={"decode": {"tp": 2, "kv_pool_tokens": 2048}})  # fmt: skip
    pools = {
        p.role: c[c.index("--kv-pool-tokens") + 1]
        for p in make_plan(load_checked(path)).processes
        if "--kv-pool-tokens" in (c := render_command(p.command))
    }
    assert pools == {"prefill": "8192", "decode": "2048"}
    small = make_topology(roles={"decode": {"tp": 2, "kv_pool_tokens": 256}})
    assert messages(small) == ["roles.decode.kv_pool_tokens: 256 tokens cannot hold one "
                               "prefill chunk of 512"]  # fmt: skip
    sglang = make_topology(engine="sglang", model={"path": "Qwen/Qwen3-0.6B", "preset": REMOVE},
                           transfer={"backend": "mooncake"},
                           roles={"decode": {"tp": 2, "kv_pool_tokens": 4096}})  # fmt: skip
    assert any("applies to pdctl's servers (engine embedded), not sglang" in m
               for m in messages(sglang))  # fmt: skip
