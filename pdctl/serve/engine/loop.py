"""The engine: one scheduler thread that batches requests and runs the model.

Callers (the HTTP layer) submit requests and commands from any thread; the
scheduler thread owns every piece of engine state, runs forwards and delivers
`Event`s through each request's sink. In overlap mode the forward runs on a
worker thread while the scheduler admits and prepares new requests; the tokens
are the same either way (the model is batch-invariant).

The engine knows nothing about HTTP or about how ranks communicate: `forward` is
whatever callable runs one batch on every rank and returns rank 0's logits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdctl.records import KVTransfer
from pdctl.serve.engine.request import Event, FinishReason, Phase, Request
from pdctl.serve.engine.sampling import TokenChoice, choose, generator_for
from pdctl.serve.engine.scheduler import Scheduler
from pdctl.serve.faults import faults
from pdctl.serve.model.batch import Piece
from pdctl.serve.tokenizer import Tokenizer

# The scheduler thread's waits on its inbox: idle; with requests blocked (on pages, or
# on their KV transfers: a transfer's end is a message); while a forward runs (its end
# is a message). A message ends any of them at once.
IDLE_WAIT_S = 0.5
BLOCKED_WAIT_S = 0.002
FORWARD_WAIT_S = 0.5
log = logging.getLogger("pdctl.serve")
Forward = Callable[[Sequence[Piece]], torch.Tensor | None]


class PDHooks(Protocol):
    """What the PD roles plug into the engine (called on the scheduler thread; what
    `arm` returns runs on the thread that enqueued the forward, right after it)."""

    def arm(self, request: Request) -> Callable[[], None] | None:
        """Prefill: the next forward computes the prompt's last piece. A function
        returned here runs right after that forward is enqueued, on the same thread
        and stream (it launches the KV writes, which queue behind the forward); it
        catches its own errors."""

    def forwarded(self, request: Request) -> None:
        """Prefill: the forward computing the prompt's last piece is enqueued on the
        device, not yet done (the first token is chosen next); writes of its KV may
        queue behind it."""

    def prefilled(self, request: Request, choice: TokenChoice) -> None:
        """Prefill: the prompt is computed and its first token chosen; start sending."""

    def admitted(self, request: Request) -> None:
        """Decode: pages are reserved; start receiving the KV."""

    def aborted(self, request: Request) -> None:
        """The request was aborted while its KV was moving."""

    def fence(self, request: Request) -> None:
        """The request ended while its KV may still be moving (aborted, or its receive
        failed): its pages stay held (`Scheduler.fence`). Call `Engine.unfence(room)`
        once no writer or reader of them can touch them any more."""


@dataclass
class Stats:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    forwards: int = 0


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        forward: Forward,
        tokenizer: Tokenizer,
        *,
        overlap: bool = False,
        hooks: PDHooks | None = None,
    ) -> None:
        self.hooks = hooks
        self.scheduler = scheduler
        self.forward = forward
        self.tokenizer = tokenizer
        self.overlap = overlap
        self.stats = Stats()
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._worker = (
            ThreadPoolExecutor(1, thread_name_prefix="pdctl-forward") if overlap else None
        )
        self.failed: str | None = None
        self.thread = threading.Thread(target=self._loop, name="pdctl-scheduler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # -- called from other threads ---------------------------------------------------
    def submit(self, request: Request) -> None:
        self._inbox.put(("submit", request))
        if self.failed is not None:  # no loop may take it now; a second answer is ignored
            self._refuse(request)

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def unfence(self, room: int) -> None:
        """`room`'s fenced pages may go back (any thread; after the fence, always: the
        scheduler thread fenced them before the hooks heard of it)."""
        self._inbox.put(("unfence", room))

    def call(self, function: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run `function` on the scheduler thread (between forwards) and return its result."""
        future: Future[Any] = Future()
        self._inbox.put(("call", (function, future)))
        return future.result(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self.thread.join(timeout=10)
        if self._worker is not None:
            self._worker.shutdown(wait=False)

    def fail(self, message: str) -> None:
        """The engine cannot compute any more (a TP rank died): answer every request in
        it now with `message` (any thread; sinks are thread-safe), refuse new ones and
        end the loop. The first failure recorded is the one reported."""
        if self.failed is None:
            self.failed = message
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self._refuse(request)
        self._stop.set()
        self._inbox.put(("wake", None))

    def _refuse(self, request: Request) -> None:
        request.sink(Event(request.rid, error=f"engine failed: {self.failed}"))

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.failed is None

    # -- scheduler thread ---------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self.scheduler.running and not self.scheduler.waiting
                self._drain(IDLE_WAIT_S if idle else None)
                if self._stop.is_set():
                    break
                self._step()
        except Exception as exc:  # the engine is dead: fail everything, report unhealthy
            log.exception("scheduler thread failed")
            self.fail(f"{type(exc).__name__}: {exc}")

    def _drain(self, wait_s: float | None) -> None:
        """Handle every message in the inbox; with `wait_s`, wait up to that long for the
        first (a message ends the wait at once: a submit, a transfer's end, the forward's)."""
        try:
            item = self._inbox.get(timeout=wait_s) if wait_s else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "submit":
            self._accept(payload)
        elif kind == "abort":
            self._abort(payload)
        elif kind == "transferred":
            self._transferred(*payload)
        elif kind == "unfence":
            self.scheduler.unfence(payload)
        elif kind == "forwarded":  # only wakes the wait in `_step`
            pass
        elif kind == "call":
            function, future = payload
            try:
                future.set_result(function())
            except Exception as exc:
                future.set_exception(exc)

    def _accept(self, request: Request) -> None:
        faults().request_arrived()  # fault injection (kill-role); off unless asked for
        if self.failed is not None:
            self._refuse(request)
            return
        problem = self.scheduler.admission_problem(request)
        if problem:
            request.sink(Event(request.rid, error=problem))
            return
        if request.params.max_new_tokens == 0:  # nothing to generate
            request.sink(Event(request.rid, finish_reason={"type": "length", "length": 0}))
            return
        if request.params.temperature > 0:
            request.generator = generator_for(request.params, request.rid)
        self.stats.requests += 1
        self.stats.prompt_tokens += request.prompt_len
        self.scheduler.add(request)

    def transferred(
        self,
        rid: str,
        error: str | None,
        transfer: KVTransfer,
        first: TokenChoice | None = None,
    ) -> None:
        """A PD transfer finished (any thread): KV arrived on every decode rank (with the
        first token prefill chose), or left prefill."""
        self._inbox.put(("transferred", (rid, error, transfer, first)))

    def _abort(self, rid: str) -> None:
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            if request.rid == rid and request.phase is not Phase.DONE:
                moving = request.phase in (Phase.TRANSFER, Phase.SENDING)
                if moving and self.hooks is not None:
                    self.hooks.aborted(request)
                request.aborted = True
                self._finish(request, {"type": "abort"}, cache=False, fence=moving)
                if request in self.scheduler.waiting:
                    self.scheduler.waiting.remove(request)

    def _step(self) -> None:
        batch = self.scheduler.next_batch()
        admitted, self.scheduler.admitted_transfers = self.scheduler.admitted_transfers, []
        for request in admitted:
            assert self.hooks is not None
            self.hooks.admitted(request)
        if not batch:
            if self.scheduler.waiting or self.scheduler.running:
                self._drain(BLOCKED_WAIT_S)  # waiting on pages, or on KV transfers
            return
        pieces = [piece for _, piece in batch]
        run = self._forward_for(batch)
        if self._worker is not None:
            pending = self._worker.submit(run, pieces)
            # overlap: take in new work while the model runs, woken by each message and by
            # the forward's end. A poll every 0.5 ms took the GIL from the forward's thread
            # between its kernels: a CPU decode step of the tiny model took 7.3-10.6 ms
            # with it, 6.3-8.8 ms without (in process, TP 1, six runs each)
            pending.add_done_callback(lambda _: self._inbox.put(("forwarded", None)))
            while not pending.done():
                self._drain(FORWARD_WAIT_S)
            logits = pending.result()
        else:
            logits = run(pieces)
        self.stats.forwards += 1
        if self.hooks is not None:
            self._forwarded(batch)
        self._commit(batch, logits)

    def _forward_for(self, batch: list[tuple[Request, Piece]]) -> Forward:
        """The forward, followed on its own thread by what the hooks armed for the PD
        prompts whose last piece it computes (their KV writes then queue on the device
        right behind it, whatever the scheduler thread is doing)."""
        if self.hooks is None:
            return self.forward
        hooks = self.hooks
        fires = [fire for request in _last_pieces(batch) if (fire := hooks.arm(request))]
        if not fires:
            return self.forward

        def run(pieces: Sequence[Piece]) -> torch.Tensor | None:
            logits = self.forward(pieces)
            for fire in fires:
                fire()
            return logits

        return run

    def _forwarded(self, batch: list[tuple[Request, Piece]]) -> None:
        """Tell the hooks of every PD prompt whose last piece that forward computes."""
        assert self.hooks is not None
        for request in _last_pieces(batch):
            self.hooks.forwarded(request)

    def _commit(self, batch: list[tuple[Request, Piece]], logits: torch.Tensor | None) -> None:
        row = 0
        for request, piece in batch:
            was_prefill = request.phase is Phase.PREFILL
            request.computed = piece.start + piece.tokens.numel()
            if request.phase is Phase.PREFILL and request.computed == request.prompt_len:
                request.phase = Phase.DECODE
                self.stats.cached_tokens += request.cached_tokens
            if not piece.want_logits:
                continue
            assert logits is not None
            row_logits = logits[row]
            row += 1
            if request.phase is Phase.DONE:  # aborted while the forward ran
                continue
            if was_prefill and faults():  # fault injection (perturb-prefix-hit); off by default
                row_logits = faults().perturbed_logits(row_logits, request.cached_tokens)
            top = request.top_logprobs_num if request.return_logprob else 0
            picked = choose(row_logits, request.params, request.generator, top)
            if was_prefill and request.room is not None and self.hooks is not None:
                request.phase = Phase.SENDING  # prefill role: the KV goes to decode now
                request.choices.append(picked)
                self.hooks.prefilled(request, picked)
                continue
            self._emit(request, picked)

    def _emit(self, request: Request, picked: Any) -> None:
        if request.first_token_at is None:
            request.first_token_at = time.monotonic()
        request.output_ids.append(picked.token)
        request.choices.append(picked)
        self.stats.generated_tokens += 1
        reason = self._finish_reason(request)
        request.sink(Event(request.rid, token=picked.token, choice=picked))
        if reason is not None:
            self._finish(request, reason)

    def _finish_reason(self, request: Request) -> FinishReason | None:
        params = request.params
        token = request.output_ids[-1]
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            return {"type": "stop", "matched": token}
        if token in params.stop_token_ids:
            return {"type": "stop", "matched": token}
        if params.stop:
            text = self.tokenizer.decode(request.output_ids)
            for stop in params.stop:
                if stop and stop in text:
                    return {"type": "stop", "matched": stop}
        if len(request.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        return None

    def _transferred(
        self, rid: str, error: str | None, transfer: KVTransfer, first: TokenChoice | None
    ) -> None:
        request = next((r for r in self.scheduler.running if r.rid == rid), None)
        if request is None or request.phase is Phase.DONE:
            return  # aborted meanwhile
        request.kv_transfer = transfer
        if error is not None:  # decode: prefill may still write the pages (its ranks sent)
            self._end(request, cache=False, fence=request.phase is Phase.TRANSFER)
            request.sink(Event(request.rid, error=error))
            return
        if request.phase is Phase.SENDING:  # prefill: done once every rank sent
            picked = request.choices.pop()
            request.sink(Event(request.rid, token=picked.token, choice=picked))
            request.output_ids.append(picked.token)
            self._finish(request, {"type": "kv_sent"})
            return
        request.computed = request.prompt_len  # decode: every rank has the prompt's KV
        assert first is not None, "decode's transfer carries prefill's first token"
        request.cached_tokens = transfer.cached_tokens or 0
        request.phase = Phase.DECODE
        self._emit(request, first)

    def _finish(
        self, request: Request, reason: FinishReason, cache: bool = True, fence: bool = False
    ) -> None:
        self._end(request, cache, fence)
        if reason["type"] == "abort":
            self.stats.aborted += 1
        else:
            self.stats.finished += 1
        request.sink(Event(request.rid, finish_reason=reason))

    def _end(self, request: Request, cache: bool, fence: bool) -> None:
        """The request is done: its pages go back, or are fenced while its KV may still
        be moving (the hooks then unfence them once nothing can touch them)."""
        request.phase = Phase.DONE
        if fence and self.hooks is not None:
            self.scheduler.fence(request)
            self.hooks.fence(request)
        else:
            self.scheduler.release(request, cache=cache)


def _last_pieces(batch: list[tuple[Request, Piece]]) -> list[Request]:
    """The PD prompts (a room, still prefilling) whose last piece is in `batch`."""
    return [
        request
        for request, piece in batch
        if piece.start + piece.tokens.numel() == request.prompt_len
        and request.room is not None
        and request.phase is Phase.PREFILL
    ]
