"""Whether this machine can run a topology: devices and modules, checked before spawning.

A topology this machine cannot run is skipped with the reason (exit code 4), never
started to fail: `engine: sglang` without SGLang, a CUDA topology without GPUs, a
NIXL topology without NIXL. Devices are counted in a subprocess so that the CLI
itself never imports torch.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from pdctl.topology.resolve import Requirements

# A required module -> the import names that provide it (NIXL ships per CUDA major).
MODULE_ALIASES: dict[str, tuple[str, ...]] = {
    "nixl": ("nixl", "nixl_cu12", "nixl_cu13"),
}

_COUNT = (
    "import torch\n"
    "kind = {kind!r}\n"
    "module = getattr(torch, kind, None)\n"
    "print(module.device_count() if module is not None and module.is_available() else 0)\n"
)


def module_available(name: str) -> bool:
    for candidate in MODULE_ALIASES.get(name, (name,)):
        try:
            if importlib.util.find_spec(candidate) is not None:
                return True
        except (ImportError, ValueError):  # a parent package is missing or broken
            continue
    return False


def device_count(kind: str) -> int:
    try:
        result = subprocess.run(
            [sys.executable, "-c", _COUNT.format(kind=kind)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return int(result.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def unmet(requirements: Requirements) -> list[str]:
    """What this machine lacks, each with the topology's reason for needing it."""
    problems = []
    if requirements.device_type != "cpu" and requirements.device_count:
        found = device_count(requirements.device_type)
        if found < requirements.device_count:
            problems.append(
                f"needs {requirements.device_count} {requirements.device_type} device(s), "
                f"this machine has {found}"
            )
    for module in requirements.modules:
        if not module_available(module):
            why = requirements.reasons.get(module)
            problems.append(f"needs the Python module {module}" + (f" ({why})" if why else ""))
    return problems
