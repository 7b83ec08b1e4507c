"""The environment of a vLLM server pdctl launches: its folders, its cores, offline.

Every vLLM server (the colocated reference too) runs in its own folder of the run
(`<workdir>`, filled at launch): temporary files, sockets (`VLLM_RPC_BASE_PATH`,
relative, so socket paths stay under 108 bytes), configuration and caches of its
own; compiled kernels in a cache the runs share (launcher.run_dir/cache/vllm). On
cpu each server rank gets cores of its own (`resolve.cpu_placement`). What the
topology's env sets wins over every default here.
"""

from __future__ import annotations

from pathlib import Path

from pdctl.engines.command import WORKDIR
from pdctl.topology.model import Topology
from pdctl.topology.resolve import EnvEntry, available_cores, cpu_placement, merged_user_env

CPU_KV_CACHE_GIB = "1"  # vLLM's CPU KV cache, in GiB: 3.3 GB a server with it on 2-core CI


def runs_folder(topology: Topology) -> Path:
    """launcher.run_dir, relative to the working directory as the runs are."""
    base = Path(topology.launcher.run_dir)
    return base if base.is_absolute() else Path.cwd() / base


def preset_folder(topology: Topology) -> Path:
    """Where a preset is written as a checkpoint: launcher.run_dir/models, one per
    preset, seed and dtype."""
    model = topology.model
    name = f"{model.preset}-seed{model.seed}-{topology.effective_dtype}"
    return runs_folder(topology) / "models" / name


def omp_bind(ranks: tuple[tuple[int, ...], ...]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: each rank's cores, ranks separated by '|'."""
    return "|".join(",".join(str(core) for core in cores) for cores in ranks)


def server_cores(topology: Topology, name: str) -> tuple[tuple[int, ...], ...] | None:
    """Each rank's cores of server `name` on cpu (None elsewhere, or when the machine has
    too few: the requirements then say so)."""
    if topology.device != "cpu":
        return None
    placement = cpu_placement(topology, available_cores())
    return None if placement is None else placement[name]


def common_env(topology: Topology, cores: tuple[tuple[int, ...], ...] | None) -> list[EnvEntry]:
    """What every vLLM server of the topology (the reference too) runs with: its
    temporary files, sockets and configuration in its own folder of the run; compiled
    kernels in a cache the runs share (launcher.run_dir/cache/vllm), since vLLM compiles
    its logprobs kernel at the first request that asks for logprobs (35 s on 2 cores)."""
    here = "(the server's folder in the run)"
    shared = str(runs_folder(topology) / "cache" / "vllm")
    cached = "(compiled kernels, shared by the runs in launcher.run_dir)"
    entries = [
        EnvEntry("TMPDIR", f"{WORKDIR}/tmp", here),
        # relative to the server's folder, where it starts: a socket path must stay under
        # 108 bytes, which a run directory's absolute path need not
        EnvEntry("VLLM_RPC_BASE_PATH", "tmp", here),
        EnvEntry("VLLM_CONFIG_ROOT", f"{WORKDIR}/config", here),
        EnvEntry("XDG_CACHE_HOME", f"{WORKDIR}/cache", here),
        EnvEntry("VLLM_CACHE_ROOT", shared, cached),
        EnvEntry("TORCHINDUCTOR_CACHE_DIR", f"{shared}/torchinductor", cached),
        EnvEntry("TRITON_CACHE_DIR", f"{shared}/triton", cached),
        EnvEntry("VLLM_NO_USAGE_STATS", "1", "(nothing leaves the machine)"),
        EnvEntry("DO_NOT_TRACK", "1", "(nothing leaves the machine)"),
        EnvEntry("VLLM_SERVER_DEV_MODE", "1", "(verify empties caches: /reset_prefix_cache)"),
    ]
    if topology.model.uses_preset or Path(str(topology.model.path)).is_dir():
        offline = "model.path (a local checkpoint: served offline)"
        entries += [
            EnvEntry("HF_HUB_OFFLINE", "1", offline),
            EnvEntry("TRANSFORMERS_OFFLINE", "1", offline),
            EnvEntry("HF_HOME", f"{WORKDIR}/cache/huggingface", here),
        ]
    if topology.device == "cpu":
        entries.append(
            EnvEntry("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB, "(pdctl's bound on cpu)")
        )
        if cores is not None:
            entries.append(
                EnvEntry("VLLM_CPU_OMP_THREADS_BIND", omp_bind(cores), "(cores of this machine)")
            )
    elif topology.serving.deterministic:
        entries.append(EnvEntry("VLLM_BATCH_INVARIANT", "1", "serving.deterministic"))
    return entries


def unless_user_set(topology: Topology, role: str, entries: list[EnvEntry]) -> list[EnvEntry]:
    """pdctl's defaults, except where the topology's env (or the role's) sets the
    variable: that value is the user's (the env layers show it)."""
    user = merged_user_env(topology, role)
    return [entry for entry in entries if entry.name not in user]
