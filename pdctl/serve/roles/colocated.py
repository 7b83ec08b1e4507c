"""The colocated role: one server runs prefill and decode; the reference for PD results."""

from __future__ import annotations

from pdctl.serve.api.app import create_app
from pdctl.serve.api.submission import ServerContext
from pdctl.serve.roles.common import build_engine, in_process_encoder, serve, server_info
from pdctl.serve.runtime import Rank


def run(rank: Rank) -> None:
    engine = build_engine(rank)
    engine.start()
    context = ServerContext(
        engine=engine,
        model_name=rank.model_name,
        vocab_size=rank.config.shape.vocab_size,
        max_context=rank.max_context,
        info=server_info(rank),
        encode=in_process_encoder(rank),
    )
    serve(rank, context, [(create_app(context), rank.args.host, rank.args.port)])
