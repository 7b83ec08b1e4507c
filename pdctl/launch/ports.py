"""Per-run port allocation: every listener bind-tested, safe against concurrent pdctl runs.

A port the kernel hands out is free now, but nothing stops another pdctl starting
at the same moment from being handed the same one before either server binds it.
So allocation runs under a host-wide file lock and records what it handed out in a
reservation file next to the lock; reservations last until the run releases them,
its pdctl process is gone, or `RESERVATION_S` passed (by then the servers bound).
Fixed ports from the topology are bind-tested too, and refused when reserved.

Dynamic ports are drawn from outside the kernel's ephemeral range
(`net.ipv4.ip_local_port_range`), never by binding port 0. The kernel hands
ephemeral ports to every outgoing connection (a health poll, a transport, another
program's client), and such a connection can take a port between allocation and
the server's bind, which fails the server with "address already in use". Ports
below (or above) the range are only ever taken by an explicit bind, which the
bind test and the reservation file cover. Ports the administrator reserved
(`net.ipv4.ip_local_reserved_ports`) are left alone too. On a host whose ephemeral
range leaves almost nothing outside it, the kernel picks (the race above is then
possible again, and only there).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdctl.engines.command import PortSlot
from pdctl.errors import LaunchError
from pdctl.launch.settings import LaunchSettings

RESERVATION_S = 300.0
LOWEST_PORT = 20000  # clear of common services and of Ray's worker ports (10002-19999)
MIN_CANDIDATES = 1000
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default; macOS/BSD use 49152-65535
_PROC = Path("/proc/sys/net/ipv4")


class PortError(LaunchError):
    """A port the run needs cannot be had; the message names it and who needs it."""


def state_dir(settings: LaunchSettings | None = None) -> Path:
    """Where pdctl keeps host-wide state (`LaunchSettings.state_dir`)."""
    return (settings or LaunchSettings.from_environ()).state_dir


def ports_dir(settings: LaunchSettings | None = None) -> Path:
    """Where the port lock and reservations live (`LaunchSettings.ports_dir`): apart from
    the state dir so that runs recorded in private state dirs still share the host's one
    port reservation table."""
    return (settings or LaunchSettings.from_environ()).ports_dir


@contextlib.contextmanager
def host_lock() -> Iterator[Path]:
    """The host-wide port lock, held for the block; yields the directory it lives in."""
    directory = ports_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "ports.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield directory
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _load(path: Path) -> dict[int, dict[str, float]]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    now = time.time()
    kept = {}
    for port, entry in raw.items():
        if now - float(entry.get("at", 0)) < RESERVATION_S and _alive(int(entry.get("pid", 0))):
            kept[int(port)] = entry
    return kept


def _save(path: Path, reservations: dict[int, dict[str, float]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(k): v for k, v in sorted(reservations.items())}))
    tmp.replace(path)


def bind_test(host: str, port: int) -> OSError | None:
    """None when `host:port` can be bound now, else why not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc
    return None


def _parse_ranges(text: str) -> list[tuple[int, int]]:
    """`"a-b,c"` (the reserved-ports format) -> [(a, b), (c, c)]; bad parts ignored."""
    found = []
    for part in text.replace("\n", ",").split(","):
        low, _, high = part.strip().partition("-")
        try:
            found.append((int(low), int(high or low)))
        except ValueError:
            continue
    return found


def ephemeral_range() -> tuple[int, int]:
    """The range the kernel picks outgoing connections' local ports from."""
    try:
        low, high = (int(x) for x in (_PROC / "ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def candidate_ports() -> list[int]:
    """Ports allocation may hand out: outside the ephemeral range and the reserved list.

    Empty when the ephemeral range leaves fewer than MIN_CANDIDATES (a host tuned to
    `1024 65535`): allocation then takes ports the kernel picks, as it must.
    """
    low, high = ephemeral_range()
    try:
        reserved = _parse_ranges((_PROC / "ip_local_reserved_ports").read_text())
    except OSError:
        reserved = []
    below, above = (
        range(LOWEST_PORT, max(LOWEST_PORT, low)),
        range(max(LOWEST_PORT, high + 1), 65536),
    )
    ports = [*below, *above]
    if reserved:
        ports = [port for port in ports if not any(a <= port <= b for a, b in reserved)]
    return ports if len(ports) >= MIN_CANDIDATES else []


@dataclass(frozen=True)
class Allocation:
    ports: dict[str, int]  # slot key -> port

    def release(self) -> None:
        """Give the reservations back (the servers hold the ports themselves now)."""
        with host_lock() as directory:
            path = directory / "ports.json"
            reservations = _load(path)
            for port in self.ports.values():
                reservations.pop(port, None)
            _save(path, reservations)


def allocate(slots: Sequence[PortSlot], host: str) -> Allocation:
    """A port for every slot: fixed ones checked, the rest chosen by the kernel."""
    chosen: dict[str, int] = {}
    held: list[socket.socket] = []
    with host_lock() as directory:
        path = directory / "ports.json"
        reservations = _load(path)
        try:
            for slot in slots:
                if slot.fixed is None:
                    continue
                if slot.fixed in reservations or slot.fixed in chosen.values():
                    raise PortError(
                        f"port {slot.fixed} ({slot.purpose}, {slot.key}) is reserved by another "
                        "pdctl run starting on this host"
                    )
                problem = bind_test(host, slot.fixed)
                if problem is not None:
                    taken = problem.errno == errno.EADDRINUSE
                    raise PortError(
                        f"port {slot.fixed} ({slot.purpose}, {slot.key}) "
                        + ("is already in use" if taken else f"cannot be bound: {problem}")
                        + "; pick another port in the topology or leave it out to have one "
                        "allocated"
                    )
                chosen[slot.key] = slot.fixed
            candidates = candidate_ports()
            draw = random.SystemRandom()
            for slot in slots:
                if slot.fixed is not None:
                    continue
                for _ in range(400):
                    wanted = draw.choice(candidates) if candidates else 0  # 0: the kernel's
                    if wanted in reservations or wanted in chosen.values():
                        continue
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    try:
                        sock.bind((host, wanted))
                    except OSError:
                        sock.close()
                        continue
                    held.append(sock)  # held while the rest are chosen
                    port = int(sock.getsockname()[1])
                    if port in reservations or port in chosen.values():
                        continue
                    chosen[slot.key] = port
                    break
                else:
                    raise PortError(f"no free port for {slot.purpose} ({slot.key}) on {host}")
            now = time.time()
            for port in chosen.values():
                reservations[port] = {"pid": os.getpid(), "at": now}
            _save(path, reservations)
        finally:
            for sock in held:
                sock.close()
    return Allocation(chosen)
