"""Sweep Triton tile shapes for the staging kernel on an accelerator; print ratios to a copy.

    python benchmarks/staging_kernel_sweep.py [--device cuda]

Each variant patches the backend's tile choice and runs the staging bench shapes,
so the table shows which (bytes per program, warps) reaches the copy bandwidth.
"""

from __future__ import annotations

import argparse

from pdctl.staging import bench
from pdctl.staging.kernels import triton as triton_kernels


def host_overhead(device: str) -> None:
    """Microseconds of host work per gather call, with almost no device work behind it."""
    import time

    import torch

    from pdctl.staging.kernels import gather_all_layers_to_staging

    kv = torch.ones(32, 2, 4096, 8, 128, dtype=torch.bfloat16, device=device)
    k, v = [kv[i, 0] for i in range(32)], [kv[i, 1] for i in range(32)]
    pages = torch.tensor([3], dtype=torch.int64).pin_memory()
    staging = torch.empty(1 << 20, dtype=torch.uint8, device=device)

    def call() -> None:
        gather_all_layers_to_staging(
            k, v, pages, staging, src_head_start=4, num_heads=4, page_size=1
        )

    def per_call(function) -> float:
        for _ in range(20):
            function()
        torch.cuda.synchronize()  # cuda-only: benchmark script
        start = time.perf_counter()
        for _ in range(500):
            function()
        torch.cuda.synchronize()  # cuda-only: benchmark script
        return (time.perf_counter() - start) / 500 * 1e6

    print(f"host work per gather call: {per_call(call):.1f} us")
    backend = triton_kernels.TritonKernels
    real = backend.gather
    backend.gather = lambda self, *a, **k: None
    print(f"  of which outside the backend: {per_call(call):.1f} us")
    backend.gather = real
    table, _ = triton_kernels._table([kv[0, 0].view(4096, -1).view(torch.int64)])
    pages_dev = pages.to(device)

    def launch() -> None:
        triton_kernels._copy_rows_kernel[(1, 1)](
            table, pages_dev, staging.view(torch.int64), 1, 1, 256, 0,
            NUM_COLS=128, BLOCK_T=128, BLOCK_C=128, VEC=2, ALIGNED=True, STREAMING=True,
            TO_STAGING=True, num_warps=16,
        )  # fmt: skip

    print(f"  a bare Triton launch: {per_call(launch):.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    host_overhead(args.device)
    original = triton_kernels.tile
    print(
        f"{'tile KiB':>8} {'warps':>5}  " + "  ".join(f"{s.label[:22]:>22}" for s in bench.SHAPES)
    )
    for streaming in (False, True):
        triton_kernels.STREAMING = streaming
        print(f"streaming cache hints: {streaming}")
        for tile_kib in (32, 64, 128, 256):
            for warps in (8, 16):

                def tile(
                    num_cols: int, word: int, kib: int = tile_kib, w: int = warps
                ) -> tuple[int, int, int]:
                    triton_kernels.TILE_BYTES = kib * 1024
                    original.cache_clear()
                    block_t, block_c, _ = original(num_cols, word)
                    return block_t, block_c, w

                triton_kernels.tile = tile
                rows = bench.run_staging_bench(args.device, repeats=args.repeats, backend="triton")
                cells = "  ".join(f"{r.gather_ratio:>10.2f} {r.scatter_ratio:>10.2f}" for r in rows)
                print(f"{tile_kib:>8} {warps:>5}  {cells}", flush=True)
    triton_kernels.tile = original


if __name__ == "__main__":
    main()
