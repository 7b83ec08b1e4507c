"""What this machine can run: devices, Triton, and each transport, probed for real.

The report backs `pdctl doctor` and the requirement checks of the nightly: a
capability is listed only when a probe showed it (an importable module, a plugin
NIXL lists, a Transfer Engine that ran TENT when asked), never because a variable
asks for it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypedDict, TypeVar

import torch

from pdctl.staging import device as dev

if TYPE_CHECKING:  # the transports are imported when probed
    from pdctl.staging.transport.mooncake import EngineProbe

DEVICE_TYPES = ("cuda", "xpu", "npu", "hpu", "musa", "mlu", "mps")


class TritonReport(TypedDict, total=False):
    importable: bool
    version: str
    error: str


class TransportReport(TypedDict, total=False):
    """What every transport's probe says (a probe that failed says only this)."""

    importable: bool
    error: str


class TcpReport(TransportReport, total=False):
    version: str
    protocols: list[str]
    memory_types: list[str]
    device_ipc: dict[str, str | None]  # device type -> its same-host IPC
    same_host_direct: bool
    detail: str
    doorbells: bool  # same-host direct rooms told without a message
    doorbells_detail: str


class MooncakeReport(TransportReport, total=False):
    version: str | None
    fix: str
    protocols: list[str]
    rdma_devices: list[str]
    memory_types: list[str]
    tent_built: bool  # symbols only: a hint, never the verdict
    tent_engine: EngineProbe
    tent_available: bool
    tent_requested: bool
    tent_engaged: bool
    warning: str


class NixlReport(TransportReport, total=False):
    version: str | None
    plugins: list[str]
    usable_plugins: list[str]
    memory_types: dict[str, list[str]]  # plugin -> its memory types


class CpuStagingReport(TypedDict):
    native: bool
    detail: str


class TransportsReport(TypedDict):
    tcp: TcpReport
    mooncake: MooncakeReport
    nixl: NixlReport


Probed = TypeVar("Probed", TcpReport, MooncakeReport, NixlReport)


class MachineReport(TypedDict):
    """What `report` found on this machine, as `pdctl doctor --json` gives it."""

    python: str
    platform: str
    torch: str
    triton: TritonReport
    devices: dict[str, int]
    device_memory_free_gb: dict[str, list[float]]
    transports: TransportsReport
    modules: dict[str, bool]  # module -> installed
    cpu_staging: CpuStagingReport


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@contextlib.contextmanager
def quiet_fds() -> Iterator[None]:
    """Silence a library while it is probed: NIXL logs to stdout, which --json owns."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def devices() -> dict[str, int]:
    found = {"cpu": os.cpu_count() or 1}
    for device_type in DEVICE_TYPES:
        try:
            count = int(dev.get_device_module(device_type).device_count())
        except (RuntimeError, AttributeError, AssertionError, ImportError):
            continue
        if count:
            found[device_type] = count
    return found


def device_memory() -> dict[str, list[float]]:
    """Free memory (GiB) of each accelerator, where the device module can tell."""
    found: dict[str, list[float]] = {}
    for device_type in DEVICE_TYPES:
        try:
            module = dev.get_device_module(device_type)
            count = int(module.device_count())
            found[device_type] = [
                round(module.mem_get_info(index)[0] / (1 << 30), 2) for index in range(count)
            ]
        except (RuntimeError, AttributeError, AssertionError, ImportError, TypeError):
            continue
    return {k: v for k, v in found.items() if v}


def _triton() -> TritonReport:
    try:
        triton = importlib.import_module("triton")
    except ImportError as exc:
        return {"importable": False, "error": str(exc)}
    return {"importable": True, "version": getattr(triton, "__version__", "?")}


def _tcp() -> TcpReport:
    from pdctl.staging import doorbell
    from pdctl.staging.transport import device_ipc, fastpath

    ok, reason = fastpath.probe()
    bells, bells_how = doorbell.probe()
    found = devices()
    ipc = {kind: device_ipc.mechanism(kind) for kind in DEVICE_TYPES if found.get(kind)}
    same_host = [f"{kind} over {name}" for kind, name in ipc.items() if name]
    staged = [kind for kind, name in ipc.items() if not name]
    vram = (
        "VRAM ("
        + "; ".join(
            ([f"same host: {', '.join(same_host)}"] if same_host else [])
            + [f"{', '.join(staged) or 'other devices'}: staged through host"]
        )
        + ")"
    )
    return {
        "importable": True,
        "version": "builtin",
        "protocols": ["tcp"],
        "memory_types": ["DRAM", vram],
        "device_ipc": ipc,
        "same_host_direct": ok,
        "detail": reason,
        "doorbells": bells,  # same-host direct rooms told without a message
        "doorbells_detail": bells_how,
    }


def _rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


_MOONCAKE_DISTRIBUTIONS = (
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine-cuda13",
)


def _mooncake() -> MooncakeReport:
    from pdctl.staging.transport import mooncake

    info: MooncakeReport = {"version": _version(*_MOONCAKE_DISTRIBUTIONS)}
    try:
        engine = importlib.import_module("mooncake.engine")
    except ImportError as exc:
        info["importable"], info["error"] = False, str(exc)
        if "libibverbs" in str(exc):
            info["fix"] = "apt-get install libibverbs1 (Mooncake links it even for TCP)"
        return info
    rdma = _rdma_devices()
    info["importable"] = True
    info["protocols"] = ["tcp"] + (["rdma"] if rdma else [])
    info["rdma_devices"] = rdma
    info["memory_types"] = ["DRAM"] + (["VRAM"] if getattr(engine, "SUPPORT_CUDA", False) else [])
    info["tent_built"] = mooncake.tent_built()
    asked = mooncake.tent_requested()
    # what the engine runs when asked for TENT: this environment's variable, else MC_USE_TENT=1
    probe = mooncake.probe_engine(dict(os.environ) if asked else {**os.environ, "MC_USE_TENT": "1"})
    info["tent_engine"] = probe
    info["tent_available"] = probe["implementation"] == "tent"
    info["tent_requested"] = asked is not None
    info["tent_engaged"] = asked is not None and probe["implementation"] == "tent"
    if asked is not None and not info["tent_engaged"]:
        info["warning"] = (
            f"{asked} is set, but the Transfer Engine ran its {probe['implementation']} "
            f"implementation ({probe['evidence']}): TENT is not engaged"
        )
    return info


def _nixl() -> NixlReport:
    from pdctl.staging.transport import nixl

    info: NixlReport = {"version": _version("nixl", "nixl-cu12", "nixl-cu13")}
    try:
        with quiet_fds():
            api = nixl.import_nixl()
            agent = api.nixl_agent("pdctl-doctor", api.nixl_agent_config(backends=[]))
            plugins = list(agent.get_plugin_list())
            memory = {
                p: list(agent.get_plugin_mem_types(p)) for p in ("UCX", "LIBFABRIC") if p in plugins
            }
    except Exception as exc:  # import errors and NIXL's own exceptions alike
        info["importable"], info["error"] = False, str(exc)
        return info
    info["importable"], info["plugins"] = True, plugins
    info["usable_plugins"] = sorted(plugin for plugin, types in memory.items() if types)
    info["memory_types"] = memory
    return info


def _installed(module: str) -> bool:
    """Found on the import path, as the launcher's requirement check asks it; not imported
    (importing SGLang takes seconds of its own, and its servers do that themselves)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing or broken
        return False


def report() -> MachineReport:
    modules = {module: _installed(module) for module in ("sglang", "sglang_router")}
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": _triton(),
        "devices": devices(),
        "device_memory_free_gb": device_memory(),
        "transports": {
            "tcp": _probed(_tcp),
            "mooncake": _probed(_mooncake),
            "nixl": _probed(_nixl),
        },
        "modules": modules,
        "cpu_staging": _cpu_staging(),
    }


def _probed(probe: Callable[[], Probed]) -> Probed:
    """What `probe` found; a probe must never take the report down."""
    try:
        return probe()
    except Exception as exc:
        failed: Probed = {"importable": False, "error": f"probe failed: {exc}"}
        return failed


def _cpu_staging() -> CpuStagingReport:
    """How the torch backend copies CPU staging rows: the C copy, or torch's index ops."""
    from pdctl.staging.kernels import native

    ok, why = native.available()
    return {
        "native": ok,
        "detail": why if not ok else f"C row copy, {why} ({native.library_dir()})",
    }


def capabilities(data: MachineReport) -> set[str]:
    """The capability names topologies can require (see topology `requires`)."""
    found: set[str] = set()
    if data["triton"].get("importable"):
        found.add("triton")
    mooncake = data["transports"]["mooncake"]
    if mooncake.get("tent_available"):  # observed: the engine ran TENT when asked
        found.add("mooncake.tent")
    if "rdma" in mooncake.get("protocols", []):
        found.add("mooncake.rdma")
    for plugin in data["transports"]["nixl"].get("usable_plugins", []):
        found.add(f"nixl.{plugin.lower()}")
    return found
