"""Whether this machine can run a topology, checked before anything is spawned.

A topology this machine cannot run is skipped with the reason (exit code 4), never
started to fail: `engine: sglang` without SGLang, a CUDA topology without enough
GPUs or free memory, a NIXL topology without NIXL or its UCX plugin, Mooncake with
MC_USE_TENT=1 on a build without TENT, `engine: vllm` whose interpreter has no vLLM
or on fewer cores than server ranks. Modules are looked up without importing
them; devices, free memory and capabilities come from `pdctl doctor --json`, run
in a subprocess (once, and only when a topology needs them), so the CLI itself
never imports torch. A topology that needs CUDA devices and no capability asks
`nvidia-smi` instead where it is installed (a fraction of a second; doctor imports
torch and probes every transport, seconds on a slow host before anything starts).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from typing import TypedDict

from pdctl.launch.engine_env import ALIASES as MODULE_ALIASES
from pdctl.launch.engine_env import probe
from pdctl.topology.resolve import Requirements, available_cores


class Machine(TypedDict, total=False):
    """The part of `pdctl doctor --json` a topology's requirements are checked against
    (`nvidia-smi` answers the first two where it can)."""

    devices: dict[str, int]  # device type -> how many are visible
    device_memory_free_gb: dict[str, list[float]]  # device type -> free GiB of each
    capabilities: list[str]
    error: str  # doctor itself failed


def module_available(name: str) -> bool:
    for candidate in MODULE_ALIASES.get(name, (name,)):
        try:
            if importlib.util.find_spec(candidate) is not None:
                return True
        except (ImportError, ValueError):  # a parent package is missing or broken
            continue
    return False


@lru_cache(maxsize=1)
def machine() -> Machine:
    """What `pdctl doctor --json` finds: devices, free memory, capabilities."""
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pdctl", "doctor", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        data: Machine = json.loads(result.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return {
            "devices": {},
            "device_memory_free_gb": {},
            "capabilities": [],
            "error": f"pdctl doctor failed: {exc}",
        }
    return data


def cuda_devices(visible: str | None = None) -> Machine | None:
    """CUDA device count and free memory from `nvidia-smi`, as doctor reports them (the
    devices CUDA_VISIBLE_DEVICES shows, in its order); None where nvidia-smi is missing,
    fails, or the mask names devices by UUID (doctor then answers)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        result = subprocess.run(
            [tool, "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        free: dict[int, float] = {}
        for line in result.stdout.strip().splitlines():
            number, mib = (part.strip() for part in line.split(","))
            free[int(number)] = round(float(mib) / 1024, 2)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    mask = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if mask is not None:
        try:
            order = [int(part) for part in mask.split(",") if part.strip()]
        except ValueError:  # UUIDs or MIG names: leave them to CUDA itself
            return None
        shown = []
        for index in order:
            if index not in free:
                break  # CUDA stops at the first device it cannot find
            shown.append(free[index])
    else:
        shown = [free[index] for index in sorted(free)]
    if not shown:
        return None  # let doctor say what CUDA itself sees
    return {"devices": {"cuda": len(shown)}, "device_memory_free_gb": {"cuda": shown}}


def engine_problems(requirements: Requirements) -> list[str]:
    """The engine's modules as its own interpreter finds them, and this machine's cores."""
    problems = []
    if requirements.python is not None and requirements.engine_modules:
        found = probe(requirements.python, requirements.engine_modules)
        if found.error is not None:
            problems.append(f"the engine's interpreter: {found.error} (set engine_python)")
        for module in requirements.engine_modules if found.error is None else ():
            if not found.modules.get(module):
                why = requirements.reasons.get(module)
                problems.append(
                    f"needs the Python module {module} in the engine's environment "
                    f"({requirements.python})" + (f" ({why})" if why else "")
                )
    cores = len(available_cores())
    if requirements.cpu_cores > cores:
        problems.append(
            f"needs {requirements.cpu_cores} CPU cores (a core of its own for every server "
            f"rank), this machine lets pdctl use {cores}"
        )
    return problems


def unmet(requirements: Requirements) -> list[str]:
    """What this machine lacks, each with the topology's reason for needing it."""
    problems = engine_problems(requirements)
    for module in requirements.modules:
        if not module_available(module):
            why = requirements.reasons.get(module)
            problems.append(f"needs the Python module {module}" + (f" ({why})" if why else ""))
    kind, count = requirements.device_type, requirements.device_count
    needs_probe = (kind != "cpu" and count) or requirements.capabilities
    if not needs_probe:
        return problems
    quick = cuda_devices() if kind == "cuda" and not requirements.capabilities else None
    found = quick if quick is not None else machine()
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
