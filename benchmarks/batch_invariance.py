"""Batch invariance of the engine's products on an accelerator: vendor library vs Triton.

    python benchmarks/batch_invariance.py [--device cuda] [--json out.json]

For the `small` preset's product shapes (bf16), a row's result must not change
with the number of rows (batch size, chunked prefill) or with a column split
(tensor parallelism). Each line says at which M a row of the first 16 changed
bits, whether a half-width weight (TP 2) changed them, and the error against a
float64 product. Then the row reduction of RMSNorm, the attention score product
across query counts, and the time of both products at a few M.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from pdctl.serve.model import ops, triton_matmul

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SHAPES = ((2048, 4096), (2048, 11264), (704, 2048), (256, 2048), (2048, 32768), (2048, 2048))


def vendor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b) if a.dim() == 2 else torch.bmm(a, b)


def rows_changed(product: Product, device: torch.device, k: int, n: int) -> dict[str, object]:
    a = torch.randn(2048, k, device=device).to(torch.bfloat16)
    w = (torch.randn(k, n, device=device) / k**0.5).to(torch.bfloat16)
    first = product(a[:16], w)
    sizes = (32, 64, 128, 256, 512, 1024, 2048)
    changed = [m for m in sizes if not torch.equal(product(a[:m], w)[:16], first)]
    half = product(a[:64], w[:, : n // 2].contiguous())
    split_changed = not torch.equal(half[:16], product(a[:64], w)[:16, : n // 2])
    exact = a[:64].double() @ w.double()
    error = ((product(a[:64], w).double() - exact).norm() / exact.norm()).item()
    return {
        "k": k,
        "n": n,
        "rows_changed_at_m": changed,
        "tp_split_changed": split_changed,
        "rel_error": error,
    }


def timed_us(product: Product, a: torch.Tensor, w: torch.Tensor) -> float:
    for _ in range(3):
        product(a, w)
    torch.cuda.synchronize(a.device)  # cuda-only: benchmark script
    start = time.perf_counter()
    for _ in range(50):
        product(a, w)
    torch.cuda.synchronize(a.device)  # cuda-only: benchmark script
    return (time.perf_counter() - start) / 50 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    report: dict[str, object] = {"products": []}
    for k, n in SHAPES:
        for name, product in (("vendor", vendor), ("triton", triton_matmul.matmul)):
            row = {"kernel": name, **rows_changed(product, device, k, n)}
            report["products"].append(row)  # type: ignore[attr-defined]
            print(
                f"{name:6} K={k:5} N={n:5}: rows changed at M={row['rows_changed_at_m'] or '-'}; "
                f"TP split changed: {row['tp_split_changed']}; rel error {row['rel_error']:.1e}"
            )
    x = torch.randn(2048, 2048, device=device).to(torch.bfloat16)
    for name, reduce in (
        ("vendor mean", lambda t: t.pow(2).mean(-1, keepdim=True)),
        ("row_sums", lambda t: ops.row_sums(t.pow(2))),
    ):
        first = reduce(x[:16])
        changed = [m for m in (64, 256, 2048) if not torch.equal(reduce(x[:m])[:16], first)]
        report[name] = changed
        print(f"{name}: rows changed at M={changed or '-'}")
    q = torch.randn(16, 1024, 128, device=device).to(torch.bfloat16)
    keys = torch.randn(16, 1024, 128, device=device).to(torch.bfloat16).transpose(1, 2)
    for name, product in (("vendor", vendor), ("triton", triton_matmul.matmul)):
        full = product(q, keys)
        changed = [
            m for m in (16, 64, 256) if not torch.equal(product(q[:, :m], keys), full[:, :m])
        ]
        report[f"{name} scores"] = changed
        print(f"{name} attention scores: rows changed at query count {changed or '-'}")
    for m in (16, 256, 2048):
        a = torch.randn(m, 2048, device=device).to(torch.bfloat16)
        w = torch.randn(2048, 11264, device=device).to(torch.bfloat16)
        for name, product in (("vendor", vendor), ("triton", triton_matmul.matmul)):
            us = timed_us(product, a, w)
            report[f"{name} M={m} us"] = us
            print(f"M={m:5} {name:6}: {us:8.1f} us  {2 * m * 2048 * 11264 / us / 1e6:6.1f} TFLOP/s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
