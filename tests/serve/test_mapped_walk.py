"""The mapped write is walkable: one room's page, armed and fired through `KVSender` as
the engine does it, enters no file of serve/pd more than twice (docs/structure.md,
"One KV page's walk"). A file is entered when a call lands in it from another file;
a return is not an entry. Comprehensions count as their function (Python 3.12 runs
them inline). CPU here: staging's kernels take their reference path, which enters
staging's own files more often than the GPU's replay; only serve/pd is held to it."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import pdctl
from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.room_state import RoomSnapshot, RoomWait
from pdctl.serve.pd.sender import KVSender
from pdctl.staging.transport import Peer

PACKAGE = Path(pdctl.__file__).parent
PD = PACKAGE / "serve" / "pd"
INLINE = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}


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
    """The files of pdctl that `call(*args)` enters, in order, and what it returned."""
    walk: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or frame.f_code.co_name in INLINE:
            return
        here = Path(frame.f_code.co_filename)
        if PACKAGE in here.parents and (not walk or walk[-1] != str(here)):
            walk.append(str(here))

    sys.setprofile(profile)
    try:
        value = call(*args)
    finally:
        sys.setprofile(None)
    return walk, value


def test_one_page_enters_no_serve_pd_file_more_than_twice() -> None:
    prefill = KVPool(2, 256, 2, 8, 16, torch.float32, torch.device("cpu"))
    decode = KVPool(2, 256, 2, 8, 16, torch.float32, torch.device("cpu"))
    registrations: dict[int, proto.Registration] = {}
    reported = threading.Event()

    def snapshot(room: int, wait: float, condition: RoomWait) -> RoomSnapshot:
        return RoomSnapshot(room, True, None, None, {0: registrations[room]})

    sender = KVSender(
        rank=0,
        tp=1,
        num_kv_heads=2,
        kv=prefill,
        transport=MappingTransport(decode),  # type: ignore[arg-type]
        snapshot=snapshot,
        report=lambda room, body: reported.set(),
        segment_bytes=1 << 20,
        bootstrap_timeout=5.0,
        transfer_timeout=5.0,
        workers=1,
    )
    pairs = zip(decode.k_buffers, decode.v_buffers, strict=True)
    bases = [[k.data_ptr(), v.data_ptr()] for k, v in pairs]
    pages = [3, 4, 5]
    walks: list[list[str]] = []
    for room in (1, 2):  # the first connects decode's transport (its worker's way)
        registrations[room] = proto.Registration(
            room=room,
            decode_rank=0,
            decode_tp=1,
            decode_name="decode",
            transport="eA==",
            num_tokens=48,
            page_size=16,
            mode="direct",
            kv_heads=2,
            head_dim=8,
            num_layers=2,
            elem_bytes=4,
            segment_bytes=1 << 20,
            pages=[7, 8, 9],
            kv_bases=bases,
        )
        reported.clear()
        armed, fire = _entered(sender.arm, room, pages)
        assert (fire is not None) is (room == 2), "the second room is armed early"
        if fire is not None:
            walks += [armed, _entered(fire)[0]]
        sender.prepare(room, pages)
        sender.send(room, pages, 48, _Done())
        assert reported.wait(10)
    armed, fired = ([Path(f).relative_to(PACKAGE).as_posix() for f in w] for w in walks)
    assert armed[0] == "serve/pd/sender.py" and fired[0] == "serve/pd/early.py"
    assert "staging/kernels/page_write.py" in armed and "staging/kernels/page_write.py" in fired
    entered = Counter(f for f in armed + fired if f.startswith("serve/pd/"))
    walk = " -> ".join(armed) + " | " + " -> ".join(fired)
    assert max(entered.values()) <= 2, f"{entered.most_common(4)} in {walk}"


class _Done:
    """A forward already complete."""

    def synchronize(self) -> None:
        pass
