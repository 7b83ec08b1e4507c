"""Which addresses a process group listens on, read from /proc (no `ss` needed).

`pdctl up` checks a loopback topology with it: every listening TCP socket of every
process it started must be on a loopback address, or the run says which is not.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from pdctl.launch.processes import group_members

LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc/net/tcp* print each 32-bit word of the address in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def listeners(pgid: int) -> list[Listener]:
    """Every listening TCP socket held by a process of group `pgid`."""
    found: list[Listener] = []
    for pid in sorted(group_members(pgid)):
        inodes = _socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{table}") as handle:
                    rows = handle.read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                fields = row.split()
                if len(fields) < 10 or fields[3] != LISTEN or fields[9] not in inodes:
                    continue
                address, port = fields[1].split(":")
                found.append(Listener(pid, _address(address), int(port, 16)))
    return found
