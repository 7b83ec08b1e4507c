"""The graphs of mapped writes (`page_write.WRITES`): a captured write's slot, which
also copies the write's sums to its own pinned host memory unless the write rings a
doorbell with them, and the capture of a write shape's ring of slots. What it does
not know: the write itself (the call captured is `page_write`'s)."""

from __future__ import annotations

from typing import Any

import torch

from pdctl.staging.kernels import PendingDigests
from pdctl.staging.kernels.captured import CudaSlot, Eager, capture_slots
from pdctl.staging.settings import StagingSettings


class WriteSlot(CudaSlot):
    """A captured write: the graph also copies the sums to this slot's pinned host
    memory, unless the write rings a doorbell with them (then decode reads them there,
    and this process needs no copy). A replay hands out digests that read it; before
    the slot is written again, the last ones it handed out are read (so a new replay
    never overwrites sums a caller has yet to see)."""

    def __init__(
        self,
        device: torch.device,
        num_ids: int,
        eager: Eager,
        pool: Any,
        sums: int,
        settings: StagingSettings,
    ) -> None:
        self.host = torch.empty(sums, dtype=torch.int64, pin_memory=True)
        self.last: PendingDigests | None = None
        super().__init__(device, num_ids, eager, pool, settings)

    def body(self, eager: Eager, device_ids: torch.Tensor) -> Any:
        pending = eager(device_ids)
        assert pending.sums is not None
        if not pending.rung:
            self.host.copy_(pending.sums, non_blocking=True)
        return pending

    def replay(self) -> PendingDigests:
        captured = super().replay()
        if captured.rung:  # told by the doorbell: the sums stay on the device (result()
            # reads them there, valid until this slot's next replay; nobody here asks)
            self.last = None
            return PendingDigests(captured.sums, captured.words, captured.num_buffers, rung=True)
        self.last = PendingDigests(
            captured.sums,
            captured.words,
            captured.num_buffers,
            host=self.host,
            copied=self.done,
        )
        return self.last

    def wait(self) -> None:
        if self.last is not None and self.last.ready is None:
            self.last.result()  # its sums, read before this slot's next replay
        super().wait()


def capture_writes(
    device: torch.device,
    num_ids: int,
    eager: Eager,
    first: PendingDigests | int,
    settings: StagingSettings,
) -> list[Any]:
    """The slots of a write shape (`first`: the sums its writes give, or an eager
    write's digests, whose sums say it)."""
    if isinstance(first, int):
        sums = first
    else:
        assert first.sums is not None
        sums = first.sums.numel()
    return capture_slots(
        device, lambda pool: WriteSlot(device, num_ids, eager, pool, sums, settings)
    )
