"""Tensor parallelism across processes: the group, the step protocol, the worker loop.

Rank 0 runs the scheduler. Before each forward it announces the batch to the
other ranks as int64s (never pickled objects; through the shared file of the gathers,
`tp_shm`, where there is one, else gloo broadcasts), then every rank runs the
same forward, exchanging row-parallel partials with `gather`. Other operations
(the KV transfers of the PD roles) register handlers by op code, so one loop
serves them all. A second group on host memory (`publish` / `listen`) carries
messages that arrive off the step protocol, from a thread of their own: prefill
rank 0 tells its other ranks how decode registered each room (`pd/room_state.py`).
A third one carries messages the other way (`report` / `collect`): each rank tells
rank 0 it finished a room's KV (`pd/reports.py`).

    message  op | payload  (one int64 tensor through the shared file; by gloo a
                           header (op, size, 0, 0) then the payload)
    FORWARD payload   per piece (n, start, want_logits, rows) | tokens | rows

What waits without a deadline (`NO_DEADLINE`), and why: a server idles as long as
nobody sends it a request, and a gloo wait that runs out fails by closing every
connection of its group, so a wait for rank 0's next word lasts as long as the
server: ranks > 0 waiting for the next step (`receive`: on the shared file's futex,
else on the broadcast of the header, a host tensor, so on an accelerator the default
group's gloo half carries it, never the collective library), the listeners of the
control group, rank 0's collector of reports. The rest keeps the group's timeout,
where a long wait means a rank is stuck or gone: the rendezvous, the payload right
after its header, a forward's gathers, rank 0 waiting for the ranks to read a step.
A rank 0 that dies leaves no one waiting: its other ranks die with its process
(`ranks.die_with_parent`), and gloo fails their wait as soon as its connections close.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from pdctl.serve import tp_shm
from pdctl.serve.model.batch import Piece
from pdctl.serve.ranks import RankProcess
from pdctl.serve.tp_ops import Op

T = TypeVar("T")
log = logging.getLogger("pdctl.serve")
Handler = Callable[[torch.Tensor], None]
REPORT_HEADER, REPORT_BODY = 1, 2  # the tags of a report's two messages
# How long a rank waits for a message that comes whenever it comes (the next report,
# the next room's registrations): as long as the server lives. gloo fails a wait that
# runs out by closing every connection of its group, so an idle server must never
# reach the end of one (the group's own timeout would, after 10 minutes).
NO_DEADLINE = timedelta(days=3650)


class TPGroup:
    def __init__(
        self,
        rank: int,
        world: int,
        host: str,
        port: int,
        backend: str,
        timeout_s: float,
        *,
        via_host: bool = False,  # gather device tensors through host memory (gloo)
        shared_memory: bool = True,  # gloo's gathers through futexes in shared memory
    ) -> None:
        self.rank, self.world = rank, world
        self.via_host = via_host
        timeout = timedelta(seconds=timeout_s)
        if rank == 0:
            # torch's TCPStore server binds every interface; hand it a socket bound to
            # `host` instead, so the rendezvous listens where the topology says.
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(max(world, 16))
            store = dist.TCPStore(
                host,
                port,
                world,
                True,
                timeout,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),  # the store owns the socket now
            )
        else:
            store = dist.TCPStore(host, port, world, False, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        steps = dist.group.WORLD
        assert steps is not None  # init_process_group made it
        self.steps = steps  # the default group: steps (`receive`) and gathers
        shared = backend == "gloo" and shared_memory
        self.shared = _shared_gather(store, rank, world, timeout_s) if shared else None
        self.handlers: dict[int, Handler] = {}
        # rank 0's sends: one at a time, none between a forward's gathers (`send`)
        self._sending = threading.Lock()
        self._in_forward = False
        self._queued: list[tuple[torch.Tensor, bool]] = []  # (message, last)
        # A second group, on host memory, for messages off the step protocol: rank 0
        # publishes from one thread, the others listen on one (see `publish`/`listen`).
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        # A third, for the other ranks' reports to rank 0 (see `report`/`collect`).
        self.reports = dist.new_group(backend="gloo", timeout=timeout)
        self._reporting = threading.Lock()  # a rank's reports go one at a time
        self._reports_ended: set[int] = set()  # rank 0: ranks that report no more

    def gather(self, partials: torch.Tensor) -> torch.Tensor:
        local = partials.to("cpu") if self.via_host else partials.contiguous()
        if self.shared is not None and self.shared.fits(local):  # the same choice on every rank
            gathered = self.shared.gather(local)
        else:
            parts = [torch.empty_like(local) for _ in range(self.world)]
            dist.all_gather(parts, local)
            gathered = torch.cat(parts)
        return gathered.to(partials.device) if self.via_host else gathered

    def send(self, op: int, payload: torch.Tensor | None = None, last: bool = False) -> None:
        """Rank 0: announce an operation and its payload to every rank: through the
        shared file where there is one (a futex wake, against about 0.9 ms for each
        of gloo's two broadcasts on a 2-core machine), else by gloo. `last`: nothing
        follows (the stop): the shared file's send does not wait for the ranks to read
        it (a rank may have died, or be ending on the same signal).

        The shared file carries the forwards' gathers too, so a message must not land
        between two of them: one sent from another thread while a forward runs
        (`forward`) goes out right after that forward, where the other ranks would read
        it anyway (they take messages only between forwards)."""
        message = _message(op, payload)
        with self._sending:
            if self._in_forward:
                self._queued.append((message, last))
                return
            self._announce(message, last)

    def forward(self, payload: torch.Tensor, run: Callable[[], T]) -> T:
        """Rank 0: announce a FORWARD with `payload`, run it (`run`: this rank's part,
        gathers included), then send what other threads sent meanwhile."""
        with self._sending:
            self._announce(_message(Op.FORWARD, payload), False)
            self._in_forward = True
        try:
            return run()
        finally:
            with self._sending:
                self._in_forward = False
                queued, self._queued = self._queued, []
                for message, last in queued:
                    self._announce(message, last)

    def _announce(self, message: torch.Tensor, last: bool) -> None:
        if self.shared is not None and self.shared.broadcast(message, last) is not None:
            return
        size = message.numel() - 1
        dist.broadcast(torch.tensor([int(message[0]), size, 0, 0], dtype=torch.int64), src=0)
        if size:
            dist.broadcast(message[1:].contiguous(), src=0)

    def receive(self) -> tuple[int, torch.Tensor]:
        """Ranks > 0: the next operation rank 0 announced (`send`), waiting as long as it
        takes (the server may idle for hours); the payload, sent right after the
        header, within the group's timeout."""
        if self.shared is not None:
            message = self.shared.broadcast(None)
            if message is not None:
                return int(message[0]), message[1:]
        header = torch.empty(4, dtype=torch.int64)
        _broadcast_without_deadline(header, self.steps)
        op, size = int(header[0]), int(header[1])
        payload = torch.empty(size, dtype=torch.int64)
        if size:
            dist.broadcast(payload, src=0)
        return op, payload

    def publish(self, message: bytes | None) -> None:
        """Rank 0, from one thread only: broadcast a message on the control group
        (None: the last one, after which the listeners return)."""
        size = -1 if message is None else len(message)
        dist.broadcast(torch.tensor([size], dtype=torch.int64), src=0, group=self.control)
        if message:
            payload = torch.frombuffer(bytearray(message), dtype=torch.uint8)
            dist.broadcast(payload, src=0, group=self.control)

    def listen(self) -> bytes | None:
        """Ranks > 0, from one thread only: the next published message (None: the end),
        however long it takes (`NO_DEADLINE`: rank 0 publishes when a room changes)."""
        header = torch.empty(1, dtype=torch.int64)
        _broadcast_without_deadline(header, self.control)
        size = int(header[0])
        if size < 0:
            return None
        payload = torch.empty(size, dtype=torch.uint8)
        if size:
            dist.broadcast(payload, src=0, group=self.control)
        return payload.numpy().tobytes()

    def report(self, message: bytes | None) -> None:
        """Ranks > 0, from any thread: send `message` to rank 0's `collect` (None: this
        rank reports no more). A header (its size), then its bytes; one report at a
        time, so rank 0 reads a rank's bytes right after its header."""
        size = -1 if message is None else len(message)
        header = torch.tensor([size], dtype=torch.int64)
        with self._reporting:
            dist.send(header, dst=0, group=self.reports, tag=REPORT_HEADER)
            if message:
                payload = torch.frombuffer(bytearray(message), dtype=torch.uint8)
                dist.send(payload, dst=0, group=self.reports, tag=REPORT_BODY)

    def collect(self) -> tuple[int, bytes] | None:
        """Rank 0, from one thread only: the next message another rank reported, with
        that rank (whichever comes first); None once every other rank reported its end.
        Waits as long as it takes (`NO_DEADLINE`)."""
        while len(self._reports_ended) < self.world - 1:
            header = torch.empty(1, dtype=torch.int64)
            work = self.reports.recv_anysource([header], REPORT_HEADER)
            work.wait(NO_DEADLINE)
            rank, size = work.source_rank(), int(header[0])
            if size < 0:
                self._reports_ended.add(rank)
                continue
            payload = torch.empty(size, dtype=torch.uint8)
            if size:
                dist.recv(payload, src=rank, group=self.reports, tag=REPORT_BODY)
            return rank, payload.numpy().tobytes()
        return None

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _broadcast_without_deadline(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Ranks > 0: rank 0's broadcast of `tensor` on `group`, however long rank 0 takes to
    send it. gloo limits the wait by the call's options, else by the group's timeout;
    `dist.broadcast` passes none."""
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor, options.timeout = 0, 0, NO_DEADLINE
    group.broadcast([tensor], options).wait(NO_DEADLINE)


def _shared_gather(
    store: dist.TCPStore, rank: int, world: int, timeout_s: float
) -> tp_shm.SharedGather | None:
    """Host-memory gathers through a shared file (`tp_shm`), which rank 0 creates and
    names in the store; unlinked once every rank mapped it, so nothing outlives the
    ranks. None where futexes are missing."""
    if not tp_shm.available():
        return None
    if rank == 0:
        path = f"/dev/shm/pdctl-tp-{os.getpid()}-{secrets.token_hex(4)}"
        tp_shm.SharedGather.create(path, world)
        store.set("pdctl_tp_shared_gather", path)
    else:
        path = store.get("pdctl_tp_shared_gather").decode()
    shared = tp_shm.SharedGather(path, rank, world, timeout_s)
    dist.barrier()  # every rank mapped it
    if rank == 0:
        tp_shm.unlink(path)
    return shared


def _message(op: int, payload: torch.Tensor | None) -> torch.Tensor:
    """An operation as one int64 tensor: op | payload."""
    body = torch.empty(0, dtype=torch.int64) if payload is None else payload
    return torch.cat([torch.tensor([op], dtype=torch.int64), body.to(torch.int64).view(-1)])


def float_bits(values: torch.Tensor) -> torch.Tensor:
    """Any float tensor -> its float32 bit patterns as flat int64 (exact for every model
    dtype), for the int64 broadcasts."""
    return (
        values.detach().to("cpu", torch.float32).contiguous().view(torch.int32).reshape(-1).long()
    )


def from_float_bits(bits: torch.Tensor, *shape: int) -> torch.Tensor:
    """The inverse of float_bits: float32 values of `shape`."""
    return bits.to(torch.int32).view(torch.float32).view(*shape)


def encode_pieces(pieces: Sequence[Piece]) -> torch.Tensor:
    meta = [[p.tokens.numel(), p.start, int(p.want_logits), p.rows.numel()] for p in pieces]
    parts = [torch.tensor(meta, dtype=torch.int64).reshape(-1)]
    parts += [p.tokens.to(torch.int64) for p in pieces]
    parts += [p.rows.to(torch.int64) for p in pieces]
    # multimodal rows, as the bits of float32 values (exact for every model dtype)
    embed_meta = [len(p.embeds) for p in pieces]
    for piece in pieces:
        for index, rows in piece.embeds:
            embed_meta += [index, rows.shape[0], rows.shape[1]]
            parts.append(float_bits(rows))
    parts.insert(0, torch.tensor(embed_meta, dtype=torch.int64))
    return torch.cat([torch.tensor([len(pieces), len(embed_meta)], dtype=torch.int64), *parts])


def decode_pieces(payload: torch.Tensor) -> list[Piece]:
    count, embed_len = int(payload[0]), int(payload[1])
    embed_meta = payload[2 : 2 + embed_len].tolist()
    offset = 2 + embed_len
    meta = payload[offset : offset + 4 * count].view(count, 4).tolist()
    offset += 4 * count
    tokens = []
    for row in meta:
        tokens.append(payload[offset : offset + row[0]])
        offset += row[0]
    pieces = []
    for (_, start, want, rows), piece_tokens in zip(meta, tokens, strict=True):
        pieces.append(Piece(piece_tokens, start, payload[offset : offset + rows], bool(want)))
        offset += rows
    cursor = count
    for piece, num_embeds in zip(pieces, embed_meta[:count], strict=True):
        embeds = []
        for _ in range(num_embeds):
            index, height, width = embed_meta[cursor : cursor + 3]
            cursor += 3
            bits = payload[offset : offset + height * width]
            embeds.append((index, from_float_bits(bits, height, width)))
            offset += height * width
        piece.embeds = tuple(embeds)
    return pieces


def worker_loop(group: TPGroup, forward: Callable[[Sequence[Piece]], object]) -> None:
    """Ranks > 0: run whatever rank 0 announces until it says stop."""
    while True:
        op, payload = group.receive()
        if op == Op.STOP:
            return
        if op == Op.FORWARD:
            forward(decode_pieces(payload))
        elif op in group.handlers:
            group.handlers[op](payload)
        else:
            raise RuntimeError(f"unknown TP operation {op}")


def watch_ranks(
    children: list[RankProcess], server: str, on_death: Callable[[str], None]
) -> threading.Thread:
    """Fail fast: when a rank exits, report which (`server` rank N, as the transport
    endpoints are named) and how."""

    def watch() -> None:
        import time

        while True:
            for rank, child in enumerate(children, start=1):
                code = child.poll()
                if code is not None:
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    on_death(f"{server} rank {rank} (pid {child.pid}) ended with {how}")
                    return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, name="pdctl-rank-watch", daemon=True)
    thread.start()
    return thread
