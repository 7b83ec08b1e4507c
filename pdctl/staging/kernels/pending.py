"""Page digests under way on the device: the sums a launch left there, read back (and
turned into digests) once, by whoever asks first. Made by the checked page digests
(`kernels.start_slice_digests`) and the mapped write (`kernels.page_write`); what it
does not know: the launches that made the sums."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdctl.staging import device as dev
from pdctl.staging.digest import digests_of_sums


@dataclass
class PendingDigests:
    """Page digests under way on the device (`start_slice_digests`, the mapped write);
    `result()` waits."""

    sums: torch.Tensor | None  # [segments * buffers] int64 weighted sums, on the device
    words: list[int]  # per segment: words per chunk
    num_buffers: int
    ready: list[list[int]] | None = None
    host: torch.Tensor | None = None  # the sums in pinned host memory (`stage_to_host`)
    copied: Any = None  # a device event recorded after the copy to `host`
    rung: bool = False  # the launch also rang a doorbell with the sums (`kernels.bell`)

    def stage_to_host(self) -> None:
        """Queue the sums' copy to pinned host memory behind the kernel (CUDA only), so
        that `result()` after the stream passed it reads host memory, not the device."""
        if self.sums is None or self.host is not None or self.sums.device.type != "cuda":
            return
        self.host = torch.empty(self.sums.shape, dtype=self.sums.dtype, pin_memory=True)
        self.host.copy_(self.sums, non_blocking=True)
        self.copied = dev.create_device_event(self.sums.device)
        self.copied.record(dev.current_device_stream(self.sums.device))

    def result(self) -> list[list[int]]:
        """Per segment, the digests [L0.K, L0.V, L1.K, ...] (one host synchronisation)."""
        if self.ready is None:
            assert self.sums is not None
            if self.host is not None and self.copied is not None:
                self.copied.synchronize()
                sums = self.host.numpy()
            else:
                sums = self.sums.cpu().numpy()
            width = self.num_buffers
            lengths = np.repeat(np.asarray(self.words, dtype=np.uint64), width)
            flat = digests_of_sums(sums[: len(lengths)], lengths)
            self.ready = [flat[i * width : (i + 1) * width] for i in range(len(self.words))]
        return self.ready
