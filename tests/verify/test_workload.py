"""The verify workload: bounded by the model it is sent to."""

from __future__ import annotations

import json
from pathlib import Path

from pdctl.launch.plan import load_checked
from pdctl.verify.workload import Shape, build
from tests.conftest import REMOVE


def test_a_checkpoints_config_bounds_the_ids_and_lengths(make_topology, tmp_path: Path) -> None:
    """Even when no server reports its vocabulary (a router that does not pass
    /get_model_info on), a 272-token checkpoint gets no id >= 272 and no prompt past
    its positions."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 272, "max_position_embeddings": 300}  # fmt: skip
    (checkpoint / "config.json").write_text(json.dumps(config))
    topology = load_checked(make_topology(model={"path": "ckpt", "preset": REMOVE})).topology
    shape = Shape.of(topology)
    assert (shape.vocab, shape.max_context) == (272, 300)
    prompts = build(shape, 24, seed=3, max_new_tokens=8)
    ids = [i for p in prompts if p.input_ids is not None for i in p.input_ids]
    assert ids and max(ids) < 272 and min(ids) >= 0
    assert max(len(p.input_ids or []) for p in prompts) + 8 <= 300
    unread = load_checked(make_topology(model={"path": "/nowhere/ckpt", "preset": REMOVE}))
    assert Shape.of(unread.topology).vocab == 32000  # the servers' report decides then
