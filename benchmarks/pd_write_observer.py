"""Where a mapped write's host time goes, seen from inside the writer.

    python benchmarks/pd_write_observer.py [--device cuda] [--writes 12] [--profiled 6]

Attaches `WriteObserver` (this file) to a `MappedWriter` (serve/pd/mapped_write.py,
whose own observer does nothing) and runs its writes: a room's pages from a prefill
pool into a "decode" pool of this process that a stand-in transport maps (on a GPU,
the builtin transport maps a peer's through device IPC; the write's own path is the
same). Per write: the host's enqueue (arm and launch), the time this thread itself ran
of it (the rest it waited: the GIL, the OS), the garbage collector's share, the
launch's device span, the finish and the write's time, in microseconds. The first
`--profiled` arms run under the pure-Python profiler and the functions that took the
most time are printed (where the host's enqueue time goes).

The pure-Python profiler (`profile`, through sys.setprofile) sees only the calling
thread. cProfile would be cheaper, but from Python 3.12 it profiles every thread of
the process (sys.monitoring is process-wide). Its per-call overhead inflates
call-heavy code: read the shares, not the absolute times.
"""

from __future__ import annotations

import argparse
import gc
import io
import profile
import pstats
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.mapped_write import MappedWriter, RoomWrite, StartedWrite
from pdctl.staging.layout import StagingLayout, head_slices
from pdctl.staging.transport import Peer

T = TypeVar("T")


class GcClock:
    """Seconds each thread spent in the garbage collector (a `gc.callbacks` entry,
    installed once)."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}
        self._spent: dict[int, float] = {}
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            self._installed = True
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._installed:
            self._installed = False
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = time.perf_counter()
        elif thread in self._started:
            spent = time.perf_counter() - self._started.pop(thread)
            self._spent[thread] = self._spent.get(thread, 0.0) + spent

    def seconds(self) -> float:
        """This thread's seconds in collections so far."""
        return self._spent.get(threading.get_ident(), 0.0)


@dataclass
class Clocked:
    """A span of host work: wall seconds, this thread's, the collector's."""

    host: float = 0.0
    run: float = 0.0
    collecting: float = 0.0


class WriteObserver:
    """Times each arm and launch, profiles the first `profiled` arms, keeps each
    finished write's parts (`rows`)."""

    def __init__(self, profiled: int = 0) -> None:
        self.left = profiled
        self.stats: pstats.Stats | None = None
        self.gc = GcClock()
        self.gc.install()
        self.armed: Clocked | None = None
        self.enqueues: dict[int, Clocked] = {}  # room -> its arm and launch
        self.rows: list[dict[str, Any]] = []

    def _clocked(self, function: Callable[[], T], into: Clocked) -> T:
        began, cpu, collected = time.perf_counter(), time.thread_time(), self.gc.seconds()
        try:
            return function()
        finally:
            into.host += time.perf_counter() - began
            into.run += time.thread_time() - cpu
            into.collecting += self.gc.seconds() - collected

    def arming(self, arm: Callable[[], T]) -> T:
        self.armed = Clocked()
        if not self.left:
            return self._clocked(arm, self.armed)
        profiler = profile.Profile()
        try:
            return self._clocked(lambda: profiler.runcall(arm), self.armed)
        finally:
            self.left -= 1
            if self.stats is None:
                self.stats = pstats.Stats(profiler)
            else:
                self.stats.add(profiler)

    def firing(self, fire: Callable[[], T]) -> T:
        span = self.armed or Clocked()
        self.armed = None
        result = self._clocked(fire, span)
        self.enqueues[getattr(result, "room", -1)] = span
        return result

    def finished(
        self, started: StartedWrite, told: str, inline: bool, device_s: float,
        finish_s: float, seconds: float,
    ) -> None:  # fmt: skip
        span = self.enqueues.pop(started.room, Clocked())
        self.rows.append({
            "told": told, "enqueue": span.host, "run": span.run,
            "collecting": span.collecting, "device": device_s, "finish": finish_s,
            "write": seconds,
        })  # fmt: skip

    def report(self, lines: int = 30) -> str:
        """The profiled arms' functions that took the most time."""
        if self.stats is None:
            return "(no arm profiled)"
        out = io.StringIO()
        self.stats.stream = out  # type: ignore[attr-defined]
        self.stats.sort_stats("tottime").print_stats(lines)
        return out.getvalue()


class MappingTransport:
    """`mapped_view` over a pool of this process; notifications counted."""

    def __init__(self, pool: KVPool) -> None:
        self.pool, self.notices = pool, 0

    def mapped_view(self, peer: Peer, address: int) -> torch.Tensor:
        whole = self.pool.kv.view(-1).view(torch.uint8)
        return whole[address - self.pool.kv.data_ptr() :]

    def notify(self, peer: Peer, notice: bytes) -> None:
        self.notices += 1


def run(device: str, writes: int, profiled: int, tokens: int) -> WriteObserver:
    layers, heads, head_dim, page = 16, 8, 128, 16
    pages = tokens // page
    target = torch.device(device)
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    prefill = KVPool(layers, (2 * pages + 2) * page, heads, head_dim, page, dtype, target)
    decode = KVPool(layers, (2 * pages + 2) * page, heads, head_dim, page, dtype, target)
    observer = WriteObserver(profiled)
    writer = MappedWriter(0, prefill, MappingTransport(decode), observer=observer)  # type: ignore[arg-type]
    layout = StagingLayout(layers, head_dim, prefill.kv.element_size(), head_slices(heads, 1, 1, 0))
    reg = proto.Registration(
        room=0, decode_rank=0, decode_tp=1, decode_name="decode", transport="",
        num_tokens=tokens, page_size=page, mode="direct", kv_heads=heads, head_dim=head_dim,
        num_layers=layers, elem_bytes=prefill.kv.element_size(), segment_bytes=1 << 30,
        pages=list(range(1, pages + 1)),
        kv_bases=[[k.data_ptr(), v.data_ptr()]
                  for k, v in zip(decode.k_buffers, decode.v_buffers, strict=True)],
    )  # fmt: skip
    peer = Peer("decode", "local", [])
    source = list(range(pages + 1, 2 * pages + 1))
    try:
        for room in range(writes):
            armed = writer.arm(RoomWrite(room, source, reg, layout, 0, peer))
            assert armed is not None, "the stand-in pool is not mapped"
            writer.finish(armed.fire())
    finally:
        observer.gc.uninstall()
    return observer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--writes", type=int, default=12)
    parser.add_argument("--profiled", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=2048)
    parsed = parser.parse_args()
    observer = run(parsed.device, parsed.writes, parsed.profiled, parsed.tokens)
    rows = observer.rows[parsed.profiled :] or observer.rows
    print(f"{len(rows)} unprofiled writes of {parsed.tokens} tokens on {parsed.device}, "
          f"median us (told by {rows[0]['told']}):")  # fmt: skip
    for key in ("enqueue", "run", "collecting", "device", "finish", "write"):
        print(f"  {key:<11} {statistics.median(r[key] for r in rows) * 1e6:10.1f}")
    print(observer.report())


if __name__ == "__main__":
    main()
