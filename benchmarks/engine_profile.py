"""Where the embedded engine's forward time goes (a GPU probe for issue 20's targets).

    python benchmarks/engine_profile.py [--device cuda] [--preset small] [--mode deterministic]
                                        [--graphs] [--profile]

The model alone (no scheduler, no HTTP), random weights of the preset: a prefill of
`--prompt` tokens in one piece, and decode steps of batch 1 and 32 at a context of
`--context` tokens. Each is timed with a device synchronize (median of repeats), and
the host's share is shown by the same forward with the device queued behind a
sleeping kernel (the host's enqueue time alone). A torch profile of each lists the
kernels by device time. The weight-read bound is the weights' bytes at `--hbm-tbps`.

`--graphs` adds the decode steps replayed as CUDA graphs (`model/graphs.py`, as a
server runs them: "decode batch N (graph)"), and says whether each replay's logits
are bitwise the eager forward's (fresh KV pools, the same pieces).
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
from pdctl.serve.model.graphs import DecodeGraphs
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


def decode_pieces(batch: int, context: int, vocab: int) -> list[Piece]:
    """`batch` one-token pieces at position `context`, in disjoint pool rows from 64 on."""
    pieces = []
    for b in range(batch):
        base = 64 + b * (context + 16)
        rows = torch.arange(base, base + context + 1)
        pieces.append(Piece(torch.tensor([b % vocab]), context, rows))
    return pieces


def graphs_match(graphs: DecodeGraphs, eager: ModelRunner, pieces: list[Piece]) -> bool:
    """Whether a replay's logits are bitwise the eager forward's, from equal KV pools."""
    mine, theirs = graphs.runner.kv, eager.kv
    for graph_layer, eager_layer in zip(mine.k_buffers, theirs.k_buffers, strict=True):
        graph_layer.copy_(eager_layer)
    for graph_layer, eager_layer in zip(mine.v_buffers, theirs.v_buffers, strict=True):
        graph_layer.copy_(eager_layer)
    want, got = eager.forward(pieces), graphs.forward(pieces)
    return want is not None and got is not None and torch.equal(want, got)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--mode", default="deterministic", choices=["deterministic", "vendor"])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--hbm-tbps", type=float, default=4.8)
    parser.add_argument("--graphs", action="store_true", help="also time CUDA-graph decode")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    ops.set_deterministic(args.mode == "deterministic")
    device = torch.device(args.device if args.device == "cpu" else f"{args.device}:0")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = preset_config(args.preset)
    weights = build_rank_weights(config, preset_source(0, device), 1, 0, dtype, device)
    pool_tokens = max(4096, 40 * (args.context + 16), args.prompt + 64)
    pool_tokens -= pool_tokens % 16

    def make_pool() -> KVPool:
        shape = config.shape
        return KVPool(shape.num_layers, pool_tokens, weights.kv_heads, shape.head_dim, 16,
                      dtype, device)  # fmt: skip

    eager = ModelRunner(weights, make_pool(), device)
    tensors = [weights.embed, weights.lm_head_t]
    for layer in weights.layers:
        tensors += [w for w in vars(layer).values() if isinstance(w, torch.Tensor)]
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    bound_ms = weight_bytes / (args.hbm_tbps * 1e12) * 1e3
    vocab = config.shape.vocab_size

    def prefill() -> object:
        tokens = torch.randint(0, vocab, (args.prompt,))
        return eager.forward([Piece(tokens, 0, torch.arange(args.prompt))])

    cases: dict[str, Callable[[], object]] = {f"prefill {args.prompt} tokens": prefill}
    for batch in (1, 32):
        pieces = decode_pieces(batch, args.context, vocab)
        cases[f"decode batch {batch}"] = lambda pieces=pieces: eager.forward(pieces)
    graphs = None
    if args.graphs:
        pool = make_pool()
        capacity = min(config.shape.max_position, pool_tokens)  # as a server's (runtime.py)
        graphs = DecodeGraphs.for_runner(
            ModelRunner(weights, pool, device), capacity=capacity, scratch_row=pool.scratch_row,
            max_batch=32, enabled=True,
        )  # fmt: skip
        graph_forward = graphs.forward
        for batch in (1, 32):
            pieces = decode_pieces(batch, args.context, vocab)
            cases[f"decode batch {batch} (graph)"] = lambda p=pieces: graph_forward(p)
    print(
        f"{args.preset} on {device} ({args.mode}, {ops.kernel_mode(device.type)}): weights "
        f"{weight_bytes / 1e9:.2f} GB, read once at {args.hbm_tbps} TB/s = {bound_ms:.2f} ms"
    )
    report(device, cases, args.profile)
    if graphs is not None:
        report_graphs(graphs, eager, args.context)


def report_graphs(graphs: DecodeGraphs, eager: ModelRunner, context: int) -> None:
    state = graphs.describe()
    print(f"CUDA graphs: {'on' if state['enabled'] else 'off: ' + str(state['reason'])}, "
          f"replays {graphs.replays}, eager {dict(graphs.eager)}")  # fmt: skip
    vocab = graphs.runner.w.config.shape.vocab_size
    for batch in (1, 3, 32):
        pieces = decode_pieces(batch, context, vocab)
        print(f"  batch {batch}: graph logits bitwise the eager ones: "
              f"{graphs_match(graphs, eager, pieces)}")  # fmt: skip


def report(device: torch.device, cases: dict[str, Callable[[], object]], profiled: bool) -> None:
    for name, function in cases.items():
        total = timed_ms(device, function, 5 if "prefill" in name else 20)
        host = host_ms(device, function)
        print(f"  {name:<28} {total:8.2f} ms a forward, host enqueue {host:8.2f} ms", flush=True)
    if profiled and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        for name, function in cases.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                function()
                torch.cuda.synchronize(device)
            print(f"--- {name}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
