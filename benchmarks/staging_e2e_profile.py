"""Where an end-to-end staging call's time goes on an accelerator, per bench shape.

    python benchmarks/staging_e2e_profile.py [--device cuda] [--json out.json] [--trace DIR]
        [--upload ahead|kernel|copy]

For each `pdctl bench staging` shape, gather and scatter as the bench calls them
(checked wrapper, page ids uploaded from pinned memory, graph replays):

- `e2e_10`, `e2e_50`: the bench's measure (operations back to back between device
  events) with 10 and 50 operations, as a fraction of a device copy timed the same way.
- `host_us`: host work per call with the device idle (synchronised before each call).
- `device_us`: the device's time per call, from a profiler trace of 10 calls back to
  back (kernels and copies), with the idle gaps between them (`gap_us`), and the
  delay from the first event to the first device work (`lead_us`).

`--stress CALLS` checks instead of timing: per shape, CALLS gathers and CALLS scatters
replayed back to back with the page list changing on every call (three lists in
turn), nothing synchronised in between; each call's staged bytes are kept on the
device, then compared bitwise with an eager gather of that call's pages. A replay
that read another call's ids, or ids not yet uploaded, shows as a mismatch (run it
under `compute-sanitizer` to catch an access out of bounds as well).

`--upload`: how a replay's ids reach the device: copied ahead of its graph (the
default), or inside it by the upload kernel or a copy node (`StagingSettings`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdctl.staging import bench, kernels
from pdctl.staging.kernels import gather_all_layers_to_staging, scatter_staging_to_kv
from pdctl.staging.kernels.captured import CapturedCalls
from pdctl.staging.settings import StagingSettings

UPLOADS = {
    "ahead": StagingSettings(),
    "kernel": StagingSettings(upload_ahead=False, upload_kernel=True),
    "copy": StagingSettings(upload_ahead=False, upload_kernel=False),
}


def host_us(device: torch.device, operation: Callable[[], object], calls: int = 200) -> float:
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize(device)  # cuda-only: benchmark script
        start = time.perf_counter()
        operation()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def device_timeline(
    device: torch.device, operation: Callable[[], object], trace: Path | None, name: str
) -> dict[str, float]:
    """Device activity of 10 calls back to back: busy, gaps, and the first call's lead."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)  # cuda-only: benchmark script
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        marker = torch.cuda.Event()  # cuda-only: benchmark script
        marker.record()
        host_start = time.perf_counter()
        for _ in range(10):
            operation()
        host_end = time.perf_counter()
        torch.cuda.synchronize(device)  # cuda-only: benchmark script
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace / f"{name}.json"))
    spans = []
    for event in prof.events():
        kind = str(getattr(event, "device_type", ""))
        if "CUDA" not in kind:
            continue
        interval = event.time_range
        spans.append((interval.start, interval.end, event.name))
    spans.sort()
    if not spans:
        return {"host_loop_us": (host_end - host_start) * 1e6}
    busy = sum(end - start for start, end, _ in spans)
    gaps = [max(0.0, spans[i + 1][0] - spans[i][1]) for i in range(len(spans) - 1)]
    names: dict[str, float] = {}
    for start, end, label in spans:
        names[label[:60]] = names.get(label[:60], 0.0) + (end - start)
    return {
        "device_events": len(spans),
        "device_busy_us_per_call": busy / 10,
        "gap_us_per_call": sum(gaps) / 10,
        "largest_gap_us": max(gaps) if gaps else 0.0,
        "span_us_per_call": (spans[-1][1] - spans[0][0]) / 10,
        "host_loop_us_per_call": (host_end - host_start) * 1e6 / 10,
        "by_name_us_per_call": {key: value / 10 for key, value in names.items()},
    }


@dataclass(frozen=True)
class Layout:
    """A bench shape's sizes as the bench calls it: a pool a quarter larger than the
    pages moved, half the heads to one decode rank."""

    num_pages: int
    pool_pages: int
    heads: int
    nbytes: int  # staged bytes

    @classmethod
    def of(cls, shape: bench.Shape) -> Layout:
        num_pages = shape.num_tokens // shape.page_size
        heads = max(1, shape.num_heads // 2)
        nbytes = 2 * shape.num_layers * shape.num_tokens * heads * shape.head_dim * 2
        return cls(num_pages, num_pages + num_pages // 4 + 1, heads, nbytes)

    def pools(
        self, shape: bench.Shape, device: torch.device, generator: torch.Generator | None = None
    ) -> tuple[list[torch.Tensor], ...]:
        """Prefill's K and V (all heads) and decode's (its half): ones, or random with a
        generator."""

        def pool(num_heads: int) -> list[torch.Tensor]:
            size = (self.pool_pages * shape.page_size, num_heads, shape.head_dim)
            return [
                torch.randn(size, dtype=torch.bfloat16, device=device, generator=generator)
                if generator is not None
                else torch.ones(size, dtype=torch.bfloat16, device=device)
                for _ in range(shape.num_layers)
            ]

        return pool(shape.num_heads), pool(shape.num_heads), pool(self.heads), pool(self.heads)


def profile_shape(shape: bench.Shape, device: torch.device, trace: Path | None) -> dict:
    layout = Layout.of(shape)
    heads, nbytes = layout.heads, layout.nbytes
    pk, pv, dk, dv = layout.pools(shape, device)
    generator = torch.Generator().manual_seed(0)
    pages = torch.randperm(layout.pool_pages, generator=generator)[: layout.num_pages].pin_memory()
    staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
    source = torch.full((nbytes // 2,), 7.0, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)

    operations: dict[str, Callable[[], object]] = {
        "copy": lambda: target.copy_(source),
        "gather": lambda: gather_all_layers_to_staging(
            pk, pv, pages, staging, src_head_start=heads, num_heads=heads,
            page_size=shape.page_size, backend="triton",
        ),
        "scatter": lambda: scatter_staging_to_kv(
            staging, dk, dv, pages, page_size=shape.page_size, dst_head_start=0,
            num_heads=heads, backend="triton",
        ),
    }  # fmt: skip
    for operation in operations.values():
        for _ in range(6):  # past the graphs' capture
            operation()
    row: dict = {"shape": shape.label, "mib": nbytes / 2**20}
    for iterations in (10, 50):
        times = {key: [] for key in operations}
        for _ in range(7):
            for key, operation in operations.items():
                times[key].append(bench._timed(device, operation, iterations))
        median = {key: statistics.median(values) for key, values in times.items()}
        row[f"copy_us_{iterations}"] = median["copy"] * 1e6
        for key in ("gather", "scatter"):
            row[f"{key}_e2e_{iterations}"] = median["copy"] / median[key]
            row[f"{key}_us_{iterations}"] = median[key] * 1e6
    for key, operation in operations.items():
        row[f"{key}_host_us"] = host_us(device, operation)
        row[f"{key}_timeline"] = device_timeline(
            device,
            operation,
            trace,
            f"{shape.num_layers}x{shape.num_heads}-p{shape.page_size}-{key}",
        )
    return row


def stress_shape(shape: bench.Shape, device: torch.device, calls: int) -> list[str]:
    """Replays with a changing page list, checked bitwise (see the module's docstring);
    returns the mismatches found."""
    layout = Layout.of(shape)
    heads, nbytes = layout.heads, layout.nbytes
    backend = "triton" if device.type == "cuda" else None
    generator = torch.Generator(device=device).manual_seed(1)
    pk, pv, dk, dv = layout.pools(shape, device, generator)
    host_generator = torch.Generator().manual_seed(2)
    lists = [
        torch.randperm(layout.pool_pages, generator=host_generator)[: layout.num_pages]
        for _ in range(3)
    ]
    if device.type == "cuda":
        lists = [pages.pin_memory() for pages in lists]  # as a scheduler keeps them
    on_device = [pages.to(device) for pages in lists]
    staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sources = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device,
                             generator=generator) for _ in range(3)]  # fmt: skip

    def gather(pages: torch.Tensor, into: torch.Tensor, k: list, v: list, first: int) -> None:
        gather_all_layers_to_staging(
            k, v, pages, into, src_head_start=first, num_heads=heads,
            page_size=shape.page_size, backend=backend,
        )  # fmt: skip

    def scatter(pages: torch.Tensor) -> None:
        scatter_staging_to_kv(
            staging, dk, dv, pages, page_size=shape.page_size, dst_head_start=0,
            num_heads=heads, backend=backend,
        )  # fmt: skip

    for call in range(6):  # past the graphs' capture
        gather(lists[call % 3], staging, pk, pv, heads)
        staging.copy_(sources[call % 3])
        scatter(lists[call % 3])
    gathered = [torch.empty_like(staging) for _ in range(calls)]
    landed = [torch.empty_like(staging) for _ in range(calls)]
    for call in range(calls):
        gather(lists[call % 3], staging, pk, pv, heads)  # replayed
        gathered[call].copy_(staging)
        staging.copy_(sources[call % 3])
        scatter(lists[call % 3])  # replayed
        gather(on_device[call % 3], landed[call], dk, dv, 0)  # eager: what landed
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # cuda-only: benchmark script
    problems = []
    for call in range(calls):
        expected = torch.empty_like(staging)
        gather(on_device[call % 3], expected, pk, pv, heads)
        if not torch.equal(gathered[call], expected):
            problems.append(f"{shape.label}: gather call {call} staged other bytes")
        if not torch.equal(landed[call], sources[call % 3]):
            problems.append(f"{shape.label}: scatter call {call} landed other bytes")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--shapes", default="0,1,2,3")
    parser.add_argument("--stress", type=int, default=0, help="check CALLS replays instead")
    parser.add_argument("--upload", choices=sorted(UPLOADS), default="ahead")
    args = parser.parse_args()
    kernels.CAPTURED = CapturedCalls(settings=UPLOADS[args.upload])  # this process's switches
    device = torch.device(args.device)
    if args.stress:
        found = []
        for index in (int(i) for i in args.shapes.split(",")):
            problems = stress_shape(bench.SHAPES[index], device, args.stress)
            print(f"{bench.SHAPES[index].label}: {len(problems)} mismatches", flush=True)
            found += problems
        print("\n".join(found) or "stress: every replay staged and landed the right bytes")
        raise SystemExit(1 if found else 0)
    trace = Path(args.trace) if args.trace else None
    rows = []
    for index in (int(i) for i in args.shapes.split(",")):
        row = profile_shape(bench.SHAPES[index], device, trace)
        rows.append(row)
        print(f"{row['shape']}: copy {row['copy_us_10']:.1f} us", flush=True)
        for key in ("gather", "scatter"):
            line = row[f"{key}_timeline"]
            print(
                f"  {key:<8} e2e10 {row[f'{key}_e2e_10']:.2f} e2e50 {row[f'{key}_e2e_50']:.2f}"
                f"  {row[f'{key}_us_10']:.1f} us/op  host {row[f'{key}_host_us']:.1f} us"
                f"  device busy {line.get('device_busy_us_per_call', 0):.1f}"
                f" gaps {line.get('gap_us_per_call', 0):.1f}"
                f" (max {line.get('largest_gap_us', 0):.1f})"
                f" host loop {line.get('host_loop_us_per_call', 0):.1f}",
                flush=True,
            )
            print(f"           {line.get('by_name_us_per_call')}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
