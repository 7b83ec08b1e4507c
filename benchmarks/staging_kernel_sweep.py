"""Sweep Triton tile shapes for the staging kernel on an accelerator; print ratios to a copy.

    python benchmarks/staging_kernel_sweep.py [--device cuda]

Each variant patches the backend's tile choice and runs the staging bench shapes,
so the table shows which (bytes per program, warps) reaches the copy bandwidth.
"""

from __future__ import annotations

import argparse

from pdctl.staging import bench
from pdctl.staging.kernels import triton as triton_kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    original = triton_kernels.tile
    print(
        f"{'tile KiB':>8} {'warps':>5}  " + "  ".join(f"{s.label[:22]:>22}" for s in bench.SHAPES)
    )
    for tile_kib in (8, 16, 32, 64):
        for warps in (4, 8, 16):

            def tile(
                num_cols: int, word: int, kib: int = tile_kib, w: int = warps
            ) -> tuple[int, int, int]:
                triton_kernels.TILE_BYTES = kib * 1024
                block_t, block_c, _ = original(num_cols, word)
                return block_t, block_c, w

            triton_kernels.tile = tile
            rows = bench.run_staging_bench(args.device, repeats=args.repeats, backend="triton")
            cells = "  ".join(f"{r.gather_ratio:>10.2f} {r.scatter_ratio:>10.2f}" for r in rows)
            print(f"{tile_kib:>8} {warps:>5}  {cells}", flush=True)
    triton_kernels.tile = original


if __name__ == "__main__":
    main()
