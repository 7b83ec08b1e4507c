"""The decode role: reserve pages, receive the prompt's KV from prefill, then generate.

Each PD request is admitted with every page it can need (its req_to_token row
written), then every rank records the room's ordering event and receives its KV
(`KVReceiver`). When all ranks report, rank 0 fetches the first token prefill
chose, and the request joins the decode batch. The response carries
`meta_info.kv_transfer` {bytes, segments, staging, transport, digest_ok, transfer_ms}.

A request that ends before its KV arrived (aborted, or its receive failed) keeps its
pages (the engine fences them) until every rank reported the room and prefill
confirmed its senders of it stopped (`pd/fence.py`): only then can no write land.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from pdctl.records import FenceState, RingState
from pdctl.serve import tp as tensor_parallel
from pdctl.serve.api.app import create_app
from pdctl.serve.api.errors import BadRequest
from pdctl.serve.api.submission import PDFields, ServerContext
from pdctl.serve.engine.loop import Engine
from pdctl.serve.engine.request import Request
from pdctl.serve.engine.sampling import TokenChoice
from pdctl.serve.faults import faults
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.abort_fault import AbortTransfers
from pdctl.serve.pd.client import PeerCallError, warn_if_no_secret
from pdctl.serve.pd.endpoint import endpoint_name, make_transport
from pdctl.serve.pd.receiver import KVReceiver
from pdctl.serve.pd.reports import (
    Pending,
    RankReport,
    RankReports,
    Report,
    ReportCollector,
    ReportSender,
    combine,
)
from pdctl.serve.roles.common import build_engine, serve, server_info
from pdctl.serve.runtime import Rank
from pdctl.serve.tp_ops import Op
from pdctl.staging import device as dev

log = logging.getLogger("pdctl.serve")


def make_receiver(rank: Rank, report: Report) -> KVReceiver:
    args = rank.args
    try:
        return _receiver(rank, report)
    except ValueError as exc:
        raise SystemExit(f"decode rank {args.tp_rank}: {exc}") from None


def _receiver(rank: Rank, report: Report) -> KVReceiver:
    args = rank.args
    return KVReceiver(
        rank=args.tp_rank,
        tp=args.tp,
        name=endpoint_name(args),
        kv=rank.kv,
        transport=make_transport(args),
        report=report,
        staging=args.staging,
        pool_bytes=int(args.staging_pool_mb * (1 << 20)),
        segment_bytes=int(args.staging_segment_mb * (1 << 20)),
        bootstrap_timeout=args.bootstrap_timeout,
        transfer_timeout=args.transfer_timeout,
        bells=args.settings.bells,
    )


class DecodeHooks:
    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self.engine: Engine | None = None
        self.pending: RankReports[tuple[str, str]] = RankReports(rank.args.tp)  # (rid, bootstrap)
        self.finisher = ThreadPoolExecutor(2, thread_name_prefix="pdctl-decode-result")
        self.lock = threading.Lock()
        self.fenced: dict[int, str] = {}  # room -> bootstrap: pages fenced, reports to come
        self.receiver = make_receiver(rank, self.report)
        wanted = AbortTransfers.wanted(faults())  # fault injection, off unless asked for
        self.aborts = AbortTransfers(faults(), self.receiver) if wanted else None

    def prepare(self, request: Request, pd: PDFields | None) -> None:
        if pd is None or pd.bootstrap_host is None or pd.bootstrap_port is None:
            raise BadRequest(
                "a decode server serves PD requests only: bootstrap_host, bootstrap_port and "
                "bootstrap_room are required",
                "bootstrap_room",
            )
        request.room = pd.bootstrap_room
        request.bootstrap = f"{pd.bootstrap_host}:{pd.bootstrap_port}"

    def admitted(self, request: Request) -> None:
        assert (
            request.room is not None and request.bootstrap is not None and self.engine is not None
        )
        pages = self.engine.scheduler.prompt_pages(request)
        self.pending.expect(request.room, (request.rid, request.bootstrap))
        message = {
            "room": request.room,
            "pages": pages,
            "num_tokens": request.prompt_len,
            "bootstrap": request.bootstrap,
        }
        if self.rank.group is not None:
            self.rank.group.send(Op.RECEIVE, proto.json_tensor(message))
        ready = dev.create_device_event(self.rank.device)  # right after the req_to_token row
        ready.record(dev.current_device_stream(self.rank.device))
        self.receiver.receive(request.room, pages, request.prompt_len, request.bootstrap, ready)
        if self.aborts is not None:
            self.aborts.admitted(self.engine, request.rid, request.room, request.bootstrap)

    def arm(self, request: Request) -> None:  # prefill's: decode writes no KV out
        return None

    def forwarded(self, request: Request) -> None:  # prefill's: decode writes no KV out
        return

    def prefilled(self, request: Request, choice: TokenChoice) -> None:  # prefill only
        raise AssertionError("decode servers do not prefill PD requests")

    def aborted(self, request: Request) -> None:
        if request.room is None:
            return
        self.receiver.abort(request.room)
        if self.rank.group is not None:
            reason = self.receiver.aborted.get(request.room, "aborted")
            message = {"room": request.room, "reason": reason}
            self.rank.group.send(Op.ABORT, proto.json_tensor(message))

    def fence(self, request: Request) -> None:
        """The request ended before its KV arrived; its pages are held. Once every rank
        reported the room (no scatter of it runs), they wait for prefill's senders."""
        assert request.room is not None and request.bootstrap is not None
        with self.lock:
            if self.pending.waiting(request.room):
                self.fenced[request.room] = request.bootstrap
                return
        self._fence_pages(request.room, request.bootstrap)

    def _fence_pages(self, room: int, bootstrap: str) -> None:
        assert self.engine is not None
        reason = self.receiver.aborted.get(room, "the request ended before its KV arrived")
        self.receiver.fence.add(
            room, bootstrap, f"decode: {reason}", partial(self.engine.unfence, room)
        )

    def report(self, room: int, report: RankReport) -> None:
        """This rank's receiver finished `room` (its report read as another rank's is)."""
        self.reported(room, report.checked())

    def reported(self, room: int, report: RankReport) -> None:
        """A rank finished receiving `room`: this one, or another over the TP group."""
        done = self.pending.add(room, report)
        if done is not None:
            with self.lock:
                fenced = self.fenced.pop(room, None)
            if fenced is not None:
                self._fence_pages(room, fenced)
            self.finisher.submit(self._finish, room, done)

    def _finish(self, room: int, done: Pending[tuple[str, str]]) -> None:
        assert self.engine is not None
        (rid, bootstrap), errors = done.entry, done.errors
        info = combine(list(done.reports.values()), self.rank.args.transfer_backend, "decode")
        if errors:
            self.engine.transferred(rid, f"decode: {errors[0]}", info)
            return
        try:
            client = self.receiver.client(bootstrap)
            state = client.call(
                "GET", f"/bootstrap/result/{room}", params={"wait": self.rank.args.transfer_timeout}
            )
            result = state.get("result")
            if result is None:
                raise PeerCallError(f"prefill {bootstrap} has no first token for room {room}")
        except PeerCallError as exc:
            self.engine.transferred(rid, f"decode: {exc}", info)
            return
        logit = result.get("logit")
        first = TokenChoice(
            int(result["token"]),
            float(result["logprob"]),
            [tuple(x) for x in result["top"]],
            None if logit is None else float(logit),
        )
        info.cached_tokens = int(result.get("cached_tokens", 0))
        self.engine.transferred(rid, None, info, first)


def run(rank: Rank) -> None:
    args = rank.args
    warn_if_no_secret("decode", args.host)
    hooks = DecodeHooks(rank)
    if rank.group is not None:  # the other ranks report over the TP group
        ReportCollector(rank.group, hooks.reported)
    engine = build_engine(rank, prefix_cache=False, hooks=hooks)
    engine.scheduler.receives_kv = True
    hooks.engine = engine
    engine.start()
    context = ServerContext(
        engine=engine,
        model_name=rank.model_name,
        vocab_size=rank.config.shape.vocab_size,
        max_context=rank.max_context,
        info=server_info(rank),
        extra_info=lambda: {
            "staging_ring": ring_state(hooks.receiver).to_json(),
            "fence": fence_state(hooks).to_json(),
        },
        prepare=hooks.prepare,
    )
    serve(rank, context, [(create_app(context), args.host, args.port)])


def ring_state(receiver: KVReceiver) -> RingState:
    allocator = receiver.ring.allocator
    watermark = allocator.watermark
    return RingState(
        capacity=allocator.capacity,
        live_regions=allocator.num_live,
        empty=allocator.is_empty,
        watermark=[watermark.round, watermark.tail],
    )


def fence_state(hooks: DecodeHooks) -> FenceState:
    """Rank 0's fenced memory: the pages its engine holds, the regions of its ring."""
    assert hooks.engine is not None
    receiver, scheduler = hooks.receiver, hooks.engine.scheduler
    with receiver.handlers_lock:
        handlers = list(receiver.handlers.values())
    rooms = set(scheduler.fenced) | receiver.fence.rooms()
    for handler in handlers:
        rooms |= set(handler.fenced)
    counts = receiver.fence.counts
    return FenceState(
        rooms=len(rooms),
        pages=scheduler.num_fenced_pages,
        regions=sum(handler.num_fenced for handler in handlers),
        released=counts["released"],
        writer_gone=counts["writer_gone"],
        unconfirmed=counts["unconfirmed"],
    )


def run_worker(rank: Rank) -> None:
    """Ranks > 0: receive when rank 0 says so; report to rank 0 over the TP group."""
    assert rank.group is not None
    report = ReportSender(rank.group)
    receiver = make_receiver(rank, report)

    def on_receive(payload: Any) -> None:
        message = proto.tensor_json(payload)
        ready = dev.create_device_event(rank.device)
        ready.record(dev.current_device_stream(rank.device))
        receiver.receive(
            int(message["room"]),
            list(message["pages"]),
            int(message["num_tokens"]),
            str(message["bootstrap"]),
            ready,
        )

    def on_abort(payload: Any) -> None:
        message = proto.tensor_json(payload)
        receiver.abort(int(message["room"]), str(message.get("reason") or "aborted"))

    rank.group.handlers[Op.RECEIVE] = on_receive
    rank.group.handlers[Op.ABORT] = on_abort
    try:
        tensor_parallel.worker_loop(rank.group, rank.runner.forward)
    finally:
        report.close()
        rank.group.close()
