"""Launching a compiled Triton kernel directly, after Triton compiled it once.

`kernel[grid](...)` binds and specialises every argument on every call: tens of
microseconds of host work, as much as a device copy of tens of megabytes. The
compiled kernel that call returns can be launched again with the same arguments in
a few microseconds. `DirectLauncher` caches it under everything its specialisation
depends on here: the constexpr values and warps, every pointer's dtype and 16-byte
alignment, whether the integers fit 32 bits, and the current device. The kernel
must list every integer argument in `do_not_specialize` (Triton would otherwise
specialise on values such as 1 or multiples of 16, which the key does not hold).
Where a Triton version's compiled-kernel call takes other arguments it raises
TypeError before launching, and the launcher falls back to `kernel[grid]` for good.
Under TRITON_INTERPRET nothing is compiled: every call goes through `kernel[grid]`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton


def current_device() -> int:
    """The calling thread's current device, as Triton's launcher reads it."""
    return int(triton.runtime.driver.active.get_current_device())


class DirectLauncher:
    """`launcher(grid, pointers, ints, constexprs, warps)`: the kernel's arguments in
    order (tensors, then integers, then constexprs named by `constexpr_names`)."""

    def __init__(
        self,
        kernel: Any,
        constexpr_names: Sequence[str],
        current_device: Callable[[], int] | None = None,
    ) -> None:
        self._kernel = kernel
        self._names = tuple(constexpr_names)
        self._current_device = current_device or globals()["current_device"]
        self._compiled: dict[tuple[object, ...], Any] = {}
        self.direct = os.environ.get("TRITON_INTERPRET") != "1"

    def __call__(
        self,
        grid: tuple[int, ...],
        pointers: tuple[torch.Tensor, ...],
        ints: tuple[int, ...],
        constexprs: tuple[Any, ...],
        warps: int,
    ) -> None:
        key = self._key(pointers, ints, constexprs, warps) if self.direct else None
        compiled = self._compiled.get(key) if key is not None else None
        if compiled is not None:
            try:
                compiled[grid](*pointers, *ints, *constexprs)
                return
            except TypeError:
                self.direct = False
        kwargs = dict(zip(self._names, constexprs, strict=True))
        compiled = self._kernel[grid](*pointers, *ints, **kwargs, num_warps=warps)
        if self.direct and key is not None and hasattr(compiled, "__getitem__"):
            self._compiled[key] = compiled

    def _key(
        self,
        pointers: tuple[torch.Tensor, ...],
        ints: tuple[int, ...],
        constexprs: tuple[Any, ...],
        warps: int,
    ) -> tuple[object, ...]:
        return (
            constexprs,
            warps,
            self._current_device(),
            *(pointer.dtype for pointer in pointers),
            *(pointer.data_ptr() % 16 == 0 for pointer in pointers),
            not ints or (min(ints) >= -(2**31) and max(ints) < 2**31),
        )
