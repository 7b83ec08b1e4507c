"""Decode steps as CUDA graphs: one captured forward per batch-size bucket.

A decode step (every piece one new token) costs the host far more than the device at
small batches: Python and one launch per kernel (on an H200, the small preset's step
at batch 1 took 15.9 ms of wall time for 3.1 ms on the device). `DecodeGraphs.forward`
runs such a batch by replaying a CUDA graph of `ModelRunner.run` over its bucket's
fixed layout (`decode_batch.DecodeLayout`): fill the pinned staging, one non-blocking
copy, `replay()`, then the real pieces' logits. The graph holds the kernels an eager
forward of the bucket launches, with the same shapes, and every row is computed on its
own (`ops.py`), so a replay gives bitwise the eager logits of the same pieces.

    buckets        1, 2, 4, ... below the running limit, then the limit itself
    capture        at a bucket's first batch (per kernel mode): two eager warm-ups on a
                   side stream (Triton compiles there), then a `CUDAGraph` capture on that
                   stream; one memory pool for every bucket
    eager instead  not CUDA; TP > 1 (the row-parallel gather is a collective across
                   processes); no Triton attention; a piece of more than one token,
                   multimodal embeddings, a context past the capacity, a batch above
                   the largest bucket; a failed capture (logged, graphs off from then)

`capture_eagerly` has the capture's signature without a graph: the fixed layout run
eagerly at each replay (the CPU tests; what a graph replay is checked against). Knows
nothing of pages, requests or the scheduler: the caller gives the scratch row and the
capacity, and calls `forward` from one thread at a time.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdctl.records import JSONValue
from pdctl.serve.model import ops
from pdctl.serve.model.batch import Piece
from pdctl.serve.model.decode_batch import DecodeLayout, decode_refusal
from pdctl.serve.model.runner import ModelRunner
from pdctl.staging import device as dev

log = logging.getLogger("pdctl.serve")
WARMUPS = 2
Replay = Callable[[], torch.Tensor | None]  # runs the captured step, returns its logits
Capture = Callable[[ModelRunner, DecodeLayout], Replay]


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """Batch sizes a graph is captured for: powers of two below `max_batch`, then it."""
    if max_batch < 1:
        raise ValueError(f"the largest decode batch must be >= 1, got {max_batch}")
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch)


def bucket_for(buckets: Sequence[int], count: int) -> int | None:
    """The smallest bucket that holds `count` pieces (None: above the largest)."""
    return next((size for size in buckets if size >= count), None)


def unavailable_reason(runner: ModelRunner, enabled: bool) -> str | None:
    """Why this runner's decode steps cannot replay graphs at all (None: they can)."""
    if not enabled:
        return "switched off (--no-cuda-graphs)"
    if runner.device.type != "cuda":
        return f"not CUDA ({runner.device.type})"
    if runner.gather is not None:
        return "TP > 1: the row-parallel gather is a collective across processes"
    if not ops.triton_available("cuda"):
        return "no Triton: the torch attention would read every piece's whole key table"
    return None


@dataclass
class _Step:
    layout: DecodeLayout
    replay: Replay


class DecodeGraphs:
    """The decode-step graphs of one runner, and the choice graph or eager per batch."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        capacity: int,
        scratch_row: int,
        max_batch: int,
        off: str | None = None,
        capture: Capture | None = None,
    ) -> None:
        self.runner = runner
        self.capacity, self.scratch_row = capacity, scratch_row
        self.buckets = buckets_for(max_batch)
        self.off = off  # why no batch replays a graph (None: decode batches do)
        self._capture = capture if capture is not None else CudaGraphCapture(runner.device)
        self._steps: dict[tuple[int, str], _Step] = {}
        self.replays = 0
        self.eager: Counter[str] = Counter()  # eager forwards by reason
        if off is not None:
            log.info("CUDA graphs off, every step runs eagerly: %s", off)

    @classmethod
    def for_runner(
        cls, runner: ModelRunner, *, capacity: int, scratch_row: int, max_batch: int, enabled: bool
    ) -> DecodeGraphs:
        """Graphs where this runner can have them, else off with the reason."""
        off = unavailable_reason(runner, enabled)
        return cls(runner, capacity=capacity, scratch_row=scratch_row, max_batch=max_batch, off=off)

    @property
    def captured(self) -> list[int]:
        return sorted({size for size, _ in self._steps})

    def describe(self) -> dict[str, JSONValue]:
        """What the server reports: whether decode steps replay graphs, and if not why."""
        return {
            "enabled": self.off is None,
            "reason": self.off,
            "buckets": list(self.buckets),
            "capacity": self.capacity,
        }

    def eager_reason(self, pieces: Sequence[Piece]) -> str | None:
        """Why this batch runs eagerly (None: it replays its bucket's graph)."""
        if self.off is not None:
            return self.off
        if len(pieces) > self.buckets[-1]:
            return "a batch above the largest bucket"
        return decode_refusal(pieces, self.capacity)

    def forward(self, pieces: Sequence[Piece]) -> torch.Tensor | None:
        """`ModelRunner.forward`'s logits, by a graph replay where the batch allows it."""
        reason = self.eager_reason(pieces)
        step = self._step(len(pieces)) if reason is None else None
        if step is None:
            reason = reason or self.off or "no graph"
            if not self.eager[reason]:
                log.info("a batch runs eagerly (logged once per reason): %s", reason)
            self.eager[reason] += 1
            return self.runner.forward(pieces)
        with torch.inference_mode():
            step.layout.fill(pieces)
            logits = step.replay()
            self.replays += 1
            return None if logits is None else logits[: len(pieces)].clone()

    def _step(self, count: int) -> _Step | None:
        size = bucket_for(self.buckets, count)
        assert size is not None  # eager_reason refused larger batches
        key = (size, ops.kernel_mode(self.runner.device.type))  # a graph holds its kernels
        step = self._steps.get(key)
        if step is None and self.off is None:
            layout = DecodeLayout(size, self.capacity, self.scratch_row, self.runner.device)
            try:
                step = self._steps[key] = _Step(layout, self._capture(self.runner, layout))
            except Exception as exc:  # eager always works: serve on without graphs
                self.off = f"capture failed at bucket {size}: {type(exc).__name__}: {exc}"
                log.warning("CUDA graphs off from now on: %s", self.off)
        return step


class CudaGraphCapture:
    """Captures a layout's forward as a CUDA graph: warm-ups first, one pool for all.

    Only the capturing thread is held to capture's rules (`thread_local`): the
    server's other threads (KV transfers) go on using the device meanwhile.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None  # the side stream of every warm-up and capture
        self._pool: Any = None  # the memory pool every bucket's graph shares

    def __call__(self, runner: ModelRunner, layout: DecodeLayout) -> Replay:
        device = self.device
        with dev.device_context(device):
            if self._stream is None:
                self._stream = dev.create_device_stream(device)
                self._pool = torch.cuda.graph_pool_handle()  # cuda-only: graphs are CUDA's
            stream = self._stream
            stream.wait_stream(dev.current_device_stream(device))  # the layout's first upload
            with dev.device_stream_context(stream):
                for _ in range(WARMUPS):  # compiles the Triton kernels outside the capture
                    runner.run(layout.batch)
            dev.current_device_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()  # cuda-only: graphs are CUDA's
            capturing = torch.cuda.graph(  # cuda-only: graphs are CUDA's
                graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"
            )
            with capturing:
                logits = runner.run(layout.batch)  # [size, vocab] float32, rewritten by replays

        def replay() -> torch.Tensor | None:
            with dev.device_context(device):
                graph.replay()
            return logits

        return replay


def capture_eagerly(runner: ModelRunner, layout: DecodeLayout) -> Replay:
    """The capture's signature without a graph: each replay runs the layout eagerly."""
    return lambda: runner.run(layout.batch)
