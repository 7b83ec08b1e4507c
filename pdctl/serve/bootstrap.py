"""The prefill-side bootstrap endpoint: where decode ranks register rooms.

`Rooms` is the plain registry (thread-safe, with long-poll waits); `bootstrap_app`
serves it over HTTP on the bootstrap port. Decode may register before or after the
prefill request arrives; a room that nobody completes expires after the bootstrap
timeout, and a registration for an expired or finished room is refused (410), as
is a second registration of the same rank (409) or one whose KV layout does not
match this prefill server (400, e.g. a stale server with another page size).
Every request must carry the per-run secret (`Authorization: Bearer ...`).

Fencing: decode holds the memory of a room it gave up until prefill confirms that
nothing of it can still be written. Prefill hands a room to its writers (its senders,
an early write) only through `hand`, which refuses a closed room, and marks it
`stopped` once every writer it handed it to ended; a room is `quiet` once it closed
and was never handed (nothing will ever write it: a sender checks the room before
each write) or stopped. Quiet never waits for a prompt still queued on prefill, so a
fenced ring never waits on prefill's queue, which may itself wait on that ring.
`/bootstrap/fence` closes decode's rooms and answers which are quiet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from pdctl.serve.api.guards import guard_json_depth, refuse_oversized
from pdctl.serve.api.openapi import Document, JsonObject, Route, describe
from pdctl.serve.pd.client import refuse_unless_authorized
from pdctl.serve.pd.embeddings import EmbeddingError, EmbeddingReceiver
from pdctl.serve.pd.protocol import (
    BootstrapError,
    Registration,
    SegmentRegion,
    json_int,
    segment_from_json,
)
from pdctl.serve.pd.room_state import RoomSnapshot, RoomWait

TOMBSTONE_S = 300.0
# Rooms are purged at most this often: a purge walks every room, tombstones included
# (3,000 at 10 requests a second), and every waiter looks its room up at each change.
# Walking them at each lookup made a prefill server's rate decay in a soak (15 -> 7
# requests a second over 10,000), its GIL spent in the walk.
PURGE_EVERY_S = 1.0


class FirstToken(TypedDict):
    """The first token prefill chose for a room, which decode fetches
    (`/bootstrap/result`): the answer begins with it."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # the top logprobs: (token, logprob)
    logit: float | None
    cached_tokens: int  # prompt tokens prefill found in its prefix cache


@dataclass
class Room:
    room: int
    created: float = field(default_factory=time.monotonic)
    started: bool = False  # the prefill request arrived
    registrations: dict[int, Registration] = field(default_factory=dict)
    result: FirstToken | None = None
    closed: str | None = None  # "finished" or "failed: ..."
    handed: bool = False  # given to prefill's writers (senders, an early write)
    stopped: bool = False  # every writer it was handed to ended

    @property
    def quiet(self) -> bool:
        """No prefill rank can write this room's memory on decode any more."""
        return self.closed is not None and (not self.handed or self.stopped)


class Rooms:
    def __init__(self, layout: Mapping[str, int], expiry_s: float) -> None:
        self.layout = layout  # what registrations must match: page_size, num_layers, ...
        self.expiry_s = expiry_s
        self._rooms: dict[int, Room] = {}
        self._purged_at = 0.0
        self._changed = threading.Condition()
        # registrations, offers or the room's end changed (prefill ranks > 0 learn of it)
        self.on_change: Callable[[int], None] | None = None

    def _changed_room(self, room: int) -> None:
        if self.on_change is not None:
            self.on_change(room)

    def _room(self, room: int) -> Room:
        self._purge()
        found = self._rooms.get(room)
        if found is None:
            found = self._rooms[room] = Room(room)
        return found

    def _purge(self) -> None:
        now = time.monotonic()
        if now - self._purged_at < PURGE_EVERY_S:
            return
        self._purged_at = now
        for key, item in list(self._rooms.items()):
            limit = TOMBSTONE_S if item.closed else self.expiry_s
            if now - item.created > limit and (item.closed or not item.started):
                if item.closed:
                    del self._rooms[key]
                else:
                    item.closed = "expired: no prefill request for this room"

    def start(self, room: int) -> None:
        """The prefill request for `room` arrived; a second one is refused."""
        with self._changed:
            item = self._room(room)
            if item.started:
                raise BootstrapError(f"room {room} is already in use", 409)
            if item.closed:
                raise BootstrapError(f"room {room} is closed ({item.closed})", 410)
            item.started = True
            self._changed.notify_all()

    def register(self, registration: Registration) -> None:
        mismatch = [
            f"{key} {getattr(registration, key)} differs from prefill's {value}"
            for key, value in self.layout.items()
            if getattr(registration, key) != value
        ]
        if mismatch:
            raise BootstrapError("incompatible decode rank: " + "; ".join(mismatch), 400)
        with self._changed:
            item = self._room(registration.room)
            if item.closed:
                raise BootstrapError(f"room {registration.room} is closed ({item.closed})", 410)
            if registration.decode_rank in item.registrations:
                raise BootstrapError(
                    f"decode rank {registration.decode_rank} already registered "
                    f"room {registration.room}",
                    409,
                )
            item.registrations[registration.decode_rank] = registration
            self._changed.notify_all()
        self._changed_room(registration.room)

    def add_segments(self, room: int, rank: int, segments: list[SegmentRegion]) -> None:
        with self._changed:
            item = self._rooms.get(room)
            if item is None or item.closed or rank not in item.registrations:
                raise BootstrapError(
                    f"room {room} has no open registration for decode rank {rank}", 410
                )
            item.registrations[rank].segments.extend(segments)
            self._changed.notify_all()
        self._changed_room(room)

    def set_result(self, room: int, result: FirstToken) -> None:
        with self._changed:
            self._room(room).result = result
            self._changed.notify_all()

    def fail(self, room: int, reason: str) -> None:
        """Decode's side failed: close the room unless it already finished."""
        with self._changed:
            item = self._room(room)
            if item.closed is None:
                item.closed = f"failed: {reason}"
                item.created = time.monotonic()
                # nothing reads a closed room's page lists (a sender checks the room
                # first): its tombstone, and the other ranks' copy of it, keep none
                item.registrations = {}
                self._changed.notify_all()
        self._changed_room(room)

    def hand(self, room: int) -> str | None:
        """Prefill is about to hand `room` to its writers: marked so, unless the room
        closed (then how: nothing may write it now)."""
        with self._changed:
            item = self._room(room)
            if item.closed is None:
                item.handed = True
            return item.closed

    def stopped(self, room: int) -> None:
        """Every writer `room` was handed to ended (or its request ended first)."""
        with self._changed:
            self._room(room).stopped = True
            self._changed.notify_all()

    def fence(self, reasons: dict[int, str], timeout: float) -> list[int]:
        """Decode gave these rooms up (room -> why): close each still open, then return
        those quiet once any is (after `timeout`: those quiet then, maybe none)."""
        for room, reason in reasons.items():
            self.fail(room, reason)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                quiet = [room for room in reasons if self._room(room).quiet]
                remaining = deadline - time.monotonic()
                if quiet or remaining <= 0:
                    return quiet
                self._changed.wait(min(remaining, 0.5))

    def close(self, room: int, how: str) -> None:
        with self._changed:
            item = self._room(room)
            item.closed = how
            item.created = time.monotonic()
            # a tombstone (kept TOMBSTONE_S to refuse replays) needs no page lists
            item.registrations = {}
            self._changed.notify_all()
        self._changed_room(room)

    def wait_for(self, room: int, condition: RoomWait, timeout: float) -> RoomSnapshot:
        """The room's snapshot once `condition` holds, it closed, or `timeout` passed."""

        def ready(item: Room) -> bool:
            offered = {r: [s.index for s in reg.segments] for r, reg in item.registrations.items()}
            return condition.holds(offered)

        self.wait(room, ready, timeout)
        return self.snapshot(room)

    def wait(self, room: int, ready: Callable[[Room], bool], timeout: float) -> Room | None:
        """The room once `ready(room)` holds (or it closed), None on timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                item = self._room(room)
                if ready(item) or item.closed:
                    return item
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(min(remaining, 0.5))

    def snapshot(self, room: int) -> RoomSnapshot:
        """The room as it is now. Its registrations are copies: the registry's own go on
        growing segments (`add_segments`) while a sender reads the snapshot."""
        with self._changed:
            item = self._room(room)
            registrations = {
                rank: dataclasses.replace(r, segments=list(r.segments))
                for rank, r in item.registrations.items()
            }
            return RoomSnapshot(room, item.started, item.closed, item.result, registrations)

    def open_rooms(self) -> int:
        with self._changed:
            self._purge()
            return sum(1 for item in self._rooms.values() if not item.closed)


async def json_object(request: HttpRequest) -> dict[str, Any]:
    body = await request.json()
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


MAX_MESSAGE_BYTES = 4 << 20


def bootstrap_app(
    rooms: Rooms,
    secret: bytes,
    info: Mapping[str, object],
    embeddings: EmbeddingReceiver | None = None,
) -> FastAPI:
    app = FastAPI(title="pdctl bootstrap", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def authenticate(request: HttpRequest, call_next: Callable[[HttpRequest], Any]) -> Any:
        refused = refuse_unless_authorized(request, secret, "bootstrap")
        if refused is not None:
            return refused
        oversized = refuse_oversized(request, MAX_MESSAGE_BYTES)
        if oversized is not None:
            return JSONResponse({"error": oversized[1]}, status_code=oversized[0])
        return await call_next(request)

    guard_json_depth(app)

    @app.exception_handler(BootstrapError)
    async def refused(_: HttpRequest, exc: BootstrapError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.get("/bootstrap/info")
    async def get_info() -> dict[str, object]:
        return dict(info)

    add_registration_routes(app, rooms)
    add_room_routes(app, rooms)
    if embeddings is not None:
        add_embedding_routes(app, embeddings)
    describe(app, Document("pdctl bootstrap", ROUTES, authenticated=True))
    return app


def _internal(*statuses: int, body: bool = True) -> Route:
    """A bootstrap route: its errors `{"error": text}`, its body a JSON object it checks."""
    return Route(statuses, internal=True, body=JsonObject if body else None)


ROUTES = {
    ("GET", "/bootstrap/info"): _internal(body=False),
    ("POST", "/bootstrap/register"): _internal(409, 410),
    ("POST", "/bootstrap/segments"): _internal(410),
    ("GET", "/bootstrap/room/{room}"): _internal(body=False),
    ("GET", "/bootstrap/result/{room}"): _internal(body=False),
    ("POST", "/bootstrap/fail"): _internal(),
    ("POST", "/bootstrap/fence"): _internal(),
    ("POST", "/bootstrap/embedding/alloc"): _internal(409, 503),
    ("POST", "/bootstrap/embedding/sent"): _internal(409, 410),
}


def add_registration_routes(app: FastAPI, rooms: Rooms) -> None:
    """Decode's side: a rank registers a room, then offers more ring regions."""

    @app.post("/bootstrap/register")
    async def register(request: HttpRequest) -> dict[str, bool]:
        try:
            registration = Registration.from_json(await request.json())
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise BootstrapError(f"malformed registration: {exc}", 400) from None
        rooms.register(registration)
        return {"ok": True}

    @app.post("/bootstrap/segments")
    async def segments(request: HttpRequest) -> dict[str, bool]:
        try:
            body = await json_object(request)
            if not isinstance(body.get("segments"), list) or len(body["segments"]) > 4096:
                raise ValueError("segments must be a list of at most 4096 regions")
            regions = [segment_from_json(s) for s in body["segments"]]
            room, rank = json_int(body, "room"), json_int(body, "decode_rank")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise BootstrapError(f"malformed segments: {exc}", 400) from None
        rooms.add_segments(room, rank, regions)
        return {"ok": True}


def add_room_routes(app: FastAPI, rooms: Rooms) -> None:
    """A room's state and result (long-polled), decode's failure and fence."""

    @app.get("/bootstrap/room/{room}")
    async def room_state(
        room: int,
        wait: float = 0.0,
        ranks: int = 0,
        decode_rank: int | None = None,
        segment: int | None = None,
    ) -> dict[str, object]:
        condition = RoomWait.from_query(ranks, decode_rank, segment)
        state = await asyncio.to_thread(rooms.wait_for, room, condition, min(wait, 30.0))
        return state.to_json()

    @app.get("/bootstrap/result/{room}")
    async def result(room: int, wait: float = 0.0) -> dict[str, object]:
        await asyncio.to_thread(
            rooms.wait, room, lambda item: item.result is not None, min(wait, 30.0)
        )
        return rooms.snapshot(room).to_json()

    @app.post("/bootstrap/fail")
    async def fail(request: HttpRequest) -> dict[str, bool]:
        """Decode gave up on a room (failure or abort): prefill stops sending it."""
        try:
            body = await json_object(request)
            room, reason = json_int(body, "room"), body.get("reason")
            if not isinstance(reason, str):
                raise ValueError("reason must be text")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise BootstrapError(f"malformed failure report: {exc}", 400) from None
        rooms.fail(room, reason[:2000])
        return {"ok": True}

    @app.post("/bootstrap/fence")
    async def fence(request: HttpRequest) -> dict[str, list[int]]:
        """Decode holds these rooms' memory: close them, answer which are quiet (every
        prefill writer of theirs stopped), waiting up to `wait` s for one to be."""
        try:
            body = await json_object(request)
            items = body.get("rooms")
            if not isinstance(items, list) or not 0 < len(items) <= 4096:
                raise ValueError("rooms must be a list of 1 to 4096 rooms")
            reasons = {json_int(item, "room"): str(item.get("reason", ""))[:2000] for item in items}
            wait = float(body.get("wait", 0.0))
            if not math.isfinite(wait):
                raise ValueError("wait must be a number of seconds")
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as exc:
            raise BootstrapError(f"malformed fence: {exc}", 400) from None
        quiet = await asyncio.to_thread(rooms.fence, reasons, min(max(wait, 0.0), 30.0))
        return {"quiet": quiet}


def add_embedding_routes(app: FastAPI, embeddings: EmbeddingReceiver) -> None:
    """The encoder's side of an EPD request: a slot for its embeddings, then `sent`
    (refusals are BootstrapErrors, answered by the app's handler)."""

    @app.post("/bootstrap/embedding/alloc")
    async def alloc(request: HttpRequest) -> dict[str, str | int]:
        try:
            body = await json_object(request)
            room, rows = json_int(body, "room"), json_int(body, "num_tokens")
            hidden, dtype = json_int(body, "hidden_size"), body.get("dtype")
            if not isinstance(dtype, str):
                raise ValueError("dtype must be text")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise EmbeddingError(f"malformed embedding request: {exc}") from None
        return await asyncio.to_thread(embeddings.alloc, room, rows, hidden, dtype)

    @app.post("/bootstrap/embedding/sent")
    async def embedding_sent(request: HttpRequest) -> dict[str, bool]:
        try:
            body = await json_object(request)
            room, digest = json_int(body, "room"), json_int(body, "digest")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise EmbeddingError(f"malformed embedding report: {exc}") from None
        await asyncio.to_thread(embeddings.sent, room, digest)
        return {"ok": True}
