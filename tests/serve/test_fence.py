"""The fence of issue 36, part by part: prefill's rooms say when they are quiet, the
engine keeps a request's pages out of the pool until unfenced, decode's fence asks,
releases once confirmed or once the writer is gone, and an unconfirmed release is
counted and reported. `tests/cli/test_bench_soak.py` proves the whole under load."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from pdctl.records import FenceState, KVPool, ServerInfo
from pdctl.serve.bootstrap import Rooms
from pdctl.serve.engine.kv_pool import KVPool as PagePool
from pdctl.serve.engine.kv_pool import ReqToToken
from pdctl.serve.engine.loop import Engine
from pdctl.serve.engine.radix import RadixCache
from pdctl.serve.engine.request import Event, Phase, Request
from pdctl.serve.engine.sampling import SamplingParams
from pdctl.serve.engine.scheduler import Budget, Scheduler
from pdctl.serve.model.batch import Piece
from pdctl.serve.pd.client import PeerCallError
from pdctl.serve.pd.fence import Fence, WriterLiveness, my_identity
from pdctl.serve.tokenizer import ByteTokenizer
from tests.polling import wait_until

LAYOUT = {"page_size": 16, "num_layers": 2, "head_dim": 8, "elem_bytes": 4}


# -- prefill: when is a room quiet --------------------------------------------------
def test_a_room_is_quiet_once_closed_and_its_senders_stopped() -> None:
    rooms = Rooms(LAYOUT, 30.0)
    rooms.start(1)  # the prefill request arrived
    assert rooms.hand(1) is None  # and its prompt went to the senders: they may write
    assert rooms.fence({1: "decode: aborted"}, 0.05) == []  # closed, senders still running
    assert rooms.snapshot(1).closed == "failed: decode: aborted"
    waker = threading.Timer(0.1, rooms.stopped, (1,))
    waker.start()
    started = time.monotonic()
    assert rooms.fence({1: "decode: again"}, 5.0) == [1]  # woken by the stop
    assert time.monotonic() - started < 2.0
    assert rooms.snapshot(1).closed == "failed: decode: aborted"  # the first reason stays


def test_a_room_never_handed_to_a_writer_is_quiet_at_once_and_never_will_be() -> None:
    """Not started (the prefill request still on its way) or started with its prompt
    still queued: closed, nothing will ever write it, so decode waits for nothing (a
    fenced ring never waits on prefill's queue, which may wait on that ring)."""
    rooms = Rooms(LAYOUT, 30.0)
    rooms.start(3)
    assert rooms.fence({2: "decode: gave up", 3: "decode: gave up"}, 0.0) == [2, 3]
    assert rooms.hand(3) == "failed: decode: gave up"  # the prompt is computed: not sent
    assert rooms.fence({3: "decode: again"}, 0.0) == [3]
    try:
        rooms.start(2)
    except Exception as exc:  # a closed room never starts
        assert "closed" in str(exc)
    else:
        raise AssertionError("a fenced room started")


# -- the engine keeps fenced pages out of the pool ----------------------------------
class Hooks:
    def __init__(self) -> None:
        self.fenced: list[int] = []

    def admitted(self, request: Request) -> None:
        pass

    def aborted(self, request: Request) -> None:
        pass

    def fence(self, request: Request) -> None:
        assert request.room is not None
        self.fenced.append(request.room)


def _forward(pieces: Sequence[Piece]) -> torch.Tensor:
    return torch.zeros(sum(1 for p in pieces if p.want_logits), 512)


def test_an_aborted_transfer_keeps_its_pages_until_unfenced() -> None:
    kv = PagePool(2, 9 * 16, 2, 8, 16, torch.float32, torch.device("cpu"))  # 8 pages + scratch
    scheduler = Scheduler(kv, ReqToToken(8, 256), RadixCache(kv.pages, 16), Budget(8, 256))
    scheduler.receives_kv = True
    hooks = Hooks()
    engine = Engine(scheduler, _forward, ByteTokenizer(512), hooks=hooks)  # type: ignore[arg-type]
    ended = threading.Event()

    def sink(event: Event) -> None:
        if event.finish_reason is not None:
            ended.set()

    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    request = Request("a", list(range(1, 49)), params, sink)  # 4 pages with its 16 new tokens
    request.room = 7
    engine.start()
    try:
        engine.submit(request)
        wait_until(lambda: request.phase is Phase.TRANSFER, 10, "the request's admission")
        pages = list(request.pages)
        assert kv.pages.num_free == 4
        engine.abort("a")
        assert ended.wait(10)
        assert engine.call(lambda: hooks.fenced) == [7]
        assert engine.call(lambda: kv.pages.num_free) == 4  # held: a late write lands there
        assert engine.call(lambda: scheduler.num_fenced_pages) == 4
        assert not scheduler.running
        engine.unfence(7)
        assert engine.call(lambda: kv.pages.num_free) == 8
        assert engine.call(lambda: scheduler.fenced) == {}
        assert sorted(engine.call(lambda: kv.pages.allocate(8))) == sorted(set(range(8))) and set(
            pages
        ) <= set(range(8))
    finally:
        engine.stop()


# -- decode: the fence asks, releases, bounds ----------------------------------------
class FakeClient:
    def __init__(self, answer: Any) -> None:
        self.answer, self.calls = answer, []

    def call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((method, path, kwargs["json"]))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer(kwargs["json"])


def test_the_fence_releases_once_prefill_confirms() -> None:
    quiet: set[int] = set()
    client = FakeClient(
        lambda body: {"quiet": [r["room"] for r in body["rooms"] if r["room"] in quiet]}
    )
    fence = Fence("decode rank 0", lambda address: client, bound_s=30)  # type: ignore[arg-type,return-value]
    released: list[str] = []
    fence.add(5, "p:1", "decode: aborted", lambda: released.append("pages"))
    fence.add(5, "p:1", "decode: aborted", lambda: released.append("ring"))
    wait_until(lambda: client.calls, 5, "the fence to ask prefill")
    assert released == [] and fence.rooms() == {5}
    assert client.calls[0][1] == "/bootstrap/fence"
    assert client.calls[0][2]["rooms"] == [{"room": 5, "reason": "decode: aborted"}]
    quiet.add(5)
    wait_until(lambda: len(released) == 2, 5, "the release")
    assert sorted(released) == ["pages", "ring"] and fence.rooms() == set()
    assert fence.counts == {"released": 1, "writer_gone": 0, "unconfirmed": 0}


def test_a_prefill_that_is_gone_releases_at_once() -> None:
    client = FakeClient(PeerCallError("prefill unreachable: connection refused", refused=True))
    fence = Fence("decode rank 0", lambda address: client, bound_s=30)  # type: ignore[arg-type,return-value]
    released = threading.Event()
    fence.add(6, "p:1", "decode: prefill died", released.set)
    assert released.wait(5)
    assert fence.counts["writer_gone"] == 1


def test_a_prefill_alive_on_this_host_is_not_taken_for_gone() -> None:
    """A refused connection from a prefill whose pidfd says it runs is no proof: its
    rooms wait (here until the bound, then they go back counted unconfirmed)."""
    client = FakeClient(PeerCallError("prefill unreachable: connection refused", refused=True))
    fence = Fence("decode rank 0", lambda address: client, bound_s=0.5)  # type: ignore[arg-type,return-value]
    fence.liveness.watch("p:1", my_identity())  # this very process: alive
    released = threading.Event()
    fence.add(8, "p:1", "decode: gave up", released.set)
    time.sleep(0.2)
    assert not released.is_set()
    assert released.wait(5)
    assert fence.counts == {"released": 0, "writer_gone": 0, "unconfirmed": 1}


def test_a_pidfd_sees_a_writer_end() -> None:
    liveness = WriterLiveness()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    liveness.watch("p:1", dataclasses.replace(my_identity(), pid=pid))
    os.waitpid(pid, 0)
    assert liveness.gone("p:1", PeerCallError("timed out"))
    assert not liveness.gone("elsewhere:1", PeerCallError("timed out"))  # no pidfd, not refused


def test_leaks_count_fenced_rooms_and_unconfirmed_releases() -> None:
    info = ServerInfo(kv=KVPool(total_pages=8, free_pages=4), fence=FenceState(rooms=1, pages=4))
    assert info.leaks() == ["4 KV pages held", "1 rooms fenced (waiting for their writers)"]
    info = ServerInfo.from_json(
        {"kv": {"total_pages": 8, "free_pages": 8}, "fence": {"released": 3, "unconfirmed": 1}}
    )
    assert info.leaks() == ["1 fenced rooms released unconfirmed"]
    assert ServerInfo.from_json({"kv": {"total_pages": 8, "free_pages": 8}}).leaks() == []
