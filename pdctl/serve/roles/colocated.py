"""The colocated role: one server runs prefill and decode; the reference for PD results."""

from __future__ import annotations

import logging
import os
import signal

import uvicorn
from fastapi import FastAPI

from pdctl.serve import tp as tensor_parallel
from pdctl.serve.engine import Engine
from pdctl.serve.http import ServerContext, create_app
from pdctl.serve.kv_pool import ReqToToken
from pdctl.serve.radix import RadixCache
from pdctl.serve.runtime import Rank, rank_forward, stop_ranks
from pdctl.serve.scheduler import Budget, Scheduler
from pdctl.serve.tokenizer import Tokenizer

log = logging.getLogger("pdctl.serve")


def build_engine(rank: Rank, tokenizer: Tokenizer) -> Engine:
    args = rank.args
    max_requests = max(args.max_running_requests * 2, 8)
    scheduler = Scheduler(
        rank.kv,
        ReqToToken(max_requests, rank.max_context),
        RadixCache(rank.kv.pages, args.page_size),
        Budget(args.max_running_requests, args.chunked_prefill_tokens),
    )
    return Engine(scheduler, rank_forward(rank), tokenizer, overlap=args.overlap)


def server_info(rank: Rank) -> dict[str, object]:
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
        "pid": os.getpid(),
    }


def serve(rank: Rank, context: ServerContext, app: FastAPI) -> None:
    """Run uvicorn until SIGTERM/SIGINT, then stop the engine and the other ranks."""
    args = rank.args
    if rank.children:

        def died(message: str) -> None:
            log.error("%s; this server cannot compute any more and exits", message)
            os.kill(os.getpid(), signal.SIGTERM)
            context.engine.failed = message

        tensor_parallel.watch_ranks(rank.children, died)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        context.engine.stop()
        stop_ranks(rank)


def run(rank: Rank) -> None:
    engine = build_engine(rank, rank.tokenizer)
    engine.start()
    context = ServerContext(
        engine=engine,
        model_name=rank.model_name,
        vocab_size=rank.config.shape.vocab_size,
        max_context=rank.max_context,
        info=server_info(rank),
    )
    serve(rank, context, create_app(context))
