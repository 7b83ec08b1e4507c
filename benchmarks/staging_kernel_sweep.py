"""Staging kernel sweep on an accelerator: where the time goes, per bench shape.

    python benchmarks/staging_kernel_sweep.py [--device cuda] [--json sweep.json]

1. Host work per call (tiny transfer): the checked wrapper, the backend, a launch.
2. Device only: each (bytes per step, programs per SM) variant, ten operations
   captured in a device graph and replayed, page ids already on the device; the
   ratio is a plain copy's time (same bytes, also a graph) over the kernel's. With
   `zero-copy`, the kernel reads the page ids from pinned host memory instead.
3. End to end: `pdctl bench staging` as it runs (wrapper, page upload, launch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import pdctl.staging.kernels as kernels
from pdctl.staging import bench
from pdctl.staging.kernels import gather_all_layers_to_staging, scatter_staging_to_kv
from pdctl.staging.kernels import triton as triton_kernels

# (KiB of token rows per step, programs per SM with walks (0: none), warps (0: by tile))
VARIANTS = [(tile, per_sm, 0) for tile in (16, 32, 64) for per_sm in (0, 4, 8)] + [
    (128, 0, 0), (128, 0, 8), (64, 0, 4), (32, 0, 4), (128, 4, 0), (256, 0, 16),
]  # fmt: skip


def per_call_us(function: Callable[[], object], device: torch.device) -> float:
    for _ in range(50):
        function()
    torch.cuda.synchronize(device)  # cuda-only: benchmark script
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            function()
        torch.cuda.synchronize(device)  # cuda-only: benchmark script
        best = min(best, (time.perf_counter() - start) / 200 * 1e6)
    return best


def host_overhead(device: torch.device) -> dict[str, float]:
    """Microseconds of host work per gather call of one page (no device work to wait on)."""
    kv = torch.ones(32, 2, 4096, 8, 128, dtype=torch.bfloat16, device=device)
    k, v = [kv[i, 0] for i in range(32)], [kv[i, 1] for i in range(32)]
    staging = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    host = torch.tensor([3], dtype=torch.int64).pin_memory()
    on_device = host.to(device)
    big = torch.randperm(4096).pin_memory()

    def call(pages: torch.Tensor) -> Callable[[], object]:
        return lambda: gather_all_layers_to_staging(
            k, v, pages, staging, src_head_start=4, num_heads=4, page_size=1
        )

    result = {
        "call, 1 page pinned": per_call_us(call(host), device),
        "call, 1 page on device": per_call_us(call(on_device), device),
    }
    backend = triton_kernels.TritonKernels
    real = backend.gather
    backend.gather = lambda self, *a, **kw: None  # type: ignore[method-assign]
    result["wrapper only, 1 page on device"] = per_call_us(call(on_device), device)
    result["wrapper only, 4096 pages pinned"] = per_call_us(call(big), device)
    backend.gather = real  # type: ignore[method-assign]
    return result


def graph_time(device: torch.device, operation: Callable[[], object], repeats: int = 7) -> float:
    """Seconds per operation: ten operations captured in a graph, replayed."""
    side = torch.cuda.Stream(device)  # cuda-only: benchmark script
    side.wait_stream(torch.cuda.current_stream(device))  # cuda-only: benchmark script
    with torch.cuda.stream(side):  # cuda-only: benchmark script
        for _ in range(3):
            operation()
    torch.cuda.current_stream(device).wait_stream(side)  # cuda-only: benchmark script
    graph = torch.cuda.CUDAGraph()  # cuda-only: benchmark script
    with torch.cuda.graph(graph):  # cuda-only: benchmark script
        for _ in range(10):
            operation()
    graph.replay()
    times = []
    for _ in range(repeats):
        begin = torch.cuda.Event(enable_timing=True)  # cuda-only: benchmark script
        end = torch.cuda.Event(enable_timing=True)  # cuda-only: benchmark script
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1000 / 10)
    return statistics.median(times)


def device_only(
    shape: bench.Shape, device: torch.device, zero_copy: bool, variants: list = VARIANTS
) -> list[dict]:
    tokens, pages = shape.num_tokens, shape.num_tokens // shape.page_size
    pool_pages = pages + pages // 4 + 1
    pool_tokens = pool_pages * shape.page_size
    heads = max(1, shape.num_heads // 2)

    def pool(num_heads: int) -> list[torch.Tensor]:
        return [
            torch.randn(pool_tokens, num_heads, shape.head_dim, device=device).to(torch.bfloat16)
            for _ in range(shape.num_layers)
        ]

    pk, pv, dk, dv = pool(shape.num_heads), pool(shape.num_heads), pool(heads), pool(heads)
    ids = torch.randperm(pool_pages)[:pages].pin_memory()
    ids_used = ids if zero_copy else ids.to(device)
    nbytes = 2 * shape.num_layers * tokens * heads * shape.head_dim * 2
    staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
    source = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
    target = torch.empty_like(source)
    real_upload = kernels.upload_pages
    if zero_copy:  # the kernel reads the pinned host ids itself
        kernels.upload_pages = lambda page_indices, page_size, info: page_indices  # type: ignore[assignment]

    def gather() -> object:
        return gather_all_layers_to_staging(
            pk, pv, ids_used, staging, src_head_start=heads, num_heads=heads,
            page_size=shape.page_size, backend="triton",
        )  # fmt: skip

    def scatter() -> object:
        return scatter_staging_to_kv(
            staging, dk, dv, ids_used, page_size=shape.page_size, dst_head_start=0,
            num_heads=heads, backend="triton",
        )  # fmt: skip

    copy = graph_time(device, lambda: target.copy_(source))
    check_bitwise(pk, pv, dk, dv, ids_used, staging, shape, heads, gather, scatter)
    rows = []
    try:
        for tile_kib, per_sm, warps in variants:
            triton_kernels.TILE_BYTES = tile_kib * 1024
            triton_kernels.PROGRAMS_PER_SM = per_sm
            triton_kernels.WARPS = warps
            triton_kernels.tile.cache_clear()
            config = triton_kernels.tile(
                heads * shape.head_dim // 4, 8, tokens, 2 * shape.num_layers, 132
            )
            g, s = graph_time(device, gather), graph_time(device, scatter)
            rows.append(
                {"shape": shape.label, "tile_kib": tile_kib, "per_sm": per_sm, "warps": warps,
                 "zero_copy": zero_copy, "config": config, "copy_gbps": nbytes / copy / 1e9,
                 "gather": copy / g, "scatter": copy / s}
            )  # fmt: skip
            print(
                f"  {tile_kib:>4} KiB  {per_sm:>2}/SM  w{warps:<2}  zero-copy {int(zero_copy)}  "
                f"gather {copy / g:5.2f}  scatter {copy / s:5.2f}  "
                f"copy {nbytes / copy / 1e9:6.0f} GB/s  {config}",
                flush=True,
            )
    finally:
        kernels.upload_pages = real_upload
        triton_kernels.WARPS = 0
    return rows


def check_bitwise(pk, pv, dk, dv, ids, staging, shape, heads, gather, scatter) -> None:  # type: ignore[no-untyped-def]
    """The default configuration's gather and scatter against index_select, bit for bit."""
    rows = (ids.to(staging.device)[:, None] * shape.page_size).reshape(-1, 1) + torch.arange(
        shape.page_size, device=staging.device
    )
    rows = rows.reshape(-1)
    staging.fill_(0xAB)
    gather()
    expected = torch.stack(
        [
            t.index_select(0, rows)[:, heads : 2 * heads]
            for pair in zip(pk, pv, strict=True)
            for t in pair
        ]
    )
    got = staging.view(torch.bfloat16).view(expected.shape)
    for t in dk + dv:
        t.fill_(0)
    scatter()
    scattered = torch.stack(
        [t.index_select(0, rows) for pair in zip(dk, dv, strict=True) for t in pair]
    )
    ok = torch.equal(got.view(torch.int16), expected.view(torch.int16)) and torch.equal(
        scattered.view(torch.int16), expected.view(torch.int16)
    )
    print(f"  bitwise gather + scatter (default tiles): {'ok' if ok else 'MISMATCH'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", default="0,1,2,3")
    args = parser.parse_args()
    device = torch.device(args.device, 0) if ":" not in args.device else torch.device(args.device)
    report: dict[str, object] = {"host_us": host_overhead(device)}
    for name, value in report["host_us"].items():  # type: ignore[attr-defined]
        print(f"host: {name}: {value:.1f} us", flush=True)
    defaults = (triton_kernels.TILE_BYTES, triton_kernels.PROGRAMS_PER_SM)
    rows = []
    for index in (int(i) for i in args.shapes.split(",")):
        shape = bench.SHAPES[index]
        print(shape.label, flush=True)
        rows += device_only(shape, device, zero_copy=False)
        torch.cuda.empty_cache()  # cuda-only: benchmark script
    report["device_only"] = rows
    triton_kernels.TILE_BYTES, triton_kernels.PROGRAMS_PER_SM = defaults
    triton_kernels.tile.cache_clear()
    for shape in (bench.SHAPES[0], bench.SHAPES[2]):
        print(shape.label, "(page ids read from pinned host memory)", flush=True)
        try:
            rows += device_only(shape, device, zero_copy=True, variants=[(128, 0, 0)])
        except Exception as error:  # an experiment: report and go on
            print(f"  zero-copy failed: {error!r}", flush=True)
    triton_kernels.TILE_BYTES, triton_kernels.PROGRAMS_PER_SM = defaults
    triton_kernels.tile.cache_clear()
    end_to_end = bench.run_staging_bench(args.device, repeats=7, backend="triton")
    report["end_to_end"] = [r.to_json() for r in end_to_end]
    print(f"end to end, defaults {defaults}:")
    for r in end_to_end:
        print(f"  {r.shape:<38} copy {r.copy_gbps:6.0f} GB/s  gather {r.gather_ratio:.2f}  "
              f"scatter {r.scatter_ratio:.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
