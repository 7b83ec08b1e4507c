"""`pdctl bench ...`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from pdctl import console
from pdctl.cli.common import JsonOption, QuietOption, VerboseOption, options
from pdctl.errors import UsageError

if TYPE_CHECKING:  # the launch package loads with the command, not with the CLI
    from pdctl.launch.bench import PdReport
    from pdctl.staging.transport.bench import TransportBenchReport

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
            r.shape,
            str(r.tokens_run),
            f"{r.bytes_moved / 2**20:.0f}",
            f"{r.copy_gbps:.1f}",
            f"{r.gather_gbps:.1f}",
            marks[0],
            f"{r.scatter_gbps:.1f}",
            marks[1],
        )
    console.out.print(table)
    if target is not None:
        console.info(
            f"target on {device_type}: >= {target}x of a plain copy; backend {results[0].backend}"
        )


@bench_app.command("transport")
def transport(
    ctx: typer.Context,
    plot: Annotated[
        Path | None, typer.Option(help="Also draw GB/s per size into this PNG (needs matplotlib).")
    ] = None,
    quick: Annotated[bool, typer.Option(help="Fewer sizes and repeats (a smoke run).")] = False,
    device: Annotated[
        str, typer.Option(help="Memory of this device on both sides: cpu, cuda, cuda:1, xpu...")
    ] = "cpu",
    json: JsonOption = False,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Each transport cross-process on loopback: GB/s, p50/p99, the first write, checked
    bytes, beside the copy ceiling (memcpy, or the device's own copy)."""
    opts = options(ctx, json, verbose, quiet)
    from pdctl.staging.transport import bench as transport_bench

    sizes = (4096, 1 << 20, 64 << 20) if quick else transport_bench.SIZES
    if device != "cpu" and not quick:
        sizes = (*sizes, 1 << 30)
    report = transport_bench.run_transport_bench(
        sizes=sizes, budget_bytes=(256 << 20) if quick else (2 << 30), device=device
    )
    if plot is not None:
        _plot(report, plot)
    if opts.json:
        console.emit_json(report)
        return
    table = Table(
        title=f"transport bench, {device} memory, cross-process on loopback (write to completion)"
    )
    columns = ("variant", "size", "GB/s", "p50 ms", "p99 ms", "first ms", "connect ms", "bytes ok")
    for column in columns:
        table.add_column(column, justify="left" if column in ("variant", "size") else "right")
    for row in report["rows"]:
        first, connect = row.get("first_ms"), row.get("connect_ms")
        table.add_row(
            row["variant"],
            row["label"],
            f"{row['gbps']:.2f}",
            f"{row['p50_ms']:.3f}",
            f"{row['p99_ms']:.3f}",
            "-" if first is None else f"{first:.3f}",
            "-" if connect is None else f"{connect:.3f}",
            "yes" if row["consistent"] else "NO",
        )
    console.out.print(table)
    for variant, reason in report["unavailable"].items():
        console.warning(f"{variant} not measured: {reason}")
    console.info(f"targets at {report['targets']['size']}: {report['targets']}")


def _plot(report: TransportBenchReport, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib", "pip install matplotlib") from None
    rows = [r for r in report["rows"] if " x " not in r["label"] and "first" not in r["label"]]
    figure, axes = plt.subplots(figsize=(7, 4))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        points = [(r["nbytes"], r["gbps"]) for r in rows if r["variant"] == variant]
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("bytes per write")
    axes.set_ylabel("GB/s")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


@bench_app.command("engine")
def engine(
    ctx: typer.Context,
    preset: Annotated[str, typer.Option(help="Model preset: tiny (CPU) or small (GPU).")] = "tiny",
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
    modes: Annotated[
        str,
        typer.Option(
            help="deterministic (fixed-order kernels, the default serving mode) and/or "
            "vendor (serving.deterministic: false), side by side"
        ),
    ] = "deterministic,vendor",
    json: JsonOption = False,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Embedded engine tokens/s and per-step latency at batch 1, 8 and 32, per mode."""
    import json as json_module
    import subprocess
    import sys

    opts = options(ctx, json, verbose, quiet)
    argv = [sys.executable, "-m", "pdctl.serve.bench"]
    argv += ["--preset", preset, "--device", device, "--modes", modes, "--json"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise UsageError(f"the engine benchmark failed: {result.stderr.strip()[-500:]}")
    report = json_module.loads(result.stdout.strip().splitlines()[-1])
    if opts.json:
        console.emit_json(report)
        return
    graphs = report.get("cuda_graphs", {})
    graphed = "on" if graphs.get("enabled") else f"off: {graphs.get('reason')}"
    table = Table(
        title=f"engine bench: {report['preset']} on {report['device']} ({report['dtype']}, "
        f"CUDA graphs {graphed}); weight-read bound {report['bound_ms']:.3f} ms "
        f"({report['weight_bytes'] / 1e9:.2f} GB at {report['read_gbps']:.0f} GB/s)"
    )
    for column in ("mode", "kernels", "batch", "tokens/s", "ms/step", "/ bound", "steps"):
        table.add_column(column, justify="left" if column in ("mode", "kernels") else "right")
    for row in report["rows"]:
        table.add_row(
            row["mode"],
            row["kernels"],
            str(row["batch"]),
            f"{row['tokens_per_s']:.1f}",
            f"{row['step_ms']:.2f}",
            f"{row['vs_bound']:.1f}x",
            str(row["steps"]),
        )
    console.out.print(table)


@bench_app.command("pd")
def pd(
    ctx: typer.Context,
    topology: Annotated[
        Path, typer.Argument(help="A CPU topology file (default: the default topology).")
    ] = Path("topologies/cpu-p1d2-tcp.yaml"),
    backends: Annotated[
        str, typer.Option(help="Transports to compare, comma-separated.")
    ] = "tcp,mooncake,nixl",
    prompts: Annotated[int, typer.Option(min=1, help="Requests in the workload.")] = 12,
    prompt_len: Annotated[int, typer.Option(min=1, help="Prompt length in tokens.")] = 256,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per request.")] = 32,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight.")] = 6,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """PD against colocated, per transport: KV transfer ms and bytes, TTFT, tokens/s."""
    opts = options(ctx, json, verbose, quiet)
    from pdctl.launch import bench as pd_bench

    chosen = chosen_backends(backends)
    report = pd_bench.bench_pd(
        topology,
        backends=chosen,
        prompts=prompts,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        concurrency=concurrency,
        progress=console.info if not opts.quiet else (lambda _: None),
    )
    if opts.json:
        console.emit_json(report)
    else:
        render_pd(report)


def render_pd(report: PdReport) -> None:
    """The PD bench's table: one row per transport, the colocated server's first."""
    table = Table(
        title=f"PD bench: {report['topology']}, {report['prompts']} prompts x "
        f"{report['prompt_len']} tokens, {report['new_tokens']} new, "
        f"N = {report['concurrency']} in flight",
        caption="write ms: prefill gathering + writing one request's KV; KV ready: decode, "
        "admission to KV checked (includes prefill compute); tok/s 1: serial streaming; "
        "tok/s N: concurrent; /coloc: PD over a colocated TP1 server of the same model",
    )
    columns: tuple[str, ...] = ("config", "KiB/req", "write ms", "/ bound", "KV ready ms p50/95")
    columns += ("TTFT ms p50/95", "tok/s 1", "tok/s N", "TTFT /coloc", "tok/s /coloc")
    for column in columns:
        table.add_column(column, justify="left" if column == "config" else "right")
    for row in report["rows"]:
        transfer = (
            f"{row['transfer_ms_p50']:.1f} / {row['transfer_ms_p95']:.1f}"
            if "transfer_ms_p50" in row
            else "-"
        )
        table.add_row(
            row["config"],
            f"{row['kv_bytes_per_request'] / 1024:,.0f}" if "kv_bytes_per_request" in row else "-",
            f"{row['write_ms_mean']:.2f}" if "write_ms_mean" in row else "-",
            f"{row['write_vs_bound']:.2f}x" if "write_vs_bound" in row else "-",
            transfer,
            f"{row['ttft_ms_p50']:.1f} / {row['ttft_ms_p95']:.1f}",
            f"{row['serial_tokens_per_s']:.1f}",
            f"{row['concurrent_tokens_per_s']:.1f}",
            f"{row['ttft_vs_colocated']:.2f}x" if "ttft_vs_colocated" in row else "1.00x",
            f"{row['concurrent_tokens_per_s_vs_colocated']:.2f}x"
            if "concurrent_tokens_per_s_vs_colocated" in row
            else "1.00x",
        )
    console.out.print(table)
    if report.get("copy_gbps"):
        console.info(
            f"/ bound: write ms over the KV's bytes at the device's copy rate "
            f"({report['copy_gbps']:.0f} GB/s, measured in this run); target <= 2x"
        )
    for backend, reason in report["skipped"].items():
        console.warning(f"{backend} not measured: {reason}")


def chosen_backends(backends: str) -> tuple[str, ...]:
    """--backends as a tuple, every name a known transport."""
    from pdctl.launch.bench import BACKENDS

    chosen = tuple(b.strip() for b in backends.split(",") if b.strip())
    unknown = sorted(set(chosen) - set(BACKENDS))
    if unknown or not chosen:
        raise UsageError(
            f"--backends: unknown transport(s) {', '.join(unknown) or '(none given)'}",
            hint=f"choose from {', '.join(BACKENDS)}",
        )
    return chosen
