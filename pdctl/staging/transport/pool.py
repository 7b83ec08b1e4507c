"""Asynchronous writes for transports whose library call blocks: a worker pool.

A write runs on a worker thread; its handle waits with the caller's deadline, so
a library call stuck on a dead peer costs a worker for a while, never the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pdctl.staging.transport.base import Peer, TransferHandle


class FutureHandle(TransferHandle):
    def __init__(self, future: Future[None], peer: Peer) -> None:
        self.future, self.peer = future, peer

    def done(self) -> bool:
        if not self.future.done():
            return False
        self.future.result()  # re-raises the write's error
        return True

    def timeout_message(self, timeout: float) -> str:
        return f"write to {self.peer.label} did not complete within {timeout:g} s"


class WritePool:
    def __init__(self, name: str, workers: int = 4) -> None:
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix=f"pdctl-{name}-write")

    def submit(self, peer: Peer, work: Callable[[], None]) -> FutureHandle:
        return FutureHandle(self.executor.submit(work), peer)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
