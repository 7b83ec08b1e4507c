"""The prefill role: compute prompts, send their KV to decode, host the bootstrap endpoint.

Requests must carry `bootstrap_room` (a PD router adds it). After the prompt is
computed (a prefix-cache hit computes only the suffix; the whole KV is still
sent), rank 0 publishes the first token for decode, tells every rank to send, and
answers once every rank has reported; the room's pages stay locked until then, even
when the request is aborted meanwhile (they are fenced: the senders still read them).
A room goes to the senders (or an early write) only if it is still open
(`Rooms.hand`); once every rank's sender of it ended, or its request ended first,
it is marked stopped on the bootstrap endpoint, which is what decode's fence waits
for before it hands the room's memory out again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from pdctl.records import FenceState, KVSent, KVTransfer
from pdctl.serve import tp as tensor_parallel
from pdctl.serve.api.app import create_app
from pdctl.serve.api.errors import BadRequest
from pdctl.serve.api.submission import PDFields, ServerContext
from pdctl.serve.bootstrap import BootstrapError, FirstToken, Rooms, bootstrap_app
from pdctl.serve.engine.loop import Engine
from pdctl.serve.engine.request import Event, Request
from pdctl.serve.engine.sampling import TokenChoice
from pdctl.serve.multimodal import PromptError, check_items, splices
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.client import run_secret, warn_if_no_secret
from pdctl.serve.pd.embeddings import EmbeddingError, EmbeddingReceiver
from pdctl.serve.pd.endpoint import make_transport
from pdctl.serve.pd.fence import process_identity
from pdctl.serve.pd.reports import (
    RankReport,
    RankReports,
    Report,
    ReportCollector,
    ReportSender,
    combine,
)
from pdctl.serve.pd.room_state import RoomMirror, RoomPublisher, RoomSnapshot, RoomWait
from pdctl.serve.pd.sender import KVSender, Snapshot
from pdctl.serve.roles.common import build_engine, serve, server_info
from pdctl.serve.runtime import Rank
from pdctl.serve.tp_ops import Op
from pdctl.staging import device as dev
from pdctl.staging.embedding_pool import EmbeddingPool

log = logging.getLogger("pdctl.serve")


def make_sender(rank: Rank, snapshot: Snapshot, report: Report) -> KVSender:
    args = rank.args
    return KVSender(
        rank=args.tp_rank,
        tp=args.tp,
        num_kv_heads=rank.config.shape.num_kv_heads,
        kv=rank.kv,
        transport=make_transport(args),
        snapshot=snapshot,
        report=report,
        segment_bytes=int(args.staging_segment_mb * (1 << 20)),
        bootstrap_timeout=args.bootstrap_timeout,
        transfer_timeout=args.transfer_timeout,
        workers=max(4, args.max_running_requests),
        bells=args.settings.bells,
        notify_at=args.settings.notify_at,
    )


def layout_of(rank: Rank) -> dict[str, int]:
    """What every decode rank's registration must agree with."""
    return {
        "page_size": rank.args.page_size,
        "num_layers": rank.config.shape.num_layers,
        "head_dim": rank.config.shape.head_dim,
        "elem_bytes": rank.kv.kv.element_size(),
    }


class PrefillHooks:
    def __init__(self, rank: Rank, rooms: Rooms) -> None:
        self.rank, self.rooms = rank, rooms
        self.engine: Engine | None = None
        self.pending: RankReports[str] = RankReports(rank.args.tp)  # room -> the request's rid
        self.lock = threading.Lock()
        self.sender = make_sender(rank, self._snapshot, self.report)
        self.embeddings: EmbeddingReceiver | None = None  # set by run(): every prefill takes them
        self.sent_totals = KVSent()  # what /get_server_info reports as kv_sent
        self.backend = rank.args.transfer_backend
        self.sending: set[int] = set()  # rooms handed to the senders, until their request ends
        self.fenced: set[int] = set()  # rooms whose aborted request's pages wait for the senders

    def _snapshot(self, room: int, wait: float, condition: RoomWait) -> RoomSnapshot:
        return self.rooms.wait_for(room, condition, wait)

    def prepare(self, request: Request, pd: PDFields | None) -> None:
        if pd is None:
            raise BadRequest(
                "a prefill server serves PD requests only: bootstrap_room is missing",
                "bootstrap_room",
            )
        if pd.embedding_room is not None or pd.mm_items is not None:
            self._take_embeddings(request, pd)
        room = pd.bootstrap_room
        try:
            self.rooms.start(room)
        except BootstrapError as exc:
            raise BadRequest(str(exc), "bootstrap_room", status=exc.status) from None
        request.room = room
        sink = request.sink

        def watched(event: Event) -> None:  # however the request ends, the room hears it
            if event.finish_reason is not None or event.error is not None:
                self._ended(room)
            sink(event)

        request.sink = watched

    def _ended(self, room: int) -> None:
        """The prefill request of `room` ended. Unless its senders have it (they mark the
        room stopped once they all reported), nothing will ever write the room: a write
        launched early is waited for, the room closed (decode stops waiting at once)."""
        with self.lock:
            if room in self.sending:
                self.sending.discard(room)
                return
        self.sender.forget(room)
        self.rooms.fail(room, "prefill: the request ended before its KV was sent")
        self.rooms.stopped(room)

    def _take_embeddings(self, request: Request, pd: PDFields) -> None:
        """An EPD request: splice the embeddings the encoder wrote into this prompt."""
        if self.embeddings is None:
            raise BadRequest("this prefill server receives no embeddings", "embedding_room")
        if pd.embedding_room is None or pd.mm_items is None:
            raise BadRequest("an EPD request needs both mm_items and embedding_room", "mm_items")
        try:
            rows = self.embeddings.take(pd.embedding_room)
            items = check_items(pd.mm_items, request.prompt_len, rows.shape[0])
        except EmbeddingError as exc:
            raise BadRequest(f"prefill: {exc}", "embedding_room", status=exc.status) from None
        except PromptError as exc:
            raise BadRequest(f"prefill: {exc}", exc.field) from None
        request.embeds = splices(items, rows)

    def arm(self, request: Request) -> Callable[[], None] | None:
        assert request.room is not None and self.engine is not None
        if self.rooms.hand(request.room) is not None:  # closed: nothing may write it
            return None
        return self.sender.arm(request.room, self.engine.scheduler.prompt_pages(request))

    def forwarded(self, request: Request) -> None:
        assert request.room is not None and self.engine is not None
        self.sender.prepare(request.room, self.engine.scheduler.prompt_pages(request))

    def prefilled(self, request: Request, choice: TokenChoice) -> None:
        assert request.room is not None and self.engine is not None
        room = request.room
        closed = self.rooms.hand(room)
        if closed is not None:  # decode gave it up: no rank sends it (nothing may write it)
            error = f"prefill: room {room} closed before sending: {closed}"
            self.engine.transferred(request.rid, error, KVTransfer(transport=self.backend))
            return
        self.rooms.set_result(
            room,
            FirstToken(
                token=choice.token,
                logprob=choice.logprob,
                top=choice.top,
                logit=choice.logit,
                cached_tokens=request.cached_tokens,
            ),
        )
        pages = self.engine.scheduler.prompt_pages(request)
        with self.lock:
            self.sending.add(room)
        self.pending.expect(room, request.rid)
        message = {"room": room, "pages": pages, "num_tokens": request.prompt_len}
        if self.rank.group is not None:
            self.rank.group.send(Op.SEND, proto.json_tensor(message))
        ready = dev.create_device_event(self.rank.device)
        ready.record(dev.current_device_stream(self.rank.device))
        self.sender.send(room, pages, request.prompt_len, ready)

    def admitted(self, request: Request) -> None:  # decode only
        raise AssertionError("prefill servers do not receive KV")

    def aborted(self, request: Request) -> None:
        if request.room is not None:
            self.sender.forget(request.room)
            self.rooms.close(request.room, "failed: the prefill request was aborted")

    def fence(self, request: Request) -> None:
        """The request was aborted while its room is sent: its pages go back once every
        rank's sender of it ended (they still read them)."""
        assert request.room is not None and self.engine is not None
        with self.lock:
            if self.pending.waiting(request.room):
                self.fenced.add(request.room)
                return
        self.engine.unfence(request.room)

    def report(self, room: int, report: RankReport) -> None:
        """This rank's sender finished `room` (its report read as another rank's is)."""
        self.reported(room, report.checked())

    def reported(self, room: int, report: RankReport) -> None:
        """A rank finished sending `room`: this one, or another over the TP group."""
        done = self.pending.add(room, report)
        if done is None:
            return
        errors = done.errors
        info = combine(list(done.reports.values()), self.backend, "prefill")
        with self.lock:
            self.sent_totals.add(info, ok=not errors)
            fenced = room in self.fenced
            self.fenced.discard(room)
        self.rooms.close(room, "finished" if not errors else f"failed: {errors[0]}")
        self.rooms.stopped(room)  # no rank of this server writes the room any more
        assert self.engine is not None
        if fenced:
            self.engine.unfence(room)
        self.engine.transferred(done.entry, f"prefill: {errors[0]}" if errors else None, info)

    def sent(self) -> KVSent:
        """A copy of what was sent so far."""
        with self.lock:
            return dataclasses.replace(self.sent_totals)


def run(rank: Rank) -> None:
    args = rank.args
    if args.bootstrap_port is None:
        raise SystemExit("--bootstrap-port is required for the prefill role")
    warn_if_no_secret("prefill", args.host)
    rooms = Rooms(layout_of(rank), args.bootstrap_timeout)
    hooks = PrefillHooks(rank, rooms)
    publisher = RoomPublisher(rank.group, rooms) if rank.group is not None else None
    if publisher is not None:  # the other ranks learn registrations over the TP group
        rooms.on_change = publisher.changed
    if rank.group is not None:  # and report what they sent over it
        ReportCollector(rank.group, hooks.reported)
    hooks.embeddings = EmbeddingReceiver(
        EmbeddingPool(
            device_type=rank.device.type,
            gpu_id=rank.device.index,
            size_bytes=int(args.embedding_pool_mb * (1 << 20)),
        ),
        hooks.sender.transport,
        rank.config.shape.hidden_size,
        expiry_s=args.bootstrap_timeout + args.transfer_timeout,
    )
    engine = build_engine(rank, hooks=hooks)
    hooks.engine = engine
    engine.start()
    context = ServerContext(
        engine=engine,
        model_name=rank.model_name,
        vocab_size=rank.config.shape.vocab_size,
        max_context=rank.max_context,
        info=server_info(rank),
        extra_info=lambda: {
            "fence": fence_state(engine).to_json(),
            "bootstrap_port": args.bootstrap_port,
            "open_rooms": rooms.open_rooms(),
            "kv_sent": hooks.sent().to_json(),
            "embeddings": hooks.embeddings.state() if hooks.embeddings else None,
        },
        prepare=hooks.prepare,
    )
    info = {
        "tp": args.tp,
        "num_kv_heads": rank.config.shape.num_kv_heads,
        "model": rank.model_name,
        **layout_of(rank),
        **process_identity(),  # decode's fence knows this process's end when it sees it
    }
    apps = [
        (create_app(context), args.host, args.port),
        (
            bootstrap_app(rooms, run_secret(), info, hooks.embeddings),
            args.host,
            args.bootstrap_port,
        ),
    ]
    serve(rank, context, apps, before_stop=publisher.close if publisher is not None else None)


def fence_state(engine: Engine) -> FenceState:
    """The pages of aborted requests held while their senders still read them."""
    return FenceState(rooms=len(engine.scheduler.fenced), pages=engine.scheduler.num_fenced_pages)


def run_worker(rank: Rank) -> None:
    """Ranks > 0: send when rank 0 says so; rooms' registrations arrive over the TP
    group (`RoomMirror`) and reports go back to rank 0 over it (`ReportSender`)."""
    assert rank.group is not None
    mirror = RoomMirror(rank.group)
    report = ReportSender(rank.group)
    sender = make_sender(rank, mirror.snapshot, report)

    def on_send(payload: Any) -> None:
        message = proto.tensor_json(payload)
        ready = dev.create_device_event(rank.device)
        ready.record(dev.current_device_stream(rank.device))
        sender.send(int(message["room"]), list(message["pages"]), int(message["num_tokens"]), ready)

    rank.group.handlers[Op.SEND] = on_send
    try:
        tensor_parallel.worker_loop(rank.group, rank.runner.forward)
    finally:
        report.close()
        rank.group.close()
