"""Decode steps as CUDA graphs: buckets, the choice graph or eager, the engine on them.

On the CPU each "replay" runs the fixed layout eagerly (`capture_eagerly`): bitwise
the eager logits and tokens. On CUDA (`gpu`) a real replay must give the eager logits
bitwise for batches 1, 3 and 8 across replays with other contexts, with no host
synchronisation in it, and an engine on graphs the eager engine's tokens.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdctl.serve.engine.kv_pool import KVPool, ReqToToken
from pdctl.serve.engine.loop import Engine
from pdctl.serve.engine.radix import RadixCache
from pdctl.serve.engine.request import Request
from pdctl.serve.engine.sampling import SamplingParams
from pdctl.serve.engine.scheduler import Budget, Scheduler
from pdctl.serve.model import attention, ops
from pdctl.serve.model.batch import Piece
from pdctl.serve.model.graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    bucket_for,
    buckets_for,
    capture_eagerly,
    unavailable_reason,
)
from pdctl.serve.model.runner import ModelRunner
from pdctl.serve.model.weights import RankWeights, build_rank_weights, preset_config, preset_source
from pdctl.serve.tokenizer import ByteTokenizer
from tests.serve.decode_twins import CAPACITY, CONFIG, CPU, LENGTHS, Twins, make_twins


def test_buckets_are_powers_of_two_up_to_the_running_limit() -> None:
    assert buckets_for(32) == (1, 2, 4, 8, 16, 32)
    assert buckets_for(48) == (1, 2, 4, 8, 16, 32, 48)
    assert buckets_for(1) == (1,)
    buckets = buckets_for(48)
    assert [bucket_for(buckets, n) for n in (1, 2, 3, 5, 16, 17, 33, 48, 49)] == [
        1, 2, 4, 8, 16, 32, 48, 48, None,
    ]  # fmt: skip
    with pytest.raises(ValueError, match=">= 1"):
        buckets_for(0)


def eager_graphs(twins: Twins, max_batch: int = 8) -> DecodeGraphs:
    """DecodeGraphs over the fixed-layout runner, each 'replay' an eager run (CPU)."""
    return DecodeGraphs(
        twins.fixed, capacity=CAPACITY, scratch_row=twins.pools[1].scratch_row,
        max_batch=max_batch, capture=capture_eagerly,
    )  # fmt: skip


def test_decode_batches_take_their_bucket_and_give_the_eager_logits() -> None:
    twins = make_twins()
    graphs = eager_graphs(twins, max_batch=6)
    assert graphs.buckets == (1, 2, 4, 6)
    for sequences in ([0], [1, 2, 3], [4, 5, 6, 7, 8], [0, 1]):
        pieces = twins.pieces(sequences)
        assert torch.equal(graphs.forward(pieces), twins.eager.forward(pieces))
    assert graphs.captured == [1, 2, 4, 6] and graphs.replays == 4 and not graphs.eager
    twins.assert_same_kv()


def test_batches_a_graph_cannot_hold_run_eagerly_with_the_reason() -> None:
    twins = make_twins()
    graphs = eager_graphs(twins, max_batch=4)
    prompt = Piece(torch.tensor([5, 6, 7]), 0, twins.rows[8][:3])
    mixed = [*twins.pieces([0]), prompt]
    too_many = twins.pieces([0, 1, 2, 3, 4])
    for pieces in (mixed, too_many, mixed):
        twins.eager.forward(pieces)  # keep the pools equal
        graphs.forward(pieces)
    assert graphs.eager == {
        "a piece of more than one new token (prefill)": 2,
        "a batch above the largest bucket": 1,
    }
    assert graphs.replays == 0 and graphs.captured == []
    twins.assert_same_kv()


def test_a_failed_capture_turns_graphs_off_and_serves_eagerly() -> None:
    twins = make_twins()

    def broken(runner: Any, layout: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = DecodeGraphs(
        twins.fixed, capacity=CAPACITY, scratch_row=0, max_batch=4, capture=broken
    )
    pieces = twins.pieces([0, 1])
    assert torch.equal(graphs.forward(pieces), twins.eager.forward(pieces))
    assert graphs.off is not None and "capture failed at bucket 2" in graphs.off
    assert graphs.describe()["enabled"] is False and graphs.replays == 0
    graphs.forward(pieces)
    assert graphs.eager[graphs.off] == 2


def test_graphs_are_off_where_they_cannot_work(monkeypatch) -> None:
    twins = make_twins()
    graphs = DecodeGraphs.for_runner(
        twins.fixed, capacity=CAPACITY, scratch_row=0, max_batch=4, enabled=True
    )
    assert graphs.describe() == {
        "enabled": False, "reason": "not CUDA (cpu)", "buckets": [1, 2, 4], "capacity": CAPACITY,
    }  # fmt: skip
    pieces = twins.pieces([0])
    assert torch.equal(graphs.forward(pieces), twins.eager.forward(pieces))
    cuda: Any = SimpleNamespace(device=torch.device("cuda", 0), gather=None)
    assert "switched off" in str(unavailable_reason(cuda, enabled=False))
    monkeypatch.setattr(ops, "triton_available", lambda device_type: True)
    assert unavailable_reason(cuda, enabled=True) is None
    tp: Any = SimpleNamespace(device=torch.device("cuda", 0), gather=lambda x: x)
    assert "TP > 1" in str(unavailable_reason(tp, enabled=True))
    monkeypatch.setattr(ops, "triton_available", lambda device_type: False)
    assert "no Triton" in str(unavailable_reason(cuda, enabled=True))


# -- the engine: decode steps through DecodeGraphs, the tokens of the eager engine --
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(9 + 13 * i)] for i in range(5)]


def generate(
    weights: RankWeights,
    device: torch.device,
    wrap: Callable[[ModelRunner, KVPool], Callable[[Sequence[Piece]], torch.Tensor | None]],
) -> list[list[int]]:
    """PROMPTS at once through an overlapped engine whose forward is `wrap(runner, pool)`."""
    shape = weights.config.shape
    kv = KVPool(shape.num_layers, 4096, weights.kv_heads, shape.head_dim, 16, weights.embed.dtype,
                device)  # fmt: skip
    scheduler = Scheduler(kv, ReqToToken(16, 1024), RadixCache(kv.pages, 16), Budget(8, 64))
    forward = wrap(ModelRunner(weights, kv, device), kv)
    engine = Engine(scheduler, forward, ByteTokenizer(shape.vocab_size), overlap=True)
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    done = [threading.Event() for _ in PROMPTS]

    def sink(index: int) -> Callable[[Any], None]:
        def deliver(event: Any) -> None:
            if event.token is not None:
                outputs[index].append(event.token)
            if event.finish_reason is not None or event.error is not None:
                done[index].set()

        return deliver

    engine.start()
    try:
        for index, prompt in enumerate(PROMPTS):
            params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
            engine.submit(Request(f"r{index}", prompt, params, sink(index)))
        assert all(event.wait(300) for event in done)
    finally:
        engine.stop()
    return outputs


def graphed_engine_matches_eager(weights: RankWeights, device: torch.device, capture: Any) -> None:
    made: list[DecodeGraphs] = []

    def with_graphs(runner: ModelRunner, kv: KVPool) -> Any:
        graphs = DecodeGraphs(runner, capacity=1024, scratch_row=kv.scratch_row, max_batch=8,
                              capture=capture)  # fmt: skip
        made.append(graphs)
        return graphs.forward

    eager = generate(weights, device, lambda runner, kv: runner.forward)
    assert generate(weights, device, with_graphs) == eager
    (graphs,) = made
    assert graphs.replays > 0 and graphs.eager["a piece of more than one new token (prefill)"] > 0


def test_an_engine_on_graphs_gives_the_eager_engines_tokens() -> None:
    weights = build_rank_weights(CONFIG, preset_source(0), 1, 0, torch.float32, CPU)
    graphed_engine_matches_eager(weights, CPU, capture_eagerly)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_decode_graphs_keep_a_sliding_window(kernel, monkeypatch) -> None:
    """Mistral's window in the fixed decode layout: the eager logits bitwise, with the
    torch attention and with the Triton kernel (interpreted on the CPU); keys past the
    window are hidden (the logits differ from the unwindowed model's)."""
    if kernel == "triton":
        if torch.cuda.is_available():
            pytest.skip("the kernel runs interpreted on CPU hosts (CUDA: the gpu test below)")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        from pdctl.serve.model import triton_attention

        monkeypatch.setattr(attention, "paged_attention", triton_attention.paged_attention)
    windowed = dataclasses.replace(CONFIG, sliding_window=32)
    twins, full = make_twins(config=windowed), make_twins()
    graphs = eager_graphs(twins, max_batch=4)
    for sequences in ([3], [0, 3, 8], [1, 7]):  # contexts of 40, 130, 200 keys, ...
        pieces = twins.pieces(sequences)
        got = graphs.forward(pieces)
        assert torch.equal(got, twins.eager.forward(pieces))
        if max(LENGTHS[s] for s in sequences) > 32:
            assert not torch.allclose(got, full.eager.forward(pieces), atol=1e-3)
    assert graphs.replays == 3 and not graphs.eager
    twins.assert_same_kv()


# -- CUDA: graph replay against the eager forward -----------------------------------
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def cuda_twins(
    window: int | None = None,
) -> tuple[ModelRunner, ModelRunner, tuple[KVPool, KVPool], list[torch.Tensor]]:
    """The small preset in bf16 on CUDA: two runners over equal pools, prompts in both."""
    device = torch.device("cuda", 0)
    config = dataclasses.replace(preset_config("small"), sliding_window=window)
    weights = build_rank_weights(config, preset_source(0), 1, 0, torch.bfloat16, device)
    shape = config.shape

    def pool() -> KVPool:
        return KVPool(shape.num_layers, 8192, weights.kv_heads, shape.head_dim, 16,
                      torch.bfloat16, device)  # fmt: skip

    pools = (pool(), pool())
    eager, graphed = (ModelRunner(weights, pool, device) for pool in pools)
    rows = [torch.arange(600 * s, 600 * s + 590) for s in range(8)]
    for s in range(8):
        prompt = torch.tensor([(31 * s + 7 * i) % 30000 + 3 for i in range(100 + 50 * s)])
        eager.forward([Piece(prompt, 0, rows[s][: prompt.numel()])])
    pools[1].kv.copy_(pools[0].kv)
    return eager, graphed, pools, rows


def cuda_pieces(rows: list[torch.Tensor], count: int, step: int) -> list[Piece]:
    return [
        Piece(torch.tensor([(17 * s + step) % 30000 + 3]), 100 + 50 * s + step,
              rows[s][: 100 + 50 * s + step + 1])
        for s in range(count)
    ]  # fmt: skip


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("window", [None, 100], ids=["full", "sliding-window"])
def test_graph_replay_gives_the_eager_logits_bitwise_without_host_syncs(window) -> None:
    eager, graphed, pools, rows = cuda_twins(window)
    graphs = DecodeGraphs.for_runner(
        graphed, capacity=4096, scratch_row=pools[1].scratch_row, max_batch=8, enabled=True
    )
    assert graphs.off is None, graphs.off
    for count in (1, 3, 8):
        graphs.forward(cuda_pieces(rows, count, 0))  # captures (outside the sync check)
        eager.forward(cuda_pieces(rows, count, 0))
        for step in (1, 2):  # two replays with other contexts
            pieces = cuda_pieces(rows, count, step)
            want = eager.forward(pieces)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = graphs.forward(pieces)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert got is not None and want is not None
            assert torch.equal(got, want), (count, step)
    assert graphs.captured == [1, 4, 8] and graphs.replays == 9 and not graphs.eager
    scratch = pools[0].scratch_row
    a, b = pools[0].kv.clone(), pools[1].kv.clone()
    a[:, :, scratch], b[:, :, scratch] = 0, 0
    assert torch.equal(a, b)


@pytest.mark.gpu
@cuda_only
def test_an_eager_forward_does_not_wait_for_the_device() -> None:
    eager, _, _, rows = cuda_twins()
    eager.forward(cuda_pieces(rows, 3, 1))  # warm: Triton compiled, pinned cache filled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = eager.forward(cuda_pieces(rows, 3, 2))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert logits is not None and logits.shape[0] == 3


@pytest.mark.gpu
@cuda_only
def test_an_engine_on_cuda_graphs_gives_the_eager_engines_tokens() -> None:
    device = torch.device("cuda", 0)
    weights = build_rank_weights(
        preset_config("small"), preset_source(0), 1, 0, torch.bfloat16, device
    )
    graphed_engine_matches_eager(weights, device, CudaGraphCapture(device))
