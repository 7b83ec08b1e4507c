"""Shared vocabulary: roles, device types and model shapes.

Everything here is plain data that several packages need to agree on (the topology
validator, the engines, the servers). It does no I/O except reading a checkpoint's
`config.json`, and imports nothing else from pdctl.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Role = Literal["prefill", "decode", "encoder"]
SERVER_ROLES: tuple[Role, ...] = ("prefill", "decode", "encoder")

# Device types pdctl knows, with the variable that restricts a process to some
# devices. Indices in a topology are physical; inside the process they become 0..n-1.
DEVICE_VISIBILITY_VARS: dict[str, str | None] = {
    "cpu": None,
    "cuda": "CUDA_VISIBLE_DEVICES",
    "xpu": "ZE_AFFINITY_MASK",
    "npu": "ASCEND_RT_VISIBLE_DEVICES",
    "hpu": "HABANA_VISIBLE_MODULES",
    "musa": "MUSA_VISIBLE_DEVICES",
    "mlu": "MLU_VISIBLE_DEVICES",
}
DeviceType = Literal["cpu", "cuda", "xpu", "npu", "hpu", "musa", "mlu"]

# torch.distributed backend per device type (gloo where there is no collective library).
# Per device type: the collective backend for device tensors, with gloo beside it for
# the small CPU control messages (operation headers, JSON payloads) TP rank 0 sends.
DIST_BACKENDS: dict[str, str] = {
    "cpu": "gloo",
    "cuda": "cpu:gloo,cuda:nccl",
    "xpu": "cpu:gloo,xpu:xccl",
    "npu": "cpu:gloo,npu:hccl",
    "hpu": "cpu:gloo,hpu:hccl",
    "musa": "cpu:gloo,musa:mccl",
    "mlu": "cpu:gloo,mlu:cncl",
}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide which tensor-parallel sizes a model admits."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int

    def tp_problem(self, tp: int) -> str | None:
        """Why `tp` cannot shard this model, or None when it can.

        Query heads must split evenly. KV heads split evenly when tp <= kv heads and
        are replicated (GQA replication) when tp is a multiple of the KV head count.
        """
        if self.num_attention_heads % tp:
            return f"{tp} does not divide the model's {self.num_attention_heads} attention heads"
        if tp <= self.num_kv_heads and self.num_kv_heads % tp:
            return f"{tp} does not divide the model's {self.num_kv_heads} KV heads"
        if tp > self.num_kv_heads and tp % self.num_kv_heads:
            return (
                f"{tp} exceeds the model's {self.num_kv_heads} KV heads and is not a multiple "
                "of them, so KV heads cannot be replicated evenly"
            )
        return None

    def valid_tp_sizes(self, limit: int = 64) -> list[int]:
        return [tp for tp in range(1, limit + 1) if self.tp_problem(tp) is None]


MODEL_PRESETS: dict[str, ModelShape] = {
    # Runs a full verify on 2 CPU cores in seconds; 4 KV heads so TP 1, 2 and 4 all work.
    "tiny": ModelShape(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=512,
        vocab_size=512,
        max_position=4096,
    ),
    # GPU-sized: KV layout of an 8B-class model (8 KV heads x 128 head dim).
    "small": ModelShape(
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=5632,
        vocab_size=32768,
        max_position=8192,
    ),
}


# The embedded encoder model (serve/model/encoder.py) shards its attention heads over
# the encoder role's TP ranks: a TP size must divide them.
ENCODER_HEADS = 4


def encoder_tp_problem(tp: int) -> str | None:
    """Why the embedded encoder cannot run on `tp` ranks, or None when it can."""
    if tp < 1 or ENCODER_HEADS % tp:
        sizes = ", ".join(str(n) for n in range(1, ENCODER_HEADS + 1) if ENCODER_HEADS % n == 0)
        return (
            f"the encoder model's {ENCODER_HEADS} attention heads do not split over {tp} "
            f"ranks (TP sizes that work: {sizes})"
        )
    return None


def read_checkpoint_shape(path: Path) -> ModelShape:
    """Read the shape of a local Hugging Face checkpoint from its config.json.

    Raises OSError when the file cannot be read and ValueError when it is not a
    usable config (not JSON, or missing the head counts).
    """
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelShape(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            max_position=int(config.get("max_position_embeddings", 4096)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.json lacks a usable field ({exc})") from exc
