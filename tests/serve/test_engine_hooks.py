"""The PD hooks' order: prefill hears of a prompt's last forward before its first token
is chosen (so the KV writes can queue behind that forward on the device, their host
work overlapping it), then that the token is chosen; chunks before the last, and
requests without a room, are not announced."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from pdctl.serve.engine.kv_pool import KVPool, ReqToToken
from pdctl.serve.engine.loop import Engine
from pdctl.serve.engine.radix import RadixCache
from pdctl.serve.engine.request import Event, Request
from pdctl.serve.engine.sampling import SamplingParams, TokenChoice
from pdctl.serve.engine.scheduler import Budget, Scheduler
from pdctl.serve.model.batch import Piece
from pdctl.serve.tokenizer import ByteTokenizer

VOCAB = 512


class Recorder:
    def __init__(self, engine_box: list[Engine]) -> None:
        self.calls: list[tuple[str, str, int, int]] = []  # (hook, rid, forwards, choices)
        self.engine_box = engine_box
        self.prefilled_done = threading.Event()

    def _note(self, hook: str, request: Request) -> None:
        forwards = self.engine_box[0].stats.forwards
        self.calls.append((hook, request.rid, forwards, len(request.choices)))

    def arm(self, request: Request) -> None:
        self._note("arm", request)

    def forwarded(self, request: Request) -> None:
        self._note("forwarded", request)

    def prefilled(self, request: Request, choice: TokenChoice) -> None:
        self._note("prefilled", request)
        self.prefilled_done.set()

    def admitted(self, request: Request) -> None:
        raise AssertionError("no decode requests here")

    def aborted(self, request: Request) -> None:
        self._note("aborted", request)


def forward(pieces: Sequence[Piece]) -> torch.Tensor:
    rows = sum(1 for piece in pieces if piece.want_logits)
    logits = torch.zeros(rows, VOCAB)
    logits[:, 7] = 1.0
    return logits


def test_prefill_hears_of_the_last_forward_before_the_first_token() -> None:
    kv = KVPool(2, 1024, 2, 16, 16, torch.float32, torch.device("cpu"))
    scheduler = Scheduler(kv, ReqToToken(8, 512), RadixCache(kv.pages, 16), Budget(8, 32))
    box: list[Engine] = []
    hooks = Recorder(box)
    engine = Engine(scheduler, forward, ByteTokenizer(VOCAB), hooks=hooks)  # type: ignore[arg-type]
    box.append(engine)
    plain_done = threading.Event()

    def sink(event: Event) -> None:
        if event.finish_reason is not None or event.error is not None:
            plain_done.set()

    params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    pd = Request("pd", list(range(1, 101)), params, lambda event: None)  # 4 chunks of 32
    pd.room = 11
    engine.start()
    try:
        engine.submit(pd)
        assert hooks.prefilled_done.wait(30)
        engine.submit(Request("plain", list(range(1, 41)), params, sink))  # no room
        assert plain_done.wait(30)
    finally:
        engine.stop()
    pd_calls = [call for call in hooks.calls if call[1] == "pd"]
    assert pd_calls == [
        ("arm", "pd", 3, 0),
        ("forwarded", "pd", 4, 0),
        ("prefilled", "pd", 4, 1),
    ], hooks.calls
    assert all(call[1] == "pd" for call in hooks.calls), hooks.calls
