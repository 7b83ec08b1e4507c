"""`pdctl bench ...`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from pdctl import console
from pdctl.cli.common import JsonOption, QuietOption, VerboseOption, options
from pdctl.errors import UsageError

bench_app = typer.Typer(help="Benchmarks (figures go to docs/benchmarks.md).", no_args_is_help=True)

STAGING_TARGETS = {"cpu": 0.6, "cuda": 0.85}


@bench_app.command("staging")
def staging(
    ctx: typer.Context,
    device: Annotated[str, typer.Option(help="Device type: cpu, cuda, xpu, ...")] = "cpu",
    repeats: Annotated[int, typer.Option(min=1, help="Timed repeats per operation.")] = 7,
    token_scale: Annotated[
        int | None, typer.Option(min=1, help="Divide token counts by this (default: 4 on cpu).")
    ] = None,
    backend: Annotated[str | None, typer.Option(help="Kernel backend: torch or triton.")] = None,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Gather and scatter bandwidth as a fraction of a plain copy on the same device."""
    opts = options(ctx, json, verbose, quiet)
    from pdctl.staging.bench import run_staging_bench  # imports torch: only when asked

    device_type = device.split(":", 1)[0]
    try:
        results = run_staging_bench(
            device, token_scale=token_scale, repeats=repeats, backend=backend
        )
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"cannot run the staging benchmark on {device}: {exc}") from None
    target = STAGING_TARGETS.get(device_type)
    if opts.json:
        console.emit_json(
            {"device": device, "target_ratio": target, "results": [r.to_json() for r in results]}
        )
        return
    table = Table(title=f"staging bench on {device} (ratio = copy time / op time)")
    for column in (
        "shape",
        "tokens run",
        "MiB",
        "copy GB/s",
        "gather GB/s",
        "gather x",
        "scatter GB/s",
        "scatter x",
    ):
        table.add_column(column, justify="left" if column == "shape" else "right")
    for r in results:
        marks = [
            f"{ratio:.2f}" + ("" if target is None or ratio >= target else " (below)")
            for ratio in (r.gather_ratio, r.scatter_ratio)
        ]
        table.add_row(
            r.shape, str(r.tokens_run), f"{r.bytes_moved / 2**20:.0f}", f"{r.copy_gbps:.1f}",
            f"{r.gather_gbps:.1f}", marks[0], f"{r.scatter_gbps:.1f}", marks[1],
        )  # fmt: skip
    console.out.print(table)
    if target is not None:
        console.info(
            f"target on {device_type}: >= {target}x of a plain copy; backend {results[0].backend}"
        )
