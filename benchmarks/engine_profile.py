"""Where the embedded engine's forward time goes (a GPU probe for issue 20's targets).

    python benchmarks/engine_profile.py [--device cuda] [--preset small] [--mode deterministic]

The model alone (no scheduler, no HTTP), random weights of the preset: a prefill of
`--prompt` tokens in one piece, and decode steps of batch 1 and 32 at a context of
`--context` tokens. Each is timed with a device synchronize (median of repeats), and
the host's share is shown by the same forward with the device queued behind a
sleeping kernel (the host's enqueue time alone). A torch profile of each lists the
kernels by device time. The weight-read bound is the weights' bytes at `--hbm-tbps`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.model import ops
from pdctl.serve.model.batch import Piece
from pdctl.serve.model.runner import ModelRunner
from pdctl.serve.model.weights import build_rank_weights, preset_config, preset_source


def timed_ms(device: torch.device, function: Callable[[], object], repeats: int) -> float:
    function()
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def host_ms(device: torch.device, function: Callable[[], object]) -> float:
    """The host's enqueue time: the device is kept busy so nothing waits for it."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    torch.cuda._sleep(2_000_000_000)  # about a second of device cycles
    started = time.perf_counter()
    function()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize(device)
    return elapsed * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--mode", default="deterministic", choices=["deterministic", "vendor"])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--hbm-tbps", type=float, default=4.8)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    ops.set_deterministic(args.mode == "deterministic")
    device = torch.device(args.device if args.device == "cpu" else f"{args.device}:0")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = preset_config(args.preset)
    weights = build_rank_weights(config, preset_source(0), 1, 0, dtype, device)
    page = 16
    pool_tokens = max(4096, 40 * (args.context + 16), args.prompt + 64)
    pool_tokens -= pool_tokens % page
    kv = KVPool(
        config.shape.num_layers, pool_tokens, weights.kv_heads, config.shape.head_dim, page,
        dtype, device,
    )  # fmt: skip
    runner = ModelRunner(weights, kv, device)
    tensors = [weights.embed, weights.lm_head_t]
    for layer in weights.layers:
        tensors += [w for w in vars(layer).values() if isinstance(w, torch.Tensor)]
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    bound_ms = weight_bytes / (args.hbm_tbps * 1e12) * 1e3
    vocab = config.shape.vocab_size

    def prefill() -> object:
        tokens = torch.randint(0, vocab, (args.prompt,))
        return runner.forward([Piece(tokens, 0, torch.arange(args.prompt))])

    def decode(batch: int) -> Callable[[], object]:
        pieces = []
        for b in range(batch):
            base = 64 + b * (args.context + 16)
            rows = torch.arange(base, base + args.context + 1)
            pieces.append(Piece(torch.tensor([b % vocab]), args.context, rows))
        return lambda: runner.forward(pieces)

    cases = {
        f"prefill {args.prompt} tokens": prefill,
        "decode batch 1": decode(1),
        "decode batch 32": decode(32),
    }
    print(
        f"{args.preset} on {device} ({args.mode}, {ops.kernel_mode(device.type)}): weights "
        f"{weight_bytes / 1e9:.2f} GB, read once at {args.hbm_tbps} TB/s = {bound_ms:.2f} ms"
    )
    for name, function in cases.items():
        total = timed_ms(device, function, 5 if "prefill" in name else 20)
        host = host_ms(device, function)
        print(f"  {name:<24} {total:8.2f} ms a forward, host enqueue {host:8.2f} ms", flush=True)
    if args.profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        for name, function in cases.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                function()
                torch.cuda.synchronize(device)
            print(f"--- {name}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
