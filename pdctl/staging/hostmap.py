"""Host memory a device may store into: a mapping of this process (a peer's shared
memory, say) registered with the device's driver, and its address on the device.

A doorbell rung from a device's launch (`kernels.bell`) stores into the receiver's
box, which this process maps from shared memory. On CUDA the mapping is pinned and
mapped into the device's address space (`cudaHostRegister`, portable and mapped; the
device address from `cuMemHostGetDevicePointer`), once per mapping. Other devices
have no such path here: their writers ring from the host.

What this does not know: what the memory holds, or who else maps it.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

log = logging.getLogger("pdctl.staging")
_PORTABLE, _MAPPED = 1, 2  # cudaHostRegister flags
_LOCK = threading.Lock()
_REGISTERED: dict[int, int | None] = {}  # host address -> its device address (None: refused)


def device_address(address: int, size: int, device: torch.device) -> int | None:
    """`size` bytes at host `address` registered with `device`'s driver (once; a refusal
    is remembered too): their address for kernels on that device, or None where the
    device cannot store there (not CUDA, or the driver refused; logged once)."""
    if device.type != "cuda":
        return None
    with _LOCK:
        if address in _REGISTERED:
            return _REGISTERED[address]
        found: int | None = None
        try:
            found = _register(address, size, device)
        except (OSError, RuntimeError, AttributeError) as exc:
            log.info("staging: host memory cannot be mapped for %s: %s", device, exc)
        _REGISTERED[address] = found
        return found


def _register(address: int, size: int, device: torch.device) -> int:
    cudart = torch.cuda.cudart()  # cuda-only: host registration is CUDA's
    with torch.cuda.device(device):  # cuda-only: the device whose address is wanted
        result = cudart.cudaHostRegister(address, size, _PORTABLE | _MAPPED)
        if int(getattr(result, "value", result)) != 0:
            raise RuntimeError(f"cudaHostRegister failed with error {result}")
        pointer = ctypes.c_uint64()
        driver = ctypes.CDLL("libcuda.so.1")
        status = driver.cuMemHostGetDevicePointer_v2(
            ctypes.byref(pointer), ctypes.c_void_p(address), ctypes.c_uint(0)
        )
        if status != 0:
            cudart.cudaHostUnregister(address)
            raise RuntimeError(f"cuMemHostGetDevicePointer failed with error {status}")
    return int(pointer.value)


def forget(address: int) -> None:
    """Forget the mapping at `address` before it is unmapped (unregistered where it was
    registered; nothing where it never was)."""
    with _LOCK:
        if _REGISTERED.pop(address, None) is None:
            return
    cudart = torch.cuda.cudart()  # cuda-only: host registration is CUDA's
    cudart.cudaHostUnregister(address)
