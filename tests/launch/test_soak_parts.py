"""The soak's parts on their own: the load bounds every request by its timeout, and
RSS growth at the limit (or a process gone) fails."""

from __future__ import annotations

import os
import socket
import threading
import time

from pdctl.launch import rss
from pdctl.launch.soak import prompts_for
from pdctl.launch.soak_load import Load


def test_a_request_the_server_never_answers_ends_at_its_timeout() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    done: list[int] = []
    load = Load(url, [[5, 6, 7]], [0, 0, 0], concurrency=2, new_tokens=2, timeout=1.0,
                on_done=done.append)  # fmt: skip
    started = time.monotonic()
    load.start()
    try:
        load.wait(lambda: None, interval=0.05)
    finally:
        load.close(grace=5)
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()
    assert time.monotonic() - started < 10
    assert done == [1, 2, 3]
    assert [o.output for o in load.outcomes] == [None, None, None]
    assert all(o.error is not None and "Timeout" in o.error for o in load.outcomes)


def test_stop_ends_the_load_without_sending_the_rest() -> None:
    load = Load("http://127.0.0.1:9", [[5]], [0] * 100, concurrency=1, new_tokens=1,
                timeout=1.0)  # fmt: skip
    load.stop()
    load.start()
    load.wait(lambda: None, interval=0.05)
    load.close(grace=5)
    assert load.outcomes == []


def test_growth_at_the_limit_fails_and_a_gone_process_is_named() -> None:
    warm = [rss.ProcessRss("decode-0", 11, "pdctl:t:decode:tp1", 100_000),
            rss.ProcessRss("prefill-0", 12, "pdctl:t:prefill:tp0", 100_000),
            rss.ProcessRss("router", 13, "pdctl:t:router:tp0", 100_000)]  # fmt: skip
    end = [rss.ProcessRss("decode-0", 11, "pdctl:t:decode:tp1", 103_000),
           rss.ProcessRss("prefill-0", 12, "pdctl:t:prefill:tp0", 102_900),
           rss.ProcessRss("router", 14, "pdctl:t:router:tp0", 90_000)]  # fmt: skip
    rows, problems = rss.growth(warm, end, 3.0)
    assert [(r["pid"], r["growth_pct"]) for r in rows] == [(11, 3.0), (12, 2.9)]
    assert len(problems) == 3
    assert problems[0].startswith("decode-0 pid 11 (pdctl:t:decode:tp1) grew 3.00 %")
    assert "router pid 13" in problems[1] and "gone" in problems[1]
    assert "router pid 14" in problems[2] and "appeared" in problems[2]


def test_sample_reads_every_member_of_a_group() -> None:
    found = rss.sample({"me": os.getpgid(0)})
    assert os.getpid() in {p.pid for p in found}
    assert all(p.server == "me" and p.rss_kib > 0 for p in found)


def test_prompts_stay_inside_the_vocabulary_and_context() -> None:
    prompts = prompts_for(200, seed=1, vocab=40, max_len=100)
    assert all(3 <= i < 40 for p in prompts for i in p)
    assert max(len(p) for p in prompts) == 100 and min(len(p) for p in prompts) == 3
