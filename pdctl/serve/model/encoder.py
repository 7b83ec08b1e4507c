"""A small deterministic image encoder for Encoder/Prefill/Decode (EPD) topologies.

Owns two things: `parse_image`, which turns a request's image (nested lists or
base64 raw bytes) into a checked float32 [3, H, W] tensor, and `EncoderModel`, a
tiny ViT that turns that tensor into one embedding per 4x4 patch, of the language
model's hidden size:

    image [3, H, W] -> patches [N, 3 * PATCH * PATCH]      N = (H / PATCH) * (W / PATCH)
      -> patch embedding + 2-D position embedding           [N, width]
      -> 2 x (pre-RMSNorm non-causal attention, pre-RMSNorm GELU MLP 4x)
      -> RMSNorm -> projection                              [N, hidden_size]

Weights come from `weights.preset_source` (one torch.Generator per tensor, seeded
by the seed and the tensor's name; never the global RNG), and every product,
norm and attention goes through the batch-invariant primitives of `ops.py`, so an
image's embeddings are bitwise equal whatever else runs. The projection is scaled
so outputs have unit RMS, like the preset token-embedding table (standard normal).

Tensor parallelism (the encoder role with TP > 1), as in the language model: each
rank holds the Q, K and V columns of its attention heads and its share of the MLP's
inner width; the two row-parallel products (attention output, MLP down) are split
into `ops.REDUCTION_CHUNKS` fixed column ranges whatever the TP size, and the
gathered partials are summed in chunk order, so TP 1, 2 and 4 give bitwise the same
embeddings. Rank 0 announces each checked image to the others (`announce`) before
computing; every rank then runs `encode` on it.

It deliberately knows nothing about tokenizers, placeholder tokens, requests or
how embeddings reach the prefill engine.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdctl.core import ENCODER_HEADS, encoder_tp_problem
from pdctl.serve.model import attention, ops
from pdctl.serve.model.weights import preset_source, row_chunks

PATCH = 4  # pixels per patch side
CHANNELS = 3
MAX_SIDE = 64  # images are at most MAX_SIDE x MAX_SIDE pixels
IMAGE_DTYPES = ("uint8", "float32", "float16")  # accepted raw dtypes in base64 form

GRID = MAX_SIDE // PATCH  # position-embedding grid side: patch (row, col) -> row * GRID + col
WIDTH = 64
NUM_LAYERS = 2
NUM_HEADS = ENCODER_HEADS
MLP_RATIO = 4
RMS_EPS = 1e-6

_TORCH_DTYPES = {"uint8": torch.uint8, "float32": torch.float32, "float16": torch.float16}
_FIELDS = ("data", "dtype", "shape")


class ImageError(ValueError):
    """A request's image is malformed; the message starts with where it is."""


def num_image_tokens(height: int, width: int) -> int:
    return (height // PATCH) * (width // PATCH)


# ---------------------------------------------------------------- parsing


def parse_image(value: Any, where: str = "image") -> torch.Tensor:
    """A request's image as float32 [3, H, W].

    Accepts nested lists [C][H][W] of finite numbers (ints or floats, not bools),
    or {"data": <base64 of raw little-endian bytes>, "dtype": one of IMAGE_DTYPES,
    "shape": [3, H, W]}; uint8 bytes are scaled to [0, 1]. H and W are multiples
    of PATCH in 1..MAX_SIDE. Any violation raises ImageError naming `where`.
    """
    if isinstance(value, list):
        image = _parse_lists(value, where)
    elif isinstance(value, dict):
        image = _parse_raw(value, where)
    else:
        raise ImageError(f"{where}: expected nested lists or an object with data, dtype and shape")
    if not bool(torch.isfinite(image).all()):
        raise ImageError(f"{where}: NaN or infinite values")
    return image


def _check_side(prefix: str, name: str, size: int) -> None:
    if not 1 <= size <= MAX_SIDE:
        raise ImageError(f"{prefix}: {name} {_show(size)} is not in 1..{MAX_SIDE}")
    if size % PATCH:
        raise ImageError(f"{prefix}: {name} {size} is not a multiple of the patch size {PATCH}")


def _check_shape(prefix: str, shape: tuple[int, int, int]) -> None:
    channels, height, width = shape
    if channels != CHANNELS:
        raise ImageError(f"{prefix}: {_show(channels)} channels, expected {CHANNELS}")
    _check_side(prefix, "height", height)
    _check_side(prefix, "width", width)


def _show(number: int) -> str:
    """An int for a message; huge ones would be long (or refused by str())."""
    return str(number) if abs(number) < 10**12 else "(huge)"


def _parse_lists(value: list[Any], where: str) -> torch.Tensor:
    if len(value) != CHANNELS:
        raise ImageError(f"{where}: {len(value)} channels, expected {CHANNELS}")
    height = width = -1
    numbers: list[float] = []  # row-major [C][H][W]
    for c, channel in enumerate(value):
        at_channel = f"{where}[{c}]"
        if not isinstance(channel, list):
            raise ImageError(f"{at_channel}: expected a list of rows, got {_kind(channel)}")
        if height < 0:
            height = len(channel)
            _check_side(where, "height", height)
        elif len(channel) != height:
            raise ImageError(f"{at_channel}: {len(channel)} rows, expected {height}")
        for h, row in enumerate(channel):
            at_row = f"{at_channel}[{h}]"
            if not isinstance(row, list):
                raise ImageError(f"{at_row}: expected a list of numbers, got {_kind(row)}")
            if width < 0:
                width = len(row)
                _check_side(where, "width", width)
            elif len(row) != width:
                raise ImageError(f"{at_row}: row of {len(row)} values, expected {width}")
            numbers.extend(_number(item, f"{at_row}[{w}]") for w, item in enumerate(row))
    return torch.tensor(numbers, dtype=torch.float32).view(CHANNELS, height, width)


def _number(item: Any, where: str) -> float:
    if isinstance(item, bool) or not isinstance(item, (int, float)):
        raise ImageError(f"{where}: expected a number, got {_kind(item)}")
    try:
        return float(item)
    except OverflowError:
        raise ImageError(f"{where}: number too large") from None


def _kind(item: Any) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
    }
    return "null" if item is None else names.get(type(item), type(item).__name__)


def _parse_raw(value: dict[Any, Any], where: str) -> torch.Tensor:
    missing = [field for field in _FIELDS if field not in value]
    unknown = [key for key in value if key not in _FIELDS]
    if missing or unknown:
        problem = f"missing {missing[0]}" if missing else f"unknown key {unknown[0]!r}"
        raise ImageError(f"{where}: {problem}; expected an object with data, dtype and shape")
    dtype = value["dtype"]
    if not isinstance(dtype, str) or dtype not in IMAGE_DTYPES:
        raise ImageError(f"{where}.dtype: {dtype!r:.40} is not one of {', '.join(IMAGE_DTYPES)}")
    shape = value["shape"]
    if not (
        isinstance(shape, list)
        and len(shape) == 3
        and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
    ):
        raise ImageError(f"{where}.shape: expected three integers [3, height, width]")
    _check_shape(f"{where}.shape: [{', '.join(_show(d) for d in shape)}]", tuple(shape))
    data = value["data"]
    if not isinstance(data, str):
        raise ImageError(f"{where}.data: expected a base64 string, got {_kind(data)}")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:  # binascii.Error, or non-ASCII characters
        raise ImageError(f"{where}.data: not valid base64") from None
    torch_dtype = _TORCH_DTYPES[dtype]
    expected = math.prod(shape) * torch_dtype.itemsize
    if len(raw) != expected:
        raise ImageError(
            f"{where}.data: {len(raw)} bytes, expected {expected} "
            f"({' * '.join(map(str, shape))} {dtype} values)"
        )
    image = torch.frombuffer(bytearray(raw), dtype=torch_dtype).view(*shape)
    if torch_dtype == torch.uint8:
        return image.to(torch.float32) / 255.0
    return image.to(torch.float32, copy=True)


# ---------------------------------------------------------------- model


@dataclass
class _LayerWeights:
    attn_norm: torch.Tensor  # [width]
    qkv_t: torch.Tensor  # [width, 3 * local width]: this rank's heads' Q | K | V columns
    out_chunks: torch.Tensor  # this rank's [chunks, width / REDUCTION_CHUNKS, width] stack
    mlp_norm: torch.Tensor  # [width]
    fc1_t: torch.Tensor  # [width, MLP_RATIO * width / tp]
    fc2_chunks: torch.Tensor  # [chunks, MLP_RATIO * width / REDUCTION_CHUNKS, width]


class EncoderModel:
    """A tiny ViT: [3, H, W] image -> [N, hidden_size] embeddings, one per patch."""

    def __init__(
        self,
        hidden_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        tp: int = 1,
        tp_rank: int = 0,
        gather: ops.AllGather | None = None,
    ) -> None:
        if hidden_size < 1:
            raise ValueError(f"hidden_size {hidden_size} must be positive")
        problem = encoder_tp_problem(tp)
        if problem is not None or not 0 <= tp_rank < tp or (tp > 1) != (gather is not None):
            raise ValueError(problem or f"rank {tp_rank} of {tp}: a gather for TP > 1 only")
        self.hidden_size = hidden_size
        self.width = WIDTH
        self.head_dim = WIDTH // NUM_HEADS
        self.local_heads = NUM_HEADS // tp
        self.local_width = self.local_heads * self.head_dim  # this rank's attention columns
        self.dtype = dtype
        self.device = torch.device(device)
        self.gather = gather
        # Rank 0 of a TP encoder: called with each checked image before computing it,
        # to hand it to the other ranks (roles/encoder.py sets it).
        self.announce: Callable[[torch.Tensor], None] | None = None
        source = preset_source(seed)

        def get(name: str, dims: tuple[int, ...]) -> torch.Tensor:
            """A seeded float32 tensor (weights [out, in] scaled by 1/sqrt(in))."""
            return source(f"encoder.{name}", dims)

        def place(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device=self.device, dtype=dtype).contiguous()

        patch_in = CHANNELS * PATCH * PATCH
        self.patch_t = place(get("patch_embed.weight", (WIDTH, patch_in)).t())  # [48, width]
        self.patch_bias = place(get("patch_embed.bias", (WIDTH,)))
        self.positions = place(get("position_embedding.weight", (GRID * GRID, WIDTH)))
        local = self.local_width
        mine = slice(tp_rank * local, (tp_rank + 1) * local)
        inner = MLP_RATIO * WIDTH
        inner_mine = slice(tp_rank * inner // tp, (tp_rank + 1) * inner // tp)
        self.layers: list[_LayerWeights] = []
        for i in range(NUM_LAYERS):
            prefix = f"layers.{i}."
            qkv = get(prefix + "attn.qkv.weight", (3 * WIDTH, WIDTH))  # [Q | K | V, width]
            qkv_mine = torch.cat([qkv[part * WIDTH :][mine] for part in range(3)])
            out_t = get(prefix + "attn.out.weight", (WIDTH, WIDTH)).t()
            fc2_t = get(prefix + "mlp.fc2.weight", (WIDTH, inner)).t()
            self.layers.append(
                _LayerWeights(
                    attn_norm=place(get(prefix + "attn_norm.weight", (WIDTH,))),
                    qkv_t=place(qkv_mine.t()),
                    out_chunks=place(row_chunks(out_t, tp, tp_rank)),
                    mlp_norm=place(get(prefix + "mlp_norm.weight", (WIDTH,))),
                    fc1_t=place(get(prefix + "mlp.fc1.weight", (inner, WIDTH))[inner_mine].t()),
                    fc2_chunks=place(row_chunks(fc2_t, tp, tp_rank)),
                )
            )
        self.final_norm = place(get("final_norm.weight", (WIDTH,)))
        # N(0, 1/width) weights on a unit-RMS input: unit-RMS outputs, the scale of the
        # preset token embeddings (standard normal), so the LM does attend to the image.
        projection = get("projection.weight", (hidden_size, WIDTH))
        padded = projection.new_zeros((ops.round_up(hidden_size, ops.TILE), WIDTH))
        padded[:hidden_size] = projection
        self.projection_t = place(padded.t())  # [width, hidden padded to TILE]

    @torch.inference_mode()
    def encode(self, image: torch.Tensor) -> torch.Tensor:
        """[3, H, W] float32 -> [N, hidden_size] in `dtype` on `device`, N patches row-major."""
        if image.dim() != 3:
            raise ImageError(f"image: {image.dim()} dimensions, expected [3, height, width]")
        channels, height, width = (int(d) for d in image.shape)
        _check_shape(f"image: shape [{channels}, {height}, {width}]", (channels, height, width))
        if self.announce is not None:
            self.announce(image)
        rows, cols = height // PATCH, width // PATCH
        count = rows * cols
        pixels = image.to(device=self.device, dtype=torch.float32)
        patches = (
            pixels.reshape(CHANNELS, rows, PATCH, cols, PATCH)
            .permute(1, 3, 0, 2, 4)  # [rows, cols, C, PATCH, PATCH]
            .reshape(count, CHANNELS * PATCH * PATCH)
        )
        grid_index = (
            torch.arange(rows, device=self.device)[:, None] * GRID
            + torch.arange(cols, device=self.device)[None, :]
        ).reshape(-1)  # [N]
        x = ops.matmul(patches, self.patch_t) + self.patch_bias
        x = ops.pad_rows(x + self.positions[grid_index])  # [N padded, width]
        everyone = torch.full((count,), count - 1, dtype=torch.int64, device=self.device)
        local = self.local_width
        for layer in self.layers:
            h = ops.rms_norm(x, layer.attn_norm, RMS_EPS)
            qkv = ops.matmul(h, layer.qkv_t)  # [N padded, 3 * local]
            q, k, v = (
                qkv[:count, i * local : (i + 1) * local].reshape(
                    count, self.local_heads, self.head_dim
                )
                for i in range(3)
            )
            # Non-causal: every query sits at the last position, so it sees every patch.
            scale = self.head_dim**-0.5
            attn = attention.sequence_attention(q, k, v, everyone, scale)  # [N, heads, dim]
            attn = ops.pad_rows(attn.reshape(count, local))
            x = x + ops.row_parallel_matmul(attn, layer.out_chunks, self.gather)
            h = ops.rms_norm(x, layer.mlp_norm, RMS_EPS)
            act = torch.nn.functional.gelu(ops.matmul(h, layer.fc1_t))
            x = x + ops.row_parallel_matmul(act, layer.fc2_chunks, self.gather)
        h = ops.rms_norm(x, self.final_norm, RMS_EPS)
        return ops.matmul(h, self.projection_t)[:count, : self.hidden_size].contiguous()
