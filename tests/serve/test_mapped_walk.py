"""The mapped write is walkable: one room's page, armed and fired through `KVSender` as
the engine does it, enters no file more than twice (docs/structure.md, "One KV page's
walk"). A file is entered when a call lands in it from another file; a return is not
an entry. Comprehensions count as their function (Python 3.12 runs them inline).

On the CPU staging's kernels take their reference path, which enters staging's own
files more often than the GPU's replay: only serve/pd is held to it there. On a GPU
(`gpu`) the page goes the documented way, a CUDA graph's replay that rings decode's
doorbell (a box of this process) or, with no doorbell offered, is followed by the
transport's message, and every file of pdctl is held to it."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import pdctl
from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.room_state import RoomSnapshot, RoomWait
from pdctl.serve.pd.sender import KVSender
from pdctl.staging.doorbell import SUMS, BellBox
from pdctl.staging.kernels.page_write import WRITES
from pdctl.staging.transport import Peer
from tests.serve.kv_registrations import direct_registration

PACKAGE = Path(pdctl.__file__).parent
INLINE = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}
PAGES, DECODE_PAGES = [3, 4, 5], [7, 8, 9]


class MappingTransport:
    """Maps a "decode" pool of this process; connects to anything."""

    RINGS_BELLS = False

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def register_tensor(self, tensor: torch.Tensor) -> None:
        pass

    def connect(self, description: bytes) -> Peer:
        return Peer("decode", "local", [])

    def mapped_view(self, peer: Peer, address: int) -> torch.Tensor:
        whole = self.pool.kv.view(-1).view(torch.uint8)
        return whole[address - self.pool.kv.data_ptr() :]

    def notify(self, peer: Peer, notice: bytes) -> None:
        pass


def _entered(call: Callable[..., Any], *args: Any) -> tuple[list[str], Any]:
    """The files of pdctl that `call(*args)` enters, in order (as paths relative to the
    package), and what it returned."""
    walk: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or frame.f_code.co_name in INLINE:
            return
        here = Path(frame.f_code.co_filename)
        if PACKAGE in here.parents:
            name = here.relative_to(PACKAGE).as_posix()
            if not walk or walk[-1] != name:
                walk.append(name)

    sys.setprofile(profile)
    try:
        value = call(*args)
    finally:
        sys.setprofile(None)
    return walk, value


class Rooms:
    """A sender of a "prefill" pool into a "decode" pool of this process, and the rooms
    it sends: `send(room)` arms, fires, prepares and sends one as the engine does,
    the walks of arm and fire returned (None where the room was not armed early)."""

    def __init__(self, device: torch.device, box: BellBox | None = None) -> None:
        self.prefill = KVPool(2, 256, 2, 8, 16, torch.float32, device)
        self.decode = KVPool(2, 256, 2, 8, 16, torch.float32, device)
        self.box = box
        self.registrations: dict[int, proto.Registration] = {}
        self.reported = threading.Event()
        self.replayed = 0
        self.sender = KVSender(
            rank=0,
            tp=1,
            num_kv_heads=2,
            kv=self.prefill,
            transport=MappingTransport(self.decode),  # type: ignore[arg-type]
            snapshot=self._snapshot,
            report=lambda room, body: self.reported.set(),
            segment_bytes=1 << 20,
            bootstrap_timeout=5.0,
            transfer_timeout=5.0,
            workers=1,
        )

    def _snapshot(self, room: int, wait: float, condition: RoomWait) -> RoomSnapshot:
        return RoomSnapshot(room, True, None, None, {0: self.registrations[room]})

    def send(self, room: int) -> tuple[list[str], list[str]] | None:
        ticket = None if self.box is None else self.box.ticket()
        bell = (
            None if self.box is None or ticket is None else proto.BellOffer(self.box.info, [ticket])
        )
        self.registrations[room] = direct_registration(
            self.decode, room, list(DECODE_PAGES), 48, transport="eA==", bell=bell
        )
        self.reported.clear()
        armed, fire = _entered(self.sender.arm, room, PAGES)
        replays = WRITES.replays
        walks = None if fire is None else (armed, _entered(fire)[0])
        self.replayed = WRITES.replays - replays  # graphs replayed by the fire
        self.sender.prepare(room, PAGES)
        self.sender.send(room, PAGES, 48, _Done())
        assert self.reported.wait(10)
        if self.box is not None and ticket is not None and walks is not None:
            rung = self.box.wait(ticket, 5.0)  # decode's side: the ring arrived
            assert rung is not None and rung[0] == SUMS, "the device rang the doorbell"
            self.box.release(ticket)
        return walks

    def landed(self) -> bool:
        """Decode's pages hold prefill's, every layer's K and V."""
        pools = (self.prefill, self.decode)
        sources, targets = ([*p.k_buffers, *p.v_buffers] for p in pools)
        return all(
            torch.equal(source[page * 16 : page * 16 + 16], target[into * 16 : into * 16 + 16])
            for source, target in zip(sources, targets, strict=True)
            for page, into in zip(PAGES, DECODE_PAGES, strict=True)
        )


def _walk(armed: list[str], fired: list[str]) -> str:
    return " -> ".join(armed) + " | " + " -> ".join(fired)


def test_one_page_enters_no_serve_pd_file_more_than_twice() -> None:
    rooms = Rooms(torch.device("cpu"))
    walks = [rooms.send(room) for room in (1, 2)]  # the first connects decode's transport
    assert walks[0] is None and walks[1] is not None, "the second room is armed early"
    armed, fired = walks[1]
    assert armed[0] == "serve/pd/sender.py" and fired[0] == "serve/pd/early.py"
    assert "staging/kernels/page_write.py" in armed and "staging/kernels/page_write.py" in fired
    entered = Counter(f for f in armed + fired if f.startswith("serve/pd/"))
    assert max(entered.values()) <= 2, f"{entered.most_common(4)} in {_walk(armed, fired)}"


@pytest.fixture
def bell_box() -> Iterator[BellBox]:
    with BellBox(4, 64) as box:
        yield box


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("rung", [True, False], ids=["doorbell", "message"])
def test_one_page_on_a_gpu_enters_no_file_more_than_twice(rung: bool, bell_box: BellBox) -> None:
    """The documented walk: decode's pool mapped here, the write's shape replayed from a
    graph. Decode is told by its doorbell, which the graph's launch rings (`doorbell`),
    or, where decode offered none, by the transport's message after the fire
    (`message`). The first rooms connect, see the shape, capture it and use every slot
    of its ring once; the last one is walked."""
    rooms = Rooms(torch.device("cuda"), bell_box if rung else None)
    for pool in (rooms.prefill, rooms.decode):
        pool.kv.copy_(torch.randn_like(pool.kv))
    walks = [rooms.send(room) for room in range(1, 11)]
    armed, fired = walks[-1] or ([], [])
    assert rooms.replayed == 1, "the walked room's write is a graph's replay"
    walk = _walk(armed, fired)
    entered = Counter(armed + fired)
    print(f"\nthe walk ({'doorbell' if rung else 'message'}): {walk}")
    print(f"entered: {dict(entered.most_common())}")
    assert armed[0] == "serve/pd/sender.py" and fired[0] == "serve/pd/early.py"
    for name in ("serve/pd/mapped_write.py", "staging/kernels/page_write.py"):
        assert name in armed, f"{name} is on the arm's walk: {walk}"
    replay = ["staging/kernels/captured.py", "staging/held_replay.py"]
    for name in replay + (["staging/futex.py"] if rung else []):
        assert name in fired, f"{name} is on the fire's walk (a graph's replay): {walk}"
    torch.cuda.synchronize()
    assert rooms.landed()
    assert max(entered.values()) <= 2, f"{entered.most_common(6)} in {walk}"


class _Done:
    """A forward already complete."""

    def synchronize(self) -> None:
        pass
