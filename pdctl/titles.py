"""Process titles: how pdctl names the processes it starts, one builder for all of them.

The launcher plans each rank's title, a server sets it on itself (setproctitle), the
forkserver names itself, and the soak reads titles back from /proc to say whose memory
grew. `pdctl:<topology>:<role>:tp<rank>` for a server rank or the router, with a
replica above 0 as `<role>-<replica>`; `pdctl:<topology>:<helper>` for a helper such
as the forkserver. This module imports nothing: the servers and the CLI share it.
"""

from __future__ import annotations

PREFIX = "pdctl:"


def role_name(role: str, replica: int) -> str:
    """A server's role as its title and logs show it: `decode`, or `decode-1`."""
    return role if replica == 0 else f"{role}-{replica}"


def rank_title(topology: str, role: str, rank: int, replica: int = 0) -> str:
    """`pdctl:<topology>:<role>:tp<rank>` (the router is `router`, rank 0)."""
    return f"{PREFIX}{topology}:{role_name(role, replica)}:tp{rank}"


def helper_title(topology: str, helper: str) -> str:
    """`pdctl:<topology>:<helper>`, e.g. the forkserver."""
    return f"{PREFIX}{topology}:{helper}"


def is_pdctl_title(title: str) -> bool:
    return title.startswith(PREFIX)


def short_title(title: str) -> str:
    """A title without pdctl and the topology (`decode:tp1`); any other name as it is."""
    return ":".join(title.split(":")[-2:]) if is_pdctl_title(title) else title
