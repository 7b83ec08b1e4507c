"""An engine that cannot compute any more (a TP rank died) answers every request in it
with the cause at once, from whichever thread learns of it, and refuses new ones: its
server's shutdown then cancels nothing (a cancelled handler answers a bare 500)."""

from __future__ import annotations

import threading

import torch

from pdctl.serve.engine.kv_pool import KVPool, ReqToToken
from pdctl.serve.engine.loop import Engine
from pdctl.serve.engine.radix import RadixCache
from pdctl.serve.engine.request import Event, Request
from pdctl.serve.engine.sampling import SamplingParams
from pdctl.serve.engine.scheduler import Budget, Scheduler
from pdctl.serve.tokenizer import ByteTokenizer

CAUSE = "decode-1 rank 1 (pid 4242) ended with signal 9"


def test_a_failed_engine_answers_every_request_with_the_cause() -> None:
    kv = KVPool(2, 1024, 2, 16, 16, torch.float32, torch.device("cpu"))
    scheduler = Scheduler(kv, ReqToToken(8, 256), RadixCache(kv.pages, 16), Budget(8, 256))
    entered, release = threading.Event(), threading.Event()

    def forward(*_: object) -> None:  # stuck, as a collective with a dead rank is
        entered.set()
        release.wait(30)
        raise RuntimeError("Connection closed by peer")

    engine = Engine(scheduler, forward, ByteTokenizer(512))  # type: ignore[arg-type]
    events: dict[str, list[Event]] = {}
    answered = {rid: threading.Event() for rid in ("a", "b", "late")}

    def submit(rid: str) -> None:
        def sink(event: Event) -> None:
            events.setdefault(rid, []).append(event)
            if event.error is not None or event.finish_reason is not None:
                answered[rid].set()

        params = SamplingParams(temperature=0, max_new_tokens=4)
        engine.submit(Request(rid, [5, 6, 7, 8], params, sink))

    engine.start()
    try:
        submit("a")
        submit("b")
        assert entered.wait(30)
        threading.Thread(target=engine.fail, args=(CAUSE,)).start()
        for rid in ("a", "b"):
            assert answered[rid].wait(10), rid
            assert events[rid][-1].error == f"engine failed: {CAUSE}"
        assert engine.failed == CAUSE and not engine.alive
        release.set()  # the stuck step now fails too; the first cause is the one kept
        engine.thread.join(10)
        assert engine.failed == CAUSE
        submit("late")  # nothing serves it now; it is answered, not left waiting
        assert answered["late"].wait(10)
        assert events["late"][0].error == f"engine failed: {CAUSE}"
    finally:
        release.set()
        engine.stop()
