"""Model weights for one tensor-parallel rank: from a seed (presets) or a checkpoint.

Weights are generated or loaded whole, then sliced for the rank, so every rank of
every TP size sees the same numbers. They are stored ready for `ops.matmul`:
transposed ([in, out]) with the output width padded to `ops.TILE`, q/k/v and
gate/up fused, and the row-parallel products (o, down) cut into this rank's share
of `ops.REDUCTION_CHUNKS` chunks. Checkpoints: Llama (Llama 3.x RoPE scaling), Qwen2
(q/k/v biases), Qwen3 (q/k head norms) and Mistral (sliding window), as
`core.read_checkpoint_config` reads them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdctl.core import MODEL_PRESETS, ModelShape, RopeSettings, read_checkpoint_config
from pdctl.serve.model import ops
from pdctl.staging.layout import rank_heads

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CheckpointError(ValueError):
    """A local checkpoint that cannot be loaded; the message names the file and why."""


@dataclass(frozen=True)
class ModelConfig:
    shape: ModelShape
    architecture: str = "llama"  # qwen2: biases on q, k and v; qwen3: q/k head norms
    rope: RopeSettings = field(default_factory=RopeSettings)
    sliding_window: int | None = None  # a query sees its last `sliding_window` keys
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    name: str = "tiny"


def preset_config(name: str) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(MODEL_PRESETS)}")
    return ModelConfig(MODEL_PRESETS[name], name=name)


def checkpoint_config(path: Path) -> ModelConfig:
    """The config of a local checkpoint (`core.read_checkpoint_config`: the one reader
    `pdctl validate` uses too); ValueError naming the file when it cannot be used."""
    try:
        read = read_checkpoint_config(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path / 'config.json'}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from exc
    return ModelConfig(
        read.shape,
        architecture=read.architecture,
        rope=read.rope,
        sliding_window=read.sliding_window,
        rms_eps=read.rms_eps,
        tie_embeddings=read.tie_embeddings,
        name=path.name,
    )


@dataclass
class LayerWeights:
    qkv_t: torch.Tensor  # [hidden, padded(q + k + v local widths)]
    qkv_bias: torch.Tensor | None  # [q + k + v local widths]
    q_norm: torch.Tensor | None  # [head_dim] (qwen3: RMSNorm of each q head before RoPE)
    k_norm: torch.Tensor | None  # [head_dim] (qwen3: of each k head)
    o_chunks: torch.Tensor  # this rank's [local chunks, K_chunk, hidden] stack
    gate_up_t: torch.Tensor  # [hidden, padded(2 * intermediate local)]
    down_chunks: torch.Tensor  # [local chunks, I_chunk, hidden]
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]


@dataclass
class RankWeights:
    config: ModelConfig
    tp: int
    rank: int
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head_t: torch.Tensor  # [hidden, padded(vocab)]

    @property
    def q_heads(self) -> int:
        return self.config.shape.num_attention_heads // self.tp

    @property
    def kv_heads(self) -> int:
        return len(rank_heads(self.config.shape.num_kv_heads, self.tp, self.rank))


def check_tp(shape: ModelShape, tp: int) -> None:
    problem = shape.tp_problem(tp)
    if problem is None and ops.REDUCTION_CHUNKS % tp:
        problem = f"{tp} does not divide the engine's {ops.REDUCTION_CHUNKS} reduction chunks"
    if problem is None and (
        shape.intermediate_size % ops.REDUCTION_CHUNKS
        or (shape.num_attention_heads * shape.head_dim) % ops.REDUCTION_CHUNKS
    ):
        problem = f"the model's widths do not split into {ops.REDUCTION_CHUNKS} reduction chunks"
    if problem:
        raise ValueError(f"TP {tp}: {problem}")


def _padded_t(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [in, out padded to TILE], contiguous."""
    out_width = weight.shape[0]
    padded = weight.new_zeros((ops.round_up(out_width, ops.TILE), weight.shape[1]))
    padded[:out_width] = weight
    return padded.t().contiguous()


def row_chunks(weight_t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """[K, N] -> this rank's REDUCTION_CHUNKS // tp row blocks, N padded to TILE, stacked:
    [REDUCTION_CHUNKS // tp, K / REDUCTION_CHUNKS, N padded]."""
    k = weight_t.shape[0]
    width = k // ops.REDUCTION_CHUNKS
    per_rank = ops.REDUCTION_CHUNKS // tp
    first = rank * per_rank
    pieces = []
    for chunk in range(first, first + per_rank):
        piece = weight_t[chunk * width : (chunk + 1) * width]
        pieces.append(_padded_t(piece.t().contiguous()))
    return torch.stack(pieces)


Source = Callable[[str, tuple[int, ...]], torch.Tensor]


def build_rank_weights(
    config: ModelConfig,
    source: Source,
    tp: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> RankWeights:
    """Assemble one rank's weights; `source(name, shape)` returns a full HF-named tensor."""
    shape = config.shape
    check_tp(shape, tp)
    d = shape.head_dim
    q_range = rank_heads(shape.num_attention_heads, tp, rank)
    kv_range = rank_heads(shape.num_kv_heads, tp, rank)
    inter = shape.intermediate_size // tp
    hidden = shape.hidden_size

    def get(name: str, dims: tuple[int, ...]) -> torch.Tensor:
        tensor = source(name, dims)
        if tuple(tensor.shape) != dims:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {dims}")
        # assembled (sliced, padded, transposed) where it will live: on a GPU host a
        # 0.9 B-parameter model took seconds of single-threaded CPU copies per server
        return tensor.to(device=device, dtype=torch.float32)

    def place(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(shape.num_layers):
        prefix = f"model.layers.{i}."
        q = get(prefix + "self_attn.q_proj.weight", (shape.num_attention_heads * d, hidden))
        k = get(prefix + "self_attn.k_proj.weight", (shape.num_kv_heads * d, hidden))
        v = get(prefix + "self_attn.v_proj.weight", (shape.num_kv_heads * d, hidden))
        q_rows = slice(q_range.start * d, q_range.stop * d)
        kv_rows = slice(kv_range.start * d, kv_range.stop * d)
        qkv = torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
        bias = None
        if config.architecture == "qwen2":
            qb = get(prefix + "self_attn.q_proj.bias", (shape.num_attention_heads * d,))
            kb = get(prefix + "self_attn.k_proj.bias", (shape.num_kv_heads * d,))
            vb = get(prefix + "self_attn.v_proj.bias", (shape.num_kv_heads * d,))
            bias = place(torch.cat([qb[q_rows], kb[kv_rows], vb[kv_rows]]))
        q_norm = k_norm = None
        if config.architecture == "qwen3":
            q_norm = place(get(prefix + "self_attn.q_norm.weight", (d,)))
            k_norm = place(get(prefix + "self_attn.k_norm.weight", (d,)))
        o = get(prefix + "self_attn.o_proj.weight", (hidden, shape.num_attention_heads * d))
        gate = get(prefix + "mlp.gate_proj.weight", (shape.intermediate_size, hidden))
        up = get(prefix + "mlp.up_proj.weight", (shape.intermediate_size, hidden))
        down = get(prefix + "mlp.down_proj.weight", (hidden, shape.intermediate_size))
        rows = slice(rank * inter, (rank + 1) * inter)
        layers.append(
            LayerWeights(
                qkv_t=place(_padded_t(qkv)),
                qkv_bias=bias,
                q_norm=q_norm,
                k_norm=k_norm,
                o_chunks=place(row_chunks(o.t(), tp, rank)),
                gate_up_t=place(_padded_t(torch.cat([gate[rows], up[rows]]))),
                down_chunks=place(row_chunks(down.t(), tp, rank)),
                input_norm=place(get(prefix + "input_layernorm.weight", (hidden,))),
                post_norm=place(get(prefix + "post_attention_layernorm.weight", (hidden,))),
            )
        )
    embed = get("model.embed_tokens.weight", (shape.vocab_size, hidden))
    head = embed if config.tie_embeddings else get("lm_head.weight", (shape.vocab_size, hidden))
    return RankWeights(
        config=config,
        tp=tp,
        rank=rank,
        embed=place(embed),
        layers=layers,
        final_norm=place(get("model.norm.weight", (hidden,))),
        lm_head_t=place(_padded_t(head)),
    )


def preset_source(seed: int, device: torch.device | None = None) -> Source:
    """Deterministic weights: each tensor from its own generator seeded by (seed, name).

    Drawn on `device` (default the CPU) by that device type's generator: every process
    and rank on one device type draws the same values (TP ranks slice the same full
    tensors), and an accelerator draws them in milliseconds where the CPU took seconds
    for the small preset. A CPU and a CUDA server of one preset hold different weights.
    """
    where = device or torch.device("cpu")

    def source(name: str, dims: tuple[int, ...]) -> torch.Tensor:
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        generator = torch.Generator(device=where).manual_seed(
            int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
        )

        def normal() -> torch.Tensor:
            return torch.randn(dims, generator=generator, device=where)

        if name.endswith("norm.weight"):
            return 1.0 + 0.1 * normal()
        if name.endswith(".bias"):
            return 0.02 * normal()
        if "embed_tokens" in name:
            return normal()
        fan_in = dims[-1]
        scale = (4.0 if name == "lm_head.weight" else 1.0) / fan_in**0.5
        return scale * normal()

    return source


def checkpoint_source(path: Path) -> Source:
    """Tensors from *.safetensors files (sharded or not), read lazily by name.

    A file that cannot be read or parsed, or a missing tensor, is a CheckpointError.
    """
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    where: dict[str, Path] = {}

    def unreadable(file: Path, exc: Exception) -> CheckpointError:
        return CheckpointError(f"{file}: not a readable safetensors file ({exc})")

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    where[key] = file
        except (OSError, SafetensorError) as exc:
            raise unreadable(file, exc) from exc

    def source(name: str, dims: tuple[int, ...]) -> torch.Tensor:
        if name not in where:
            raise CheckpointError(f"{path}: the checkpoint has no tensor {name}")
        try:
            with safe_open(str(where[name]), framework="pt") as handle:
                return handle.get_tensor(name)
        except (OSError, SafetensorError) as exc:
            raise unreadable(where[name], exc) from exc

    return source
