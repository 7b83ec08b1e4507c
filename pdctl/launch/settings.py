"""The launcher's settings table: its tunables and the host paths it keeps state in.

Each row is one `PDCTL_` variable of pdctl's own environment (a host path or an escape
hatch, never a topology's business), read here and nowhere else: `LaunchSettings.from_environ`
parses them once where the launcher meets its environment (a `Run` from its parent's
environment; the port table and the run records where they are opened) and the parts
that use them are given the result. A bad value is an error, never silently a default.
`pdctl doctor` shows the table; docs/settings.md is generated from it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdctl.errors import LaunchError
from pdctl.settings import Setting

FORKSERVER_VAR = "PDCTL_FORKSERVER"
LOOPBACK_SHIM_VAR = "PDCTL_LOOPBACK_SHIM"
STATE_DIR_VAR = "PDCTL_STATE_DIR"
PORTS_DIR_VAR = "PDCTL_PORTS_DIR"
NODE_LOG_DIR_VAR = "PDCTL_NODE_LOG_DIR"

# Why each row exists, as `pdctl doctor` and docs/settings.md say it.
FORKSERVER_WHY = (
    "on the CPU an attached run forks its embedded servers from one process that imported "
    "them once (launch 2-3 s faster per server); 0 spawns every process, to compare or when "
    "a server must start from a clean interpreter"
)
LOOPBACK_SHIM_WHY = (
    "a loopback topology preloads the bind shim so Mooncake's listeners stay on loopback "
    "(docs/security.md); 0 leaves them alone, to show what they bind without it"
)
STATE_DIR_WHY = (
    "where pdctl keeps host-wide state (the run records `status` and `down` read, the built "
    "shim, the port table); tests and several users of one account keep their own"
)
PORTS_DIR_WHY = (
    "where the host-wide port lock and reservations live: runs recorded in private state "
    "dirs (test workers, users of one account) still share the host's one port table"
)
NODE_LOG_DIR_WHY = (
    "on a Ray node that cannot create the run directory, where its servers log "
    "(`<dir>/<run>`); empty: the run directory, else a temporary folder"
)

ROWS: tuple[Setting, ...] = (
    Setting("forkserver", "1", FORKSERVER_WHY, f"env {FORKSERVER_VAR}"),
    Setting("loopback_shim", "1", LOOPBACK_SHIM_WHY, f"env {LOOPBACK_SHIM_VAR}"),
    Setting("state_dir", "$XDG_STATE_HOME/pdctl", STATE_DIR_WHY, f"env {STATE_DIR_VAR}"),
    Setting("ports_dir", "the state dir", PORTS_DIR_WHY, f"env {PORTS_DIR_VAR}"),
    Setting("node_log_dir", "", NODE_LOG_DIR_WHY, f"env {NODE_LOG_DIR_VAR}"),
)


def _switch(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "1")
    if value not in ("0", "1"):
        raise LaunchError(f"{name}={value!r} is neither 0 nor 1", hint=f"unset {name} or set 0")
    return value == "1"


def _default_state_dir(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "pdctl"


@dataclass(frozen=True)
class LaunchSettings:
    """The launcher's settings, parsed once from an environment."""

    forkserver: bool = True
    loopback_shim: bool = True
    state_dir: Path = Path()
    ports_dir: Path = Path()
    node_log_dir: Path | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchSettings:
        """The settings `environ` (pdctl's own environment when None) holds."""
        env = os.environ if environ is None else environ
        state = Path(env[STATE_DIR_VAR]) if env.get(STATE_DIR_VAR) else _default_state_dir(env)
        ports = Path(env[PORTS_DIR_VAR]) if env.get(PORTS_DIR_VAR) else state
        node_logs = Path(env[NODE_LOG_DIR_VAR]) if env.get(NODE_LOG_DIR_VAR) else None
        return cls(
            forkserver=_switch(env, FORKSERVER_VAR),
            loopback_shim=_switch(env, LOOPBACK_SHIM_VAR),
            state_dir=state,
            ports_dir=ports,
            node_log_dir=node_logs,
        )
