"""Same-host device memory between processes, through the device's own IPC.

Two processes on one host can share device memory without a copy through the host:
the owner exports a handle to its allocation, the peer opens it and maps the same
memory into its own address space, and a write becomes one device-to-device copy at
close to the device's copy bandwidth. The mechanism is the device's own and is
resolved from the device type: CUDA IPC on CUDA (the handles torch's own
multiprocessing shares). Other devices have no mechanism here yet, and their
transfers keep the staged path through host memory (`pdctl doctor` says which).

A handle is opened once per peer allocation and cached (several registered tensors
of one allocation, every layer of a KV pool, share one), so only the first write to
a peer pays for the mapping, at connect time. Opening fails where the peer's device
is not visible to this process (another device mask): the caller then keeps the
staged path for that peer.
"""

from __future__ import annotations

import base64
import threading
from typing import Any, TypedDict

import numpy as np
import torch

from pdctl.staging import device as dev
from pdctl.staging.transport.values import Located

MECHANISMS = {"cuda": "cuda-ipc"}  # device type -> its same-host IPC
# A write of at most FEW_RANGES ranges copies each (a launch and its table cost more
# than a few copies); more share one launch of the ranges kernel, but for ranges longer
# than one launch takes (MAX_RANGE_BYTES), which get a copy each.
FEW_RANGES = 4
MAX_RANGE_BYTES = 65535 * 16 * 1024  # kernels.ranges.MAX_RANGE_BYTES (Triton not imported)


def mechanism(device_type: str) -> str | None:
    """The IPC this device type offers between processes here, or None."""
    name = MECHANISMS.get(device_type)
    if name is None:
        return None
    try:
        available = dev.get_device_module(device_type).is_available()
    except (AttributeError, RuntimeError, AssertionError):
        return None
    return name if available else None


class IpcHandle(TypedDict):
    """A JSON handle to a tensor's bytes for a process on this host (`export`)."""

    kind: str  # the mechanism (`MECHANISMS`)
    storage: list[Any]  # the allocation's share parts as torch gives them, bytes as {"b64": ...}
    offset: int  # bytes into the allocation
    length: int


def _encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"b64"}:
        return base64.b64decode(value["b64"])
    return value


def export(tensor: torch.Tensor) -> IpcHandle | None:
    """A JSON handle to `tensor`'s bytes for a process on this host, or None."""
    kind = mechanism(tensor.device.type)
    if kind is None:
        return None
    storage = tensor.untyped_storage()
    shared = storage._share_cuda_()  # cuda-only: the handle torch.multiprocessing sends
    parts = [_encode(part) for part in shared]
    offset = int(tensor.storage_offset()) * tensor.element_size()
    length = tensor.numel() * tensor.element_size()
    return IpcHandle(kind=kind, storage=parts, offset=offset, length=length)


class Mapped:
    """The peer allocations this process opened, by handle (one mapping each)."""

    def __init__(self) -> None:
        self._storages: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def open(self, handle: IpcHandle) -> torch.Tensor:
        """The peer's region as a uint8 tensor of this process (raises on failure)."""
        if handle.get("kind") != "cuda-ipc":
            raise RuntimeError(f"no IPC for {handle.get('kind')!r} handles here")
        parts = [_decode(part) for part in handle["storage"]]
        key = repr((parts[1], parts[3]))  # the allocation's IPC handle and the storage in it
        with self._lock:
            whole = self._storages.get(key)
            if whole is None:
                storage = torch.UntypedStorage._new_shared_cuda(*parts)  # cuda-only: IPC open
                whole = torch.empty(0, dtype=torch.uint8, device=storage.device)
                whole.set_(storage, 0, (storage.nbytes(),), (1,))
                self._storages[key] = whole
        offset, length = int(handle["offset"]), int(handle["length"])
        return whole[offset : offset + length]

    def clear(self) -> None:
        with self._lock:
            self._storages.clear()


def copy_ranges(device: Any, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> None:
    """The ranges kernel (Triton, imported on the first device write)."""
    from pdctl.staging.kernels import ranges

    ranges.copy_ranges(device, src, dst, lengths)


def copy_located(
    found: Located,
    lengths: np.ndarray,
    tensors: dict[int, torch.Tensor],
    mapped: dict[int, torch.Tensor],
    shift: np.ndarray,
    device: Any,
) -> None:
    """A write's ranges into a peer's mapped regions, on the current stream: a few
    ranges one copy each, many (pages, runs of pages) in one launch. `tensors`: this
    process's registered tensors by address; `mapped`: the peer's opened allocations by
    its address; `shift`: per peer region, its address here minus the peer's."""
    mine, theirs, sources, targets = found.mine, found.theirs, found.sources, found.targets
    src, dst = found.src, found.dst
    long = lengths > np.uint64(MAX_RANGE_BYTES)  # too long for one launch
    if len(lengths) <= FEW_RANGES:
        long[:] = True  # a launch and a table upload cost more than a few copies
    for i in np.flatnonzero(long).tolist():
        region, target = mine.regions[int(sources[i])], theirs.regions[int(targets[i])]
        s, d, n = int(src[i]) - region.ptr, int(dst[i]) - target.ptr, int(lengths[i])
        mapped[target.ptr][d : d + n].copy_(tensors[region.ptr][s : s + n], non_blocking=True)
    short = ~long
    if short.any():
        local = dst[short] + shift[targets[short]]  # modulo 2**64, as addresses are
        copy_ranges(device, src[short], local, lengths[short])
