"""Engine benchmark: tokens/s and per-step latency at several batch sizes, in process.

    python -m pdctl.serve.bench [--preset tiny] [--device cpu] [--json]

Each batch size submits that many greedy requests at once (32-token prompts, 64
new tokens each) to a fresh engine and times them to completion; the step latency
is the wall time divided by the forwards the engine ran. Decode steps replay CUDA
graphs as a server's do (`model/graphs.py`; `--no-cuda-graphs`: eager).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any, TypedDict

import torch

from pdctl.serve.engine.kv_pool import KVPool, ReqToToken
from pdctl.serve.engine.loop import Engine
from pdctl.serve.engine.radix import RadixCache
from pdctl.serve.engine.request import Request
from pdctl.serve.engine.sampling import SamplingParams
from pdctl.serve.engine.scheduler import Budget, Scheduler
from pdctl.serve.model import ops
from pdctl.serve.model.graphs import DecodeGraphs
from pdctl.serve.model.runner import ModelRunner
from pdctl.serve.model.weights import (
    RankWeights,
    build_rank_weights,
    preset_config,
    preset_source,
)
from pdctl.serve.runtime import retain_host_memory
from pdctl.serve.tokenizer import ByteTokenizer

DTYPES = {"cpu": torch.float32}
THREADS = torch.get_num_threads()  # torch's own default, before any server setting


class Timing(TypedDict):
    """One batch's requests run to the end together."""

    batch: int
    tokens_per_s: float
    step_ms: float
    steps: int
    seconds: float


class Row(Timing):
    """A row of the report: the timing with its mode and its steps replayed as graphs."""

    mode: str
    kernels: str
    graph_steps: int
    vs_bound: float


def run_batch(engine: Engine, batch: int, prompt_len: int, new_tokens: int) -> Timing:
    remaining = [batch]
    done = threading.Event()
    lock = threading.Lock()
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    forwards = engine.stats.forwards
    start = time.perf_counter()
    for i in range(batch):
        prompt = [(7 * i + j) % 256 for j in range(prompt_len)]

        def sink(event: Any) -> None:  # runs on the scheduler thread: never block here
            if event.finish_reason is not None or event.error is not None:
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()

        engine.submit(Request(f"bench-{batch}-{i}-{time.monotonic_ns()}", prompt, params, sink))
    done.wait(timeout=600)
    elapsed = time.perf_counter() - start
    steps = engine.stats.forwards - forwards
    return {
        "batch": batch,
        "tokens_per_s": round(batch * new_tokens / elapsed, 1),
        "step_ms": round(elapsed / max(steps, 1) * 1e3, 2),
        "steps": steps,
        "seconds": round(elapsed, 3),
    }


def weight_bytes(weights: RankWeights) -> int:
    """Bytes a decode step reads: every layer's tensors, the embedding row aside."""
    tensors = [weights.lm_head_t, weights.final_norm]
    for layer in weights.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def read_gbps(device: torch.device) -> float:
    """The device's read bandwidth, GB/s, from the median of five copies."""
    size = (256 if device.type == "cpu" else 1024) << 20
    source = torch.ones(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(6):
        sync(device)
        started = time.perf_counter()
        target.copy_(source)
        sync(device)
        times.append(time.perf_counter() - started)
    return 2 * size / sorted(times[1:])[2] / 1e9


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--modes",
        default="deterministic",
        help="comma list of deterministic (fixed-order kernels, the servers' default) and "
        "vendor (the fast path of serving.deterministic: false), run side by side",
    )
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"deterministic", "vendor"}:
        parser.error(f"--modes takes deterministic and/or vendor, got {args.modes!r}")
    device = torch.device(args.device if args.device == "cpu" else f"{args.device}:0")
    if device.type == "cpu":
        retain_host_memory()  # as the servers do
    dtype = DTYPES.get(device.type, torch.bfloat16)
    config = preset_config(args.preset)
    weights = build_rank_weights(config, preset_source(0, device), 1, 0, dtype, device)
    kv = KVPool(
        config.shape.num_layers, 16384, weights.kv_heads, config.shape.head_dim, 16, dtype, device
    )
    scheduler = Scheduler(
        kv, ReqToToken(64, 4096), RadixCache(kv.pages, 16, enabled=False), Budget(64, 2048)
    )
    graphs = DecodeGraphs.for_runner(
        ModelRunner(weights, kv, device),
        capacity=4096,
        scratch_row=kv.scratch_row,
        max_batch=64,
        enabled=args.cuda_graphs,
    )
    engine = Engine(scheduler, graphs.forward, ByteTokenizer(config.shape.vocab_size))
    nbytes, bandwidth = weight_bytes(weights), read_gbps(device)
    bound_ms = nbytes / (bandwidth * 1e9) * 1e3
    engine.start()
    rows: list[Row] = []
    for mode in modes:
        ops.set_deterministic(mode == "deterministic")
        if device.type == "cpu":  # the servers' setting: one thread when deterministic
            torch.set_num_threads(1 if mode == "deterministic" else THREADS)
        for batch in args.batches.split(","):
            run_batch(engine, int(batch), 32, 4)  # warm-up: Triton's compile, graph captures
            replays = graphs.replays
            timing = run_batch(engine, int(batch), 32, args.new_tokens)
            row: Row = {
                "mode": mode,
                "kernels": ops.kernel_mode(device.type),
                **timing,
                "graph_steps": graphs.replays - replays,
                "vs_bound": round(timing["step_ms"] / bound_ms, 1),
            }
            rows.append(row)
    engine.stop()
    report = {
        "preset": args.preset,
        "device": str(device),
        "dtype": str(dtype),
        "cuda_graphs": graphs.describe(),
        "weight_bytes": nbytes,
        "read_gbps": round(bandwidth, 3),
        "bound_ms": round(bound_ms, 3),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for row in rows:
            line = f"{row['mode']:>13} batch {row['batch']:>3}: {row['tokens_per_s']:>8} tokens/s"
            graphed = f"{row['graph_steps']}/{row['steps']} steps as graphs"
            bound = f"{row['vs_bound']}x the {bound_ms:.3f} ms weight-read bound"
            print(f"{line}, {row['step_ms']} ms/step = {bound} ({row['kernels']}, {graphed})")


if __name__ == "__main__":
    main()
