"""Where verify sends its requests, and what it ends afterwards.

Three targets: a topology pdctl launches (`launched`), a run `pdctl up` started
(`running`) and any router URL that speaks the same API (`url`). Each knows its
router and workers (to flush their caches and ask what they serve), how to tell
that a role died, and how to start a colocated reference server of the
topology's model on demand: the reference pass and the control before blame
both use it. Its start may begin early, in the background, so the passes before
the reference pass overlap it. A target ends what it started itself in `close`
(the launched run, a reference server, also one still starting: it was spawned at
once) and nothing else: a run of `pdctl up` is never stopped.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TypedDict

import httpx

from pdctl.errors import LaunchError, UsageError
from pdctl.launch import state
from pdctl.launch.launcher import make_run
from pdctl.launch.plan import LaunchPlan, load_checked, make_plan
from pdctl.launch.run import Run
from pdctl.records import ServerInfo
from pdctl.topology.issues import TopologyError


class TargetRecord(TypedDict, total=False):
    """What verify spoke to: a URL, a topology it launched, or a run already up."""

    mode: str  # url | launched | running
    router_url: str | None
    topology: str
    file: str
    run: str


class NoReference(Exception):
    """No reference server can be started for this target (the reason says why)."""


class Target:
    """A PD router and its workers; subclasses say how they came up and how to end them."""

    mode = "url"

    def __init__(
        self, router_url: str, prefill: list[str], decode: list[str], plan: LaunchPlan | None
    ) -> None:
        self.router_url = router_url
        self.prefill_urls = prefill
        self.decode_urls = decode
        self._plan = plan  # what a reference server is started from (None: nothing)
        self._reference_run: Run | None = None
        self._reference_url: str | None = None
        self._reference_start: Future[str] | None = None  # started early, in the background

    @property
    def plan(self) -> LaunchPlan | None:
        """The topology's plan, where the target has one (a bare URL with no file has not)."""
        return self._plan

    @property
    def workers(self) -> list[str]:
        return self.prefill_urls + self.decode_urls

    def role_urls(self) -> dict[str, list[str]]:
        """The servers of each role this target knows (none of a bare router's other
        than pdctl's builtin one, which lists them)."""
        known = self.prefill_urls != [self.router_url]
        return {"prefill": self.prefill_urls if known else [], "decode": self.decode_urls}

    def check_alive(self) -> None:
        """Raise LaunchError naming a role that is not running any more."""

    def describe(self) -> TargetRecord:
        return {"mode": self.mode, "router_url": self.router_url}

    def logs(self) -> dict[str, str]:
        """Each process's log, where this target knows them (a bare URL does not)."""
        return {}

    def reference(self) -> str:
        """The URL of a colocated server of the same model (started once, on first use,
        or waited for when `start_reference_early` began it)."""
        if self._reference_url is None:
            if self._plan is None:
                raise NoReference("no topology to start a reference from (give the topology file)")
            starting, self._reference_start = self._reference_start, None
            self._reference_url = (
                starting.result() if starting is not None else self._start_reference()
            )
        return self._reference_url

    def start_reference_early(self) -> None:
        """Begin starting the reference now, on another thread (its imports and weights
        overlap the passes before the reference pass); a failure surfaces in `reference`."""
        if self._plan is None or self._reference_url is not None or self._reference_start:
            return
        # Spawned here: a child started from a thread would be killed when that thread
        # ends (the parent-death signal follows the spawning thread). Waited for there.
        self._reference_run = self._reference_host()
        spawned = self._reference_run.spawn_reference(tp=1)
        starting: Future[str] = Future()

        def wait() -> None:
            try:
                starting.set_result(spawned.wait())
            except BaseException as exc:  # handed to whoever waits for the reference
                starting.set_exception(exc)

        self._reference_start = starting
        threading.Thread(target=wait, name="pdctl-reference", daemon=True).start()

    def _start_reference(self) -> str:
        self._reference_run = self._reference_host()
        return self._reference_run.start_reference(tp=1)

    def _settle_reference(self) -> None:
        """Forget a start under way: its process is in the run (spawned at once), so
        stopping the run ends it, and its waiting thread then ends on the exit."""
        self._reference_start = None

    def _reference_host(self) -> Run:
        assert self._plan is not None
        return make_run(self._plan)

    def close(self) -> None:
        self._settle_reference()
        if self._reference_run is not None:
            self._reference_run.stop()


class LaunchedTarget(Target):
    """A topology this verify brings up, and stops at the end (its reference with it)."""

    mode = "launched"

    def __init__(self, plan: LaunchPlan) -> None:
        super().__init__("", [], [], plan)
        self.run = make_run(plan)

    def start(self, timeout: float | None, *, reference: bool = False) -> None:
        """Start the run and wait until it serves; with `reference`, the reference server
        is spawned right after the run's processes, its start overlapping theirs (it is
        waited for when the reference pass needs it, not here)."""
        self.run.start()
        if reference:
            self.start_reference_early()
        self.run.wait_ready(timeout)
        self.router_url = self.run.router_url
        for role, urls in (("prefill", self.prefill_urls), ("decode", self.decode_urls)):
            urls[:] = [s.url for s in self.run.states if s.plan.role == role]

    def check_alive(self) -> None:
        self.run.check_exits()

    def logs(self) -> dict[str, str]:
        return {s.plan.name: str(s.spawned.log_path) for s in self.run.states if s.spawned}

    def describe(self) -> TargetRecord:
        return {
            "mode": self.mode,
            "topology": self.run.plan.topology.name,
            "file": str(self.run.plan.loaded.file),
            **({"router_url": self.router_url} if self.router_url else {}),
        }

    def _reference_host(self) -> Run:
        return self.run  # the reference joins the run: stopped with it

    def close(self) -> None:
        self._settle_reference()
        self.run.stop()


class RunningTarget(Target):
    """A run of `pdctl up` on this host: verified, never stopped."""

    mode = "running"

    def __init__(self, name: str | None) -> None:
        live = [r for r in state.select(name) if not r.stale]
        if not live:
            what = f"no run named {name!r} is up" if name else "no topology is up on this host"
            raise UsageError(what, hint="give a topology file, or start one with `pdctl up FILE`")
        if len(live) > 1:
            raise UsageError(
                f"{len(live)} runs are up: {', '.join(r.name for r in live)}",
                hint="pick one with --running NAME",
            )
        (self.state,) = live
        urls = {
            role: [p["url"] for p in self.state.processes if p["role"] == role]
            for role in ("prefill", "decode")
        }
        super().__init__(
            str(self.state.data["router_url"]), urls["prefill"], urls["decode"], _plan_of(self)
        )

    def check_alive(self) -> None:
        for process in self.state.processes:
            if not self.state.alive(process):
                raise LaunchError(
                    f"{process['name']} ({process['role']}, pid {process['pid']}) is not running "
                    "any more"
                )

    def logs(self) -> dict[str, str]:
        return {p["name"]: p["log"] for p in self.state.data.get("processes", []) if p.get("log")}

    def describe(self) -> TargetRecord:
        return {
            "mode": self.mode,
            "run": self.state.name,
            "topology": self.state.topology,
            "router_url": self.router_url,
        }


def _plan_of(target: RunningTarget) -> LaunchPlan | None:
    """The run's topology file, if it still loads: the reference is started from it."""
    file = target.state.data.get("file")
    if not file:
        return None
    try:
        return make_plan(load_checked(file))
    except (TopologyError, UsageError, OSError):
        return None


def url_target(url: str, plan: LaunchPlan | None) -> Target:
    """Any router: the builtin one lists its workers, so their caches can be flushed."""
    prefill: list[str] = []
    decode: list[str] = []
    try:
        info = ServerInfo.from_json(httpx.get(f"{url}/get_server_info", timeout=10).json())
        prefill, decode = info.worker_urls("prefill"), info.worker_urls("decode")
    except (httpx.HTTPError, ValueError):
        pass
    if not prefill and not decode:
        prefill = [url]  # other routers: /flush_cache on the router flushes its workers
    return Target(url, prefill, decode, plan)
