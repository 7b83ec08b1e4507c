"""What every role shares: the engine it builds, its info, and serving HTTP until told to stop."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from pdctl.records import JSONValue
from pdctl.serve import tp as tensor_parallel
from pdctl.serve.api.submission import ServerContext
from pdctl.serve.engine.kv_pool import ReqToToken
from pdctl.serve.engine.loop import Engine, PDHooks
from pdctl.serve.engine.radix import RadixCache
from pdctl.serve.engine.scheduler import Budget, Scheduler
from pdctl.serve.http import STOPPING, run_servers
from pdctl.serve.model import ops
from pdctl.serve.runtime import Rank, rank_forward, stop_ranks

log = logging.getLogger("pdctl.serve")
# How long a rank's end waits for the stop signal before it counts as a death: the ranks
# of one group get the signal together and a child may be reaped before rank 0 handles it.
STOP_RACE_S = 1.0


def build_engine(rank: Rank, *, prefix_cache: bool = True, hooks: PDHooks | None = None) -> Engine:
    args = rank.args
    scheduler = Scheduler(
        rank.kv,
        ReqToToken(max(args.max_running_requests * 2, 8), rank.max_context),
        RadixCache(rank.kv.pages, args.page_size, enabled=prefix_cache),
        Budget(args.max_running_requests, args.chunked_prefill_tokens),
    )
    return Engine(scheduler, rank_forward(rank), rank.tokenizer, overlap=args.overlap, hooks=hooks)


def server_info(rank: Rank) -> dict[str, JSONValue]:
    args = rank.args
    return {
        "role": args.role,
        "topology": args.topology_name,
        "replica": args.replica,
        "tp": args.tp,
        "device": str(rank.device),
        "dtype": args.dtype,
        "model": rank.model_name,
        "page_size": args.page_size,
        "max_running_requests": args.max_running_requests,
        "chunked_prefill_tokens": args.chunked_prefill_tokens,
        "overlap": args.overlap,
        "deterministic": args.deterministic,
        "kernels": ops.kernel_mode(rank.device.type),
        "cuda_graphs": graphs_info(rank),
        "pid": os.getpid(),
    }


def graphs_info(rank: Rank) -> dict[str, JSONValue]:
    """Whether decode steps replay CUDA graphs (`model/graphs.py`), and if not why."""
    if rank.model is None:
        return {"enabled": False, "reason": "no language model on this rank"}
    return rank.model.graphs.describe()


def serve(
    rank: Rank,
    context: ServerContext,
    apps: list[tuple[FastAPI, str, int]],
    before_stop: Callable[[], None] | None = None,
) -> None:
    """Run the role's HTTP servers, then stop the engine, `before_stop`, the other ranks."""
    if rank.children:

        def died(message: str) -> None:
            if STOPPING.wait(STOP_RACE_S):
                log.info("%s as this server stops", message)
                return
            message = f"{message}; this server cannot compute any more and exits"
            log.error("%s", message)
            # its requests are answered with the cause before the server stops, not
            # cancelled by the shutdown (a bare 500 naming nothing)
            context.engine.fail(message)
            os.kill(os.getpid(), signal.SIGTERM)

        server = f"{rank.args.role}-{rank.args.replica}"
        tensor_parallel.watch_ranks(rank.children, server, died)
    try:
        run_servers(apps)
    finally:
        context.engine.stop()
        if before_stop is not None:
            before_stop()
        stop_ranks(rank)


def in_process_encoder(rank: Rank) -> Callable[[Any, list[Any]], tuple[list[int], list[Any]]]:
    """For ServerContext.encode: the encoder model run inside this server (colocated)."""
    from pdctl.serve.model.encoder import EncoderModel
    from pdctl.serve.multimodal import encode_prompt, splices
    from pdctl.serve.runtime import DTYPES

    shape = rank.config.shape
    model = EncoderModel(
        shape.hidden_size, dtype=DTYPES[rank.args.dtype], device=rank.device, seed=rank.args.seed
    )
    lock = threading.Lock()

    def encode(body: Any, images: list[Any]) -> tuple[list[int], list[Any]]:
        with lock:
            ids, items, rows = encode_prompt(model, rank.tokenizer, shape.vocab_size, body, images)
        return ids, splices(items, rows)

    return encode
