"""The direct Triton launcher: cache keys, reuse and the fallback, on fakes."""

from __future__ import annotations

import torch

from pdctl.staging.kernels.launch import DirectLauncher
from pdctl.staging.kernels.triton import CONSTEXPRS as NAMES


class FakeCompiled:
    def __init__(self, log: list[tuple[str, int]], number: int, fail: bool = False) -> None:
        self.log, self.number, self.fail = log, number, fail

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        def runner(*args):  # type: ignore[no-untyped-def]
            if self.fail:
                raise TypeError("function takes exactly 9 arguments (17 given)")
            self.log.append(("direct", self.number))

        return runner


class FakeKernel:
    """Stands in for a JITFunction: `kernel[grid](...)` compiles (counted) and launches."""

    def __init__(self, fail_direct: bool = False) -> None:
        self.log: list[tuple[str, int]] = []
        self.compiles = 0
        self.fail_direct = fail_direct

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.compiles += 1
            self.log.append(("jit", self.compiles))
            return FakeCompiled(self.log, self.compiles, self.fail_direct)

        return run


CONSTEXPRS = (128, 16, 128, 1, 2, True, True, True)


def launch(
    launcher: DirectLauncher, staging: torch.Tensor, ints: tuple[int, ...] = (64, 2, 1, 1, 256, 0)
) -> None:
    table = torch.zeros(2, dtype=torch.int64)
    pages = torch.zeros(4, dtype=torch.int64)
    launcher((1, 1, 1), (table, pages, staging), ints, CONSTEXPRS, 16)


def make(kernel: FakeKernel) -> DirectLauncher:
    launcher = DirectLauncher(kernel, NAMES, current_device=lambda: 0)
    launcher.direct = True
    return launcher


def test_a_configuration_compiles_once_then_launches_directly() -> None:
    kernel = FakeKernel()
    launcher = make(kernel)
    staging = torch.zeros(64, dtype=torch.int64)
    for _ in range(3):
        launch(launcher, staging)
    assert kernel.log == [("jit", 1), ("direct", 1), ("direct", 1)]


def test_what_the_specialisation_depends_on_is_in_the_key() -> None:
    kernel = FakeKernel()
    launcher = make(kernel)
    aligned = torch.zeros(64, dtype=torch.int64)
    launch(launcher, aligned)
    launch(launcher, aligned[1:])  # 8 bytes off: another pointer alignment
    launch(launcher, aligned.view(torch.int32))  # another staging dtype
    launch(launcher, aligned, ints=(64, 2, 1, 1, 2**31, 0))  # an integer past 32 bits
    launch(launcher, aligned)
    assert kernel.compiles == 4 and kernel.log[-1] == ("direct", 1)


def test_a_compiled_kernel_that_takes_other_arguments_falls_back_for_good() -> None:
    kernel = FakeKernel(fail_direct=True)
    launcher = make(kernel)
    staging = torch.zeros(64, dtype=torch.int64)
    for _ in range(3):
        launch(launcher, staging)
    assert not launcher.direct
    assert kernel.log == [("jit", 1), ("jit", 2), ("jit", 3)]
