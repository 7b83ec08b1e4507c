"""The CPU staging copy (`pdctl/staging/kernels/native_rows.c`), two or more builds side
by side in one process: gather and scatter of each `pdctl bench staging` CPU shape as a
fraction of torch's copy of the same bytes, the builds called in turn in every round.

    python benchmarks/native_rows_ab.py [--rounds 11] [REV_OR_FILE ...]

Each argument is a git revision (its `native_rows.c`) or a C file; with none, HEAD's
source against the working tree's. Medians over the rounds (the first dropped). On a
machine whose copy rate wanders from round to round (a shared VM), builds compared
this way see the same conditions; separate `pdctl bench staging` runs do not.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pdctl.staging.bench import SHAPES, Shape
from pdctl.staging.kernels import native

REPO = Path(__file__).resolve().parent.parent
SOURCE = "pdctl/staging/kernels/native_rows.c"


def source_of(name: str, scratch: Path) -> Path:
    """A C file as given, else the staging copy's source at git revision `name`."""
    if Path(name).is_file():
        return Path(name)
    text = subprocess.run(
        ["git", "show", f"{name}:{SOURCE}"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    path = scratch / f"{name.replace('/', '_')}.c"
    path.write_text(text)
    return path


def load(source: Path, label: str) -> ctypes.CDLL:
    library = ctypes.CDLL(str(native.build(source, stem=f"ab-{label}")))
    library.pdctl_copy_rows.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6 + [ctypes.c_int] * 2
    )
    return library


def run(builds: dict[str, ctypes.CDLL], rounds: int) -> None:
    for shape in SHAPES:
        run_shape(shape, builds, rounds)


def run_shape(shape: Shape, builds: dict[str, ctypes.CDLL], rounds: int) -> None:
    threads = torch.get_num_threads()
    tokens = shape.num_tokens // 4  # as `pdctl bench staging` runs on the CPU
    page = shape.page_size
    pool = (tokens // page + tokens // page // 4 + 1) * page
    heads, half = shape.num_heads, max(1, shape.num_heads // 2)
    words = shape.head_dim  # bf16 elements
    prefill = [
        torch.full((pool, heads * words), 1.0, dtype=torch.bfloat16)
        for _ in range(2 * shape.num_layers)
    ]
    decode = [
        torch.full((pool, half * words), 1.0, dtype=torch.bfloat16)
        for _ in range(2 * shape.num_layers)
    ]
    generator = torch.Generator().manual_seed(0)
    pages = torch.randperm(pool // page, generator=generator)[: tokens // page]
    staging = torch.empty((2 * shape.num_layers, tokens, half * words), dtype=torch.bfloat16)
    nbytes = staging.numel() * staging.element_size()
    source = torch.full((nbytes // 2,), 7.0, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    tables = [np.array([t.data_ptr() for t in ts], dtype=np.int64) for ts in (prefill, decode)]
    row, chunk = heads * words * 2, half * words * 2

    def copy(library: ctypes.CDLL, gather: bool) -> None:
        table = tables[0] if gather else tables[1]
        library.pdctl_copy_rows(
            table.ctypes.data, pages.data_ptr(), staging.data_ptr(), 2 * shape.num_layers,
            tokens, page, row if gather else chunk, (row - chunk) if gather else 0, chunk,
            int(gather), threads,
        )  # fmt: skip

    times: dict[str, list[float]] = {"copy": []}
    for round_index in range(rounds):
        # each build first after the copy as often as the others: what runs next to a
        # copy pays for writing its lines back
        shift = round_index % len(builds)
        order = list(builds.items())[shift:] + list(builds.items())[:shift]
        began = time.perf_counter()
        target.copy_(source)
        times["copy"].append(time.perf_counter() - began)
        for label, library in order:
            for gather in (True, False):
                began = time.perf_counter()
                copy(library, gather)
                key = f"{label} {'gather' if gather else 'scatter'}"
                times.setdefault(key, []).append(time.perf_counter() - began)
    median = {key: statistics.median(values[1:]) for key, values in times.items()}
    ratios = "; ".join(
        f"{label} {median['copy'] / median[label + ' gather']:.2f} / "
        f"{median['copy'] / median[label + ' scatter']:.2f}"
        for label in builds
    )
    print(f"{shape.label}: copy {nbytes / median['copy'] / 1e9:.1f} GB/s; {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "builds", nargs="*", help="git revisions or C files (default: HEAD, working tree)"
    )
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    names = args.builds or ["HEAD", str(REPO / SOURCE)]
    with tempfile.TemporaryDirectory() as scratch:
        builds = {}
        for index, name in enumerate(names):
            label = Path(name).stem if Path(name).is_file() else name
            label = label if label not in builds else f"{label}-{index}"
            builds[label] = load(source_of(name, Path(scratch)), f"{index}")
        print(f"gather / scatter as a fraction of torch's copy, {args.rounds} rounds, "
              f"{torch.get_num_threads()} threads", file=sys.stderr)  # fmt: skip
        run(builds, args.rounds)


if __name__ == "__main__":
    main()
