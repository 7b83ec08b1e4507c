"""Shared vocabulary: roles, device types, model shapes and what a checkpoint declares.

Everything here is plain data that several packages need to agree on (the topology
validator, the engines, the servers). It does no I/O except reading a checkpoint's
`config.json` (`read_checkpoint_config`: the one reader of what the embedded engine
computes, used by its loader and by `pdctl validate`), and imports nothing else from pdctl.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
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
    return _shape(_config_json(path))


Config = Mapping[str, object]  # a JSON object as read: each value checked where it is used


def _config_json(path: Path) -> Config:
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    return config


def _int(value: object) -> int:
    """`int(value)` of a JSON value (a number or its text); others refused as int() does."""
    if isinstance(value, str | int | float):
        return int(value)
    raise TypeError(
        "int() argument must be a string, a bytes-like object or a real number, "
        f"not {type(value).__name__!r}"
    )


def _float(value: object) -> float:
    """`float(value)` of a JSON value (a number or its text); others refused as float() does."""
    if isinstance(value, str | int | float):
        return float(value)
    raise TypeError(
        f"float() argument must be a string or a real number, not {type(value).__name__!r}"
    )


def _shape(config: Config) -> ModelShape:
    try:
        heads = _int(config["num_attention_heads"])
        hidden = _int(config["hidden_size"])
        return ModelShape(
            num_layers=_int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=_int(config.get("num_key_value_heads") or heads),
            head_dim=_int(config.get("head_dim") or hidden // heads),
            intermediate_size=_int(config["intermediate_size"]),
            vocab_size=_int(config["vocab_size"]),
            max_position=_int(config.get("max_position_embeddings", 4096)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.json lacks a usable field ({exc})") from exc


# What the embedded engine computes from a local checkpoint: the Hugging Face class
# named in config.json's `architectures` -> the engine's kind, and the RoPE types.
CHECKPOINT_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",  # sliding-window attention when configured
    "Qwen2ForCausalLM": "qwen2",  # biases on q, k and v
    "Qwen3ForCausalLM": "qwen3",  # RMSNorm of each q and k head before RoPE
}
ROPE_TYPES = ("default", "llama3")


class CheckpointRefused(ValueError):
    """config.json asks for something the embedded engine does not compute."""


@dataclass(frozen=True)
class RopeSettings:
    """RoPE's frequencies: theta, and Llama 3's scaling (`kind` "llama3") when set."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position: int = 0


@dataclass(frozen=True)
class CheckpointConfig:
    """What the embedded engine reads from a checkpoint's config.json."""

    shape: ModelShape
    architecture: str  # a value of CHECKPOINT_ARCHITECTURES
    rope: RopeSettings
    sliding_window: int | None  # a query sees its last `sliding_window` keys (None: all)
    rms_eps: float
    tie_embeddings: bool


def supported_checkpoints() -> str:
    """The architectures and RoPE types the embedded engine loads, for messages."""
    return f"architectures {', '.join(CHECKPOINT_ARCHITECTURES)}; rope_type {', '.join(ROPE_TYPES)}"


def read_checkpoint_config(path: Path) -> CheckpointConfig:
    """config.json of a checkpoint the embedded engine can compute, read once.

    Raises OSError when the file cannot be read, CheckpointRefused (naming the key and
    what is supported) when it asks for an architecture, a RoPE scaling or a feature
    the engine does not compute, and ValueError when it is not a usable config. A
    scaled RoPE is never read as unscaled: an unknown `rope_type` is refused.
    """
    raw = _config_json(path)
    shape = _shape(raw)
    names = raw.get("architectures") or []
    kinds = [
        CHECKPOINT_ARCHITECTURES[n]
        for n in _iterable(names)
        if n in CHECKPOINT_ARCHITECTURES and isinstance(n, str)
    ]
    if not kinds:
        raise CheckpointRefused(
            f"architectures {names} is not one the embedded engine computes "
            f"(supported: {', '.join(CHECKPOINT_ARCHITECTURES)})"
        )
    _refuse_features(raw, kinds[0])
    return CheckpointConfig(
        shape=shape,
        architecture=kinds[0],
        rope=_rope(raw),
        sliding_window=_sliding_window(raw, kinds[0]),
        rms_eps=_float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def _iterable(value: object) -> Iterable[object]:
    """A JSON value iterated as Python does (a list's items, a text's characters, an
    object's keys); a number or null is not iterable."""
    if isinstance(value, list | str | dict):
        return value
    raise TypeError(f"{type(value).__name__!r} object is not iterable")


def _contains(value: object, item: str) -> bool:
    """`item in value` for a JSON value, as Python answers it (a number or null cannot)."""
    if isinstance(value, list | str | dict):
        return item in value
    raise TypeError(f"argument of type {type(value).__name__!r} is not iterable")


def _refuse_features(raw: Config, kind: str) -> None:
    """Keys that would change the computation in ways the engine does not follow."""
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointRefused(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key) and kind != "qwen2":  # qwen2's q/k/v biases are its own
            raise CheckpointRefused(f"{key}: true is not supported for {kind}")


def _sliding_window(raw: Config, kind: str) -> int | None:
    window = raw.get("sliding_window")
    if kind in ("qwen2", "qwen3"):  # per-layer windows (max_window_layers): not computed
        layer_types = raw.get("layer_types") or []
        if raw.get("use_sliding_window") or _contains(layer_types, "sliding_attention"):
            raise CheckpointRefused(
                f"use_sliding_window (per-layer windows) is not supported for {kind}"
            )
        return None
    if kind != "mistral" or window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointRefused(
            f"sliding_window must be a positive integer or null, got {window!r}"
        )
    return window


def _rope(raw: Config) -> RopeSettings:
    """RoPE from `rope_parameters` (transformers 5) and/or `rope_scaling` (earlier)."""
    found: list[tuple[str, Config]] = []
    theta = raw.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key)
        if not params:
            continue
        if not isinstance(params, dict):
            raise CheckpointRefused(f"{key} must be an object, got {params!r}")
        found.append((key, params))
        theta = params.get("rope_theta", theta)
    rope_theta = _float(theta if theta is not None else 10000.0)
    settings = {_rope_settings(key, params, rope_theta) for key, params in found}
    if len(settings) > 1:
        raise CheckpointRefused("rope_parameters and rope_scaling disagree; keep one of them")
    return settings.pop() if settings else RopeSettings(rope_theta)


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_settings(key: str, params: Config, theta: float) -> RopeSettings:
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise CheckpointRefused(
            f"{key}.rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    if _float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointRefused(f"{key}.partial_rotary_factor other than 1.0 is not supported")
    if kind == "default":
        return RopeSettings(theta)
    numbers = {n: v for n in LLAMA3_KEYS if isinstance(v := params.get(n), int | float)}
    missing = [name for name in LLAMA3_KEYS if name not in numbers]
    if missing:
        raise CheckpointRefused(f"{key} of rope_type llama3 lacks {', '.join(missing)}")
    if numbers["high_freq_factor"] <= numbers["low_freq_factor"] or numbers["factor"] <= 0:
        raise CheckpointRefused(
            f"{key}: llama3 needs factor > 0 and high_freq_factor > low_freq_factor"
        )
    return RopeSettings(
        theta,
        kind,
        float(numbers["factor"]),
        float(numbers["low_freq_factor"]),
        float(numbers["high_freq_factor"]),
        int(numbers["original_max_position_embeddings"]),
    )
