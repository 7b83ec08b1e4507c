"""The soak's load: `count` requests, `concurrency` in flight, each bounded by a timeout.

Worker threads take the next request from a shared counter, so exactly
`concurrency` are in flight until the queue runs dry. `on_done(n)` is called by the
thread that finished the n-th request (1-based, in completion order), which is where
the soak takes its RSS samples. `stop()` (Ctrl-C, a dead server) makes the workers
take nothing new; requests in flight end by their timeout at the latest, or sooner
when the servers are stopped. Knows the /generate body and nothing of the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

ABORTED = "the server aborted the request (finish_reason abort)"


@dataclass
class Outcome:
    prompt: int  # index into the soak's distinct prompts
    output: list[int] | None  # None when the request failed
    error: str | None
    latency_s: float


def generate(
    client: httpx.Client, url: str, prompt: list[int], new_tokens: int, timeout: float
) -> tuple[list[int] | None, str | None]:
    """One greedy /generate; (output ids, None) or (None, what went wrong). An answer
    the server aborted (`finish_reason` abort) is no output: (None, ABORTED)."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
    }
    try:
        response = client.post(f"{url}/generate", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if response.status_code != 200:
        return None, f"HTTP {response.status_code}: {response.text[:300]}"
    try:
        ids = response.json()["output_ids"]
    except (ValueError, KeyError, TypeError):
        return None, f"a 200 without output_ids: {response.text[:300]}"
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        return None, f"output_ids is not a list of ints: {str(ids)[:300]}"
    if _finish_type(response.json()) == "abort":
        return None, ABORTED
    return ids, None


def _finish_type(answer: object) -> object:
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    return finish.get("type") if isinstance(finish, dict) else None


class Load:
    """Send prompts[order[i]] for every i; `outcomes` in completion order."""

    def __init__(
        self,
        url: str,
        prompts: list[list[int]],
        order: list[int],
        *,
        concurrency: int,
        new_tokens: int,
        timeout: float,
        on_done: Callable[[int], None] = lambda _: None,
    ) -> None:
        self.url, self.prompts, self.order = url, prompts, order
        self.concurrency, self.new_tokens, self.timeout = concurrency, new_tokens, timeout
        self.on_done = on_done
        self.outcomes: list[Outcome] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._finished = threading.Event()
        self._workers: list[threading.Thread] = []
        self._client: httpx.Client | None = None  # made by start()
        self.callback_error: BaseException | None = None

    def _take(self) -> int | None:
        with self._lock:
            if self._stopped.is_set() or self._next >= len(self.order):
                return None
            self._next += 1
            return self.order[self._next - 1]

    def _work(self, client: httpx.Client) -> None:
        while (index := self._take()) is not None:
            started = time.perf_counter()
            output, error = generate(
                client, self.url, self.prompts[index], self.new_tokens, self.timeout
            )
            outcome = Outcome(index, output, error, time.perf_counter() - started)
            with self._lock:
                self.outcomes.append(outcome)
                done = len(self.outcomes)
            try:
                self.on_done(done)
            except BaseException as exc:  # a failed sample must not hang the load
                self.callback_error = exc
                self.stop()
            if done == len(self.order):
                self._finished.set()

    def start(self) -> None:
        limits = httpx.Limits(max_connections=self.concurrency * 2)
        self._client = httpx.Client(limits=limits)
        for n in range(min(self.concurrency, len(self.order))):
            worker = threading.Thread(
                target=self._work, args=(self._client,), name=f"soak-{n}", daemon=True
            )
            worker.start()
            self._workers.append(worker)

    def wait(self, check: Callable[[], None], interval: float = 0.5) -> None:
        """Until every request ended (or the load stopped); `check` runs every `interval`
        (it raises to abort: a server died). Ctrl-C lands here, in the caller's thread."""
        try:
            while not self._finished.wait(interval):
                if self._stopped.is_set() and not any(w.is_alive() for w in self._workers):
                    return
                check()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self._stopped.set()

    def close(self, grace: float) -> None:
        """Stop, give the workers `grace` seconds to end, close the client.

        A worker still in a request holds its connection: closing the pool would wait
        for that answer (Ctrl-C, a dead server), so the pool is then closed on a
        daemon thread and this returns at once (the servers' teardown ends the rest).
        """
        self.stop()
        deadline = time.monotonic() + grace
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        if self._client is None:
            return
        if any(worker.is_alive() for worker in self._workers):
            threading.Thread(target=self._client.close, name="soak-close", daemon=True).start()
        else:
            self._client.close()
