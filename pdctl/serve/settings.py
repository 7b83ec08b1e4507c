"""The embedded server's settings table: every tunable of `python -m pdctl.serve`.

Each row is a flag of the server, generated here into its parser and read once into a
frozen `ServeSettings` (`ServerArgs.settings`), which the parts that use it are given
through their constructors. A topology sets one with `serving.args` (or a role's
`args`); `pdctl doctor --settings` prints the table and docs/settings.md is generated
from it. `Handoff` is what the launcher handed this process in its environment (the
variables of `pdctl.settings.HANDOFF`), read here once and nowhere else.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from pdctl.settings import (
    FAULTS_VAR,
    LOG_DIR_VAR,
    PROCESS_NAME_VAR,
    RUN_ID_VAR,
    RUN_SECRET_VAR,
    Setting,
)

NOTICES = ("write", "token", "worker")
TP_GATHERS = ("futex", "collective")
CUDA_SCHEDULES = ("", "auto", "spin", "yield", "blocking")


@dataclass(frozen=True)
class ServeSettings:
    """The server's tunables, parsed once from its flags (defaults: what was measured best)."""

    switch_interval_us: int = 500
    cuda_schedule: str = ""  # "": the driver's own choice
    native_attention: bool = True
    fork_ranks: bool = True
    tp_gather: str = "futex"
    bells: bool = True
    notify_at: str = "write"


# why each row exists; its default is ServeSettings' (cuda_graphs: ServerArgs'), its flag
# the name's (a switch's with its --no- form)
REASONS: dict[str, str] = {
    "cuda_graphs": "decode steps replayed as CUDA graphs on CUDA at TP 1 (one launch per "
    "step instead of one per kernel); off to compare or to debug a kernel",
    "switch_interval_us": "the GIL switch interval of a PD server, in us: the KV threads "
    "beside the engine's loop wait for the GIL up to this long per call (CPython's 5 ms "
    "made a write ms of waiting)",
    "cuda_schedule": "how CUDA waits for the device (spin, yield, blocking, auto), set "
    "before the context exists; empty: the driver's choice",
    "native_attention": "the CPU's float32 attention in C (one query row at a time, a "
    "fixed order); off: the torch path, equal to rounding",
    "fork_ranks": "on the CPU, TP ranks forked once the modules are imported "
    "(milliseconds, not 1.5 s of imports each); off: spawned",
    "tp_gather": "how TP ranks of one host gather: futexes over shared memory, or gloo's "
    "collective (the fallback where futexes are missing)",
    "bells": "doorbells in shared memory for a KV notice between processes of one host "
    "instead of a message; off: the notice as a message (another host)",
    "notify_at": "when prefill notifies decode that a room's KV landed: after the write "
    "(write), once the first token is chosen (token), or from the room's worker (worker)",
}
DEFAULTS: dict[str, str | int | bool] = {"cuda_graphs": True, **asdict(ServeSettings())}


def _row(name: str, reason: str) -> Setting:
    default, flag = DEFAULTS[name], "--" + name.replace("_", "-")
    if isinstance(default, bool):
        return Setting(name, str(default).lower(), reason, f"{flag} / --no-{flag[2:]}")
    return Setting(name, str(default), reason, flag)


ROWS: tuple[Setting, ...] = tuple(_row(name, reason) for name, reason in REASONS.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The table's flags on the server's parser (cuda_graphs stays a ServerArgs field)."""
    on_off, default = argparse.BooleanOptionalAction, ServeSettings()  # one set of defaults
    parser.add_argument("--switch-interval-us", type=_interval, default=default.switch_interval_us)
    parser.add_argument("--cuda-schedule", choices=CUDA_SCHEDULES, default=default.cuda_schedule)
    parser.add_argument("--native-attention", action=on_off, default=default.native_attention)
    parser.add_argument("--fork-ranks", action=on_off, default=default.fork_ranks)
    parser.add_argument("--tp-gather", choices=TP_GATHERS, default=default.tp_gather)
    parser.add_argument("--bells", action=on_off, default=default.bells)
    parser.add_argument("--notify-at", choices=NOTICES, default=default.notify_at)


def from_namespace(parsed: argparse.Namespace) -> ServeSettings:
    return ServeSettings(**{f.name: getattr(parsed, f.name) for f in fields(ServeSettings)})


def _interval(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError(f"{text!r}: give microseconds between 1 and 1000000")
    return value


@dataclass(frozen=True)
class Handoff:
    """What the launcher handed this process (unset outside a run: an ad-hoc server)."""

    run_id: str = ""
    secret: bytes = b""
    faults: str = ""  # the JSON list; serve/faults.py parses it
    log_dir: Path | None = None
    process_name: str = ""

    @property
    def launched(self) -> bool:
        """Under the launcher: a run directory and a process name to write logs by."""
        return self.log_dir is not None and bool(self.process_name)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Handoff:
        log_dir = environ.get(LOG_DIR_VAR)
        return cls(
            run_id=environ.get(RUN_ID_VAR, ""),
            secret=environ.get(RUN_SECRET_VAR, "").encode(),
            faults=environ.get(FAULTS_VAR, ""),
            log_dir=Path(log_dir) if log_dir else None,
            process_name=environ.get(PROCESS_NAME_VAR, ""),
        )


if __name__ == "__main__":  # `pdctl doctor` reads the table so: the CLI imports no serve
    import json

    print(json.dumps([asdict(row) for row in ROWS]))
