"""Freed host memory stays with a CPU server for reuse (`runtime.retain_host_memory`)."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import pytest

# A forward's temporaries: megabytes each, allocated and freed every step.
SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    if sys.argv[1] == "kept":
        from pdctl.serve.runtime import retain_host_memory
        assert retain_host_memory()
    torch.set_num_threads(1)
    def step():  # temporaries of several sizes alive together, then all freed
        held = [torch.ones(n << 18) for n in (1, 3, 8, 20, 40)]  # 1 to 40 MiB
        return sum(float(t[-1]) for t in held)
    for _ in range(3):  # warm: the heap grows to what a step needs
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_kept_memory_is_reused_without_page_faults() -> None:
    # 20 steps of 72 MiB of temporaries: 18,000 pages a step where mapped afresh
    default, kept = faults("default"), faults("kept")
    pages = 20 * (72 << 20) // resource.getpagesize()
    assert default > pages // 4, f"the default allocator faulted only {default} of {pages} pages"
    assert kept < pages // 100, f"{kept} page faults with the memory kept ({default} without)"
