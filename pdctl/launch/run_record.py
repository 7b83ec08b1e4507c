"""What a run records of itself: run.json and the host-wide record, typed once.

The run writes it (`run.Run.record`, with what its host adds: `hosts.Host.annotate`);
`pdctl status`, `logs`, `down` and verify read it back (`state.RunState`). Every
field is JSON as written; a record without `launcher` is a run on this host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict


class NodeFields(TypedDict):
    ip: str  # the address the node joined the cluster with
    node_id: str
    hostname: str


class NodeRecord(NodeFields, total=False):
    """The Ray node a process runs on (`launcher: ray`)."""

    log_dir: str  # where its ranks log on that node, once it started there


class ProcessFields(TypedDict):
    """A process of the run: where it listens, its process group, its log, its stage."""

    name: str
    role: str
    replica: int
    url: str
    pid: int | None
    pgid: int | None
    start_time: int | None  # with the PID, its identity (None where the PID is remote)
    titles: list[str]
    log: str | None
    stage: str
    command: list[str]


class ProcessRecord(ProcessFields, total=False):
    node: NodeRecord | None  # launcher: ray


class Canary(TypedDict):
    """The 1-token request through the router that proved the run serves."""

    ms: float
    output_ids: list[int]
    kv_transfer: Mapping[str, object] | None  # `meta_info.kv_transfer` as it came


class ForkserverRecord(TypedDict):
    pid: int
    start_time: int | None


class RayRecord(TypedDict):
    address: str
    namespace: str
    nodes: dict[str, NodeRecord]  # process name -> its node


class RunFields(TypedDict):
    name: str
    topology: str
    file: str
    run_dir: str
    started_at: float
    pdctl_pid: int
    detached: bool
    router_url: str | None
    canary: Canary | None
    warnings: list[str]
    ports: dict[str, int]
    forkserver: ForkserverRecord | None
    processes: list[ProcessRecord]
    plan: dict[str, object]  # `LaunchPlan.to_json`, as `pdctl plan --json` shows it


class RunRecord(RunFields, total=False):
    """run.json and the host-wide record: what a run started, where and how it went."""

    launcher: str  # "ray" (absent: this host)
    ray: RayRecord
