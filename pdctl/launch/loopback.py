"""Keep a loopback topology's listeners on loopback, whatever its libraries do.

pdctl's own listeners (HTTP servers, bootstrap, the builtin transport, the router)
bind the topology's `host`. The libraries a server loads have their own:

  torch.distributed  TCPStore of a TP group     pdctl binds it itself (serve/tp.py)
  gloo / NCCL        TP pairs, bootstrap        GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME=lo
  NIXL (UCX)         UCX's TCP interfaces       UCX_NET_DEVICES=lo
  Mooncake           handshake + TCP transport  always the wildcard address: no option

When the topology's host is a loopback address, `confine` sets those variables
(values the topology or the caller set win) and preloads a 40-line bind() shim
(loopback_bind.c, compiled once per host into the state directory) that rewrites a
wildcard bind to loopback. `LaunchSettings.loopback_shim` (launch/settings.py) turns the
shim off.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdctl.launch.ports import state_dir

SOURCE = Path(__file__).with_name("loopback_bind.c")
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@functools.cache
def _source_hash() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def shim_library() -> Path:
    """The compiled shim (built on first use); raises OSError saying why it cannot be."""
    target = state_dir() / "native" / f"loopback-bind-{_source_hash()}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) to build the loopback bind shim")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", str(built), str(SOURCE), "-ldl"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise OSError(f"building the loopback bind shim failed: {result.stderr.strip()}")
        os.replace(built, target)  # atomic: concurrent launches never load half a file
    return target


def confine(env: dict[str, str], host: str, shim: bool = True) -> str | None:
    """Confine the listeners of a process started with `env` to loopback, if `host` is.

    Returns a warning when something could not be confined (the shim could not be built).
    """
    if not is_loopback(host):
        return None
    for name in INTERFACE_VARS:
        env.setdefault(name, "lo")
    if not shim:  # `LaunchSettings.loopback_shim`
        return None
    try:
        library = str(shim_library())
    except OSError as exc:
        return (
            f"{exc}: Mooncake's listeners will bind every interface "
            "(install a C compiler, or use the tcp or nixl transport)"
        )
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != library]
    env["LD_PRELOAD"] = ":".join([library, *preload])
    return None
