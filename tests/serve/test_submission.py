"""A request's reader (`api.submission.Submission.events`) aborts its request however the
reading ends early: the client gone while tokens still flow, or the response closing
the reader (a write to a closed connection failed). A request read to its end is never
aborted. Against a stand-in engine, so the timing is the test's own."""

from __future__ import annotations

import asyncio
from typing import Any

from pdctl.serve.api import submission
from pdctl.serve.api.submission import ServerContext, Submission
from pdctl.serve.engine.request import Event, Request
from pdctl.serve.engine.sampling import SamplingParams


class Engine:
    """Takes a request and lets the test deliver its events; records aborts."""

    def __init__(self) -> None:
        self.request: Request | None = None
        self.aborted: list[str] = []

    def submit(self, request: Request) -> None:
        self.request = request

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def deliver(self, **fields: Any) -> None:
        assert self.request is not None and self.request.sink is not None
        self.request.sink(Event(self.request.rid, **fields))


class Client:
    """`is_disconnected` as Starlette's request has it: False until `gone` is set."""

    def __init__(self) -> None:
        self.gone = False
        self.asked = 0

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return self.gone


def submit(engine: Engine) -> Submission:
    context = ServerContext(engine, "tiny", 512, 4096, {})  # type: ignore[arg-type]
    return Submission(context, [1, 2, 3], SamplingParams(max_new_tokens=10**6), "r1", None)


def test_a_client_gone_while_tokens_flow_aborts(monkeypatch) -> None:
    monkeypatch.setattr(submission, "DISCONNECT_CHECK_S", 0.05)

    async def scenario() -> tuple[int, Engine]:
        engine, client = Engine(), Client()
        reader = submit(engine)

        async def produce() -> None:
            for token in range(10**6):
                engine.deliver(token=token)
                if token == 20:
                    client.gone = True
                await asyncio.sleep(0.002)  # never 0.05 s without a token

        producer = asyncio.create_task(produce())
        read = 0
        async for _ in reader.events(client):  # type: ignore[arg-type]
            read += 1
        producer.cancel()
        return read, engine

    read, engine = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert engine.aborted == ["r1"]
    assert 20 <= read < 200  # stopped within a check or two of the client leaving


def test_a_reader_closed_early_aborts_and_one_read_to_the_end_does_not() -> None:
    async def scenario(close_early: bool) -> Engine:
        engine, client = Engine(), Client()
        reader = submit(engine)
        engine.deliver(token=5)
        engine.deliver(token=6, finish_reason={"type": "length"})
        events = reader.events(client)  # type: ignore[arg-type]
        first = await events.__anext__()
        assert first.token == 5
        if close_early:
            await events.aclose()  # what a response does when its write failed
        else:
            assert [e.finish_reason async for e in events] == [{"type": "length"}]
        return engine

    assert asyncio.run(scenario(close_early=True)).aborted == ["r1"]
    assert asyncio.run(scenario(close_early=False)).aborted == []
