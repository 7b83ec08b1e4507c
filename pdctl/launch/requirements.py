"""Whether this machine can run a topology, checked before anything is spawned.

A topology this machine cannot run is skipped with the reason (exit code 4), never
started to fail: `engine: sglang` without SGLang, a CUDA topology without enough
GPUs or free memory, a NIXL topology without NIXL or its UCX plugin, Mooncake with
MC_USE_TENT=1 on a build without TENT. Modules are looked up without importing
them; devices, free memory and capabilities come from `pdctl doctor --json`, run
in a subprocess (once, and only when a topology needs them), so the CLI itself
never imports torch.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from functools import lru_cache
from typing import Any

from pdctl.topology.resolve import Requirements

# A required module -> the import names that provide it (NIXL ships per CUDA major).
MODULE_ALIASES: dict[str, tuple[str, ...]] = {
    "nixl": ("nixl", "nixl_cu12", "nixl_cu13"),
}


def module_available(name: str) -> bool:
    for candidate in MODULE_ALIASES.get(name, (name,)):
        try:
            if importlib.util.find_spec(candidate) is not None:
                return True
        except (ImportError, ValueError):  # a parent package is missing or broken
            continue
    return False


@lru_cache(maxsize=1)
def machine() -> dict[str, Any]:
    """What `pdctl doctor --json` finds: devices, free memory, capabilities."""
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pdctl", "doctor", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        data: dict[str, Any] = json.loads(result.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return {
            "devices": {},
            "device_memory_free_gb": {},
            "capabilities": [],
            "error": f"pdctl doctor failed: {exc}",
        }
    return data


def unmet(requirements: Requirements) -> list[str]:
    """What this machine lacks, each with the topology's reason for needing it."""
    problems = []
    for module in requirements.modules:
        if not module_available(module):
            why = requirements.reasons.get(module)
            problems.append(f"needs the Python module {module}" + (f" ({why})" if why else ""))
    kind, count = requirements.device_type, requirements.device_count
    needs_probe = (kind != "cpu" and count) or requirements.capabilities
    if not needs_probe:
        return problems
    found = machine()
    if kind != "cpu" and count:
        have = int(found.get("devices", {}).get(kind, 0))
        if have < count:
            problems.append(f"needs {count} {kind} device(s), this machine has {have}")
        elif requirements.min_free_memory_gb:
            free = found.get("device_memory_free_gb", {}).get(kind, [])[:count]
            short = [
                f"{kind}:{i} {gb:g} GiB"
                for i, gb in enumerate(free)
                if gb < requirements.min_free_memory_gb
            ]
            if short or len(free) < count:
                problems.append(
                    f"needs {requirements.min_free_memory_gb:g} GiB free on each of {count} "
                    f"{kind} device(s); free: {', '.join(short) or 'unknown'}"
                )
    have_caps = set(found.get("capabilities", []))
    for capability in requirements.capabilities:
        if capability not in have_caps:
            why = requirements.reasons.get(capability)
            problems.append(
                f"needs capability {capability}"
                + (f" ({why})" if why else "")
                + " (`pdctl doctor` lists what this machine has)"
            )
    return problems
