"""Staging bandwidth benchmark: gather and scatter versus a plain copy, side by side.

For each shape (layers x KV heads x head dim, tokens, page size; bf16; half of the
heads to one decode rank, as prefill TP1 -> decode TP2), one run times a plain
device copy of the staged bytes, the gather from a prefill pool into staging, and
the scatter from staging into a decode pool. Page indices start on the host
(pinned on accelerators, as a scheduler keeps them), so their upload is inside the
timed gather and scatter. On an accelerator each timing spans ten back-to-back
operations between device events, host work included as it overlaps; on the CPU
the clock times each operation. Operations are interleaved so that all three see
the same machine conditions; the median of the repeats is reported. On the CPU
each timed operation is preceded by an untimed run of itself, so none pays for the
one before it: a copy leaves tens of megabytes of written lines in the cache, and
whichever operation came next paid for writing them back (the gather, always after
the copy, measured 0.53-0.78 of it that way against 0.84-1.02 settled on 28 x 2 x 128
on the 2-core development machine).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from pdctl.staging import device as dev
from pdctl.staging.kernels import gather_slice, scatter_slice
from pdctl.staging.kernels.base import default_backend
from pdctl.staging.layout import KVSlice


@dataclass(frozen=True)
class Shape:
    num_layers: int
    num_heads: int
    head_dim: int
    num_tokens: int
    page_size: int

    @property
    def label(self) -> str:
        return (
            f"{self.num_layers} x {self.num_heads} x {self.head_dim}, "
            f"{self.num_tokens} tokens, page {self.page_size}"
        )


SHAPES = (
    Shape(32, 8, 128, 4096, 1),
    Shape(32, 8, 128, 4096, 64),
    Shape(28, 2, 128, 8192, 1),
    Shape(61, 8, 128, 16384, 64),
)


@dataclass(frozen=True)
class Result:
    shape: str
    tokens_run: int
    bytes_moved: int
    backend: str
    copy_gbps: float
    gather_gbps: float
    scatter_gbps: float
    gather_ratio: float
    scatter_ratio: float

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _timed(device: torch.device, operation: Callable[[], object], iterations: int) -> float:
    """Seconds per operation, `iterations` issued back to back.

    On an accelerator the time comes from device events around the whole batch, so
    host work overlaps device work as it does in a server; on the CPU from the clock.
    """
    if device.type == "cpu":
        operation()  # settles: the write-back of what ran before is not this one's
        start = time.perf_counter()
        for _ in range(iterations):
            operation()
        return (time.perf_counter() - start) / iterations
    module = dev.get_device_module(device)
    begin, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
    dev.synchronize(device)
    begin.record()
    for _ in range(iterations):
        operation()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000 / iterations


def run_shape(
    shape: Shape, device: torch.device, *, token_scale: int, repeats: int, backend: str | None
) -> Result:
    tokens = max(shape.page_size, shape.num_tokens // token_scale)
    tokens -= tokens % shape.page_size
    num_pages = tokens // shape.page_size
    pool_pages = num_pages + num_pages // 4 + 1
    pool_tokens = pool_pages * shape.page_size
    heads = shape.num_heads // 2 if shape.num_heads > 1 else 1

    def pool(num_heads: int) -> list[torch.Tensor]:
        return [
            torch.full(
                (pool_tokens, num_heads, shape.head_dim), 1.0, dtype=torch.bfloat16, device=device
            )
            for _ in range(shape.num_layers)
        ]  # [pool_tokens, heads, head_dim] per layer, pages touched

    prefill_k, prefill_v = pool(shape.num_heads), pool(shape.num_heads)
    decode_k, decode_v = pool(heads), pool(heads)
    generator = torch.Generator().manual_seed(0)
    pages = torch.randperm(pool_pages, generator=generator)[:num_pages]  # host, like a scheduler's
    if device.type != "cpu":
        pages = pages.pin_memory()  # a scheduler keeps its page lists pinned: async upload
    nbytes = 2 * shape.num_layers * tokens * heads * shape.head_dim * 2
    staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
    source = torch.full((nbytes // 2,), 7.0, dtype=torch.bfloat16, device=device)  # the KV dtype
    target = torch.empty_like(source)
    name = backend or default_backend(device)

    prefill_heads = KVSlice(heads, heads, shape.page_size)  # prefill's upper heads (TP1 -> TP2)
    decode_heads = KVSlice(0, heads, shape.page_size)

    def gather() -> object:
        return gather_slice(prefill_k, prefill_v, pages, staging, prefill_heads, name)

    def scatter() -> object:
        return scatter_slice(staging, decode_k, decode_v, pages, decode_heads, name)

    timings: dict[str, list[float]] = {"copy": [], "gather": [], "scatter": []}
    operations = {"copy": lambda: target.copy_(source), "gather": gather, "scatter": scatter}
    for operation in operations.values():
        operation()  # warm-up: first touch, kernel compilation
    iterations = 1 if device.type == "cpu" else 10
    for _ in range(repeats):
        for key, operation in operations.items():
            timings[key].append(_timed(device, operation, iterations))
    median = {key: statistics.median(values) for key, values in timings.items()}
    gbps = {key: nbytes / seconds / 1e9 for key, seconds in median.items()}
    return Result(
        shape=shape.label,
        tokens_run=tokens,
        bytes_moved=nbytes,
        backend=name,
        copy_gbps=round(gbps["copy"], 2),
        gather_gbps=round(gbps["gather"], 2),
        scatter_gbps=round(gbps["scatter"], 2),
        gather_ratio=round(median["copy"] / median["gather"], 3),
        scatter_ratio=round(median["copy"] / median["scatter"], 3),
    )


def run_staging_bench(
    device_type: str,
    *,
    token_scale: int | None = None,
    repeats: int = 7,
    backend: str | None = None,
    shapes: tuple[Shape, ...] = SHAPES,
) -> list[Result]:
    """One row per shape; on the CPU token counts are divided by 4 unless told otherwise."""
    device = dev.resolve_device(device_type)
    scale = token_scale if token_scale is not None else (4 if device.type == "cpu" else 1)
    return [
        run_shape(shape, device, token_scale=scale, repeats=repeats, backend=backend)
        for shape in shapes
    ]
