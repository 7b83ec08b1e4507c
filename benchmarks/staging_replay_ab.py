"""A replayed staging call's host work done three ways, side by side in one process.

`pdctl bench staging`'s shapes on an accelerator, in rounds; each round runs every
shape once per way, the ways in turn:

- `one-call`: the default. The slot's wait, the page check (which writes the ids into
  the slot) and the launch with its events are one call into C
  (`held_replay.HeldReplay.replay_checked`).
- `armed`: the page check called from Python, then the launch and its events in one
  C call (session 18's way: `captured.CapturedCalls.arm`).
- `one-by-one`: the page check from Python, then the five driver calls one by one
  from Python (session 17's way: `StagingSettings(replay_in_c=False)`).

Prints, per shape and way, the median over rounds of the gather and scatter ratios
to a device copy (each already a median over the bench's repeats), with their range.

    python benchmarks/staging_replay_ab.py [--device cuda] [--rounds 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
from collections.abc import Iterator
from pathlib import Path

import torch

from pdctl.staging import bench, kernels
from pdctl.staging import device as dev
from pdctl.staging.kernels.captured import CapturedCalls
from pdctl.staging.settings import StagingSettings

WAYS = ("one-call", "armed", "one-by-one")


@contextlib.contextmanager
def way(name: str, device: torch.device) -> Iterator[None]:
    """The process's staging calls done `name`'s way, with a cache of their own (so
    every shape is captured anew, the way's choices made at its capture)."""
    usual = kernels.usual_ids
    kernels.CAPTURED = CapturedCalls(settings=StagingSettings(replay_in_c=name != "one-by-one"))
    if name != "one-call":
        kernels.usual_ids = lambda *args: None  # type: ignore[assignment]
    try:
        yield
    finally:
        kernels.usual_ids = usual
        dev.synchronize(device)
        kernels.CAPTURED = CapturedCalls()  # the shapes' graphs and pools let go


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--token-scale", type=int, default=1, help="tokens divided by this")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = dev.resolve_device(args.device)
    ratios: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for round_number in range(args.rounds):
        for name in WAYS:
            with way(name, device):
                for shape in bench.SHAPES:
                    result = bench.run_shape(
                        shape,
                        device,
                        token_scale=args.token_scale,
                        repeats=7,
                        backend=args.backend,
                    )
                    pair = (result.gather_ratio, result.scatter_ratio)
                    ratios.setdefault((shape.label, name), []).append(pair)
                    print(f"round {round_number + 1} {name:10s} {shape.label}: {pair}", flush=True)
    rows = []
    print(f"\n{platform.processor() or platform.machine()}, {args.rounds} rounds, medians")
    for shape in bench.SHAPES:
        for name in WAYS:
            pairs = ratios[(shape.label, name)]
            gathers, scatters = [p[0] for p in pairs], [p[1] for p in pairs]
            row = {
                "shape": shape.label, "way": name,
                "gather": statistics.median(gathers), "scatter": statistics.median(scatters),
                "gather_range": [min(gathers), max(gathers)],
                "scatter_range": [min(scatters), max(scatters)],
            }  # fmt: skip
            rows.append(row)
            print(
                f"{shape.label:40s} {name:10s} gather {row['gather']:.3f} "
                f"[{min(gathers):.3f}-{max(gathers):.3f}] scatter {row['scatter']:.3f} "
                f"[{min(scatters):.3f}-{max(scatters):.3f}]"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
