"""Faults injected on purpose, so that `pdctl verify` is proven to catch them.

Off unless the launcher hands faults over (a JSON list, from the topology's
`faults:` or `pdctl verify --inject`). Each server reads only the faults meant for
its role: prefill `corrupt-kv` (flip a byte of a room's KV after the digests were
taken) and `delay-transfer` (hold a room past decode's timeout), decode
`drop-scatter` (skip a room's first scatter), any role `kill-role` (SIGKILL itself
when a request arrives after `after` were accepted), prefill and the colocated
reference `perturb-prefix-hit` (another first token after every radix-cache hit), and
prefill and decode `abort-transfer` (decode aborts a room while prefill's write to it
is in flight; the write lands `seconds` after decode gave up). `every` picks every Nth
room; the first `spare` rooms or requests (the launcher's canary) are never faulted.
`abort-transfer` picks rooms by id (every room whose id is a multiple of `every`, past
the first `spare` + `after` rooms), so prefill and decode pick the same rooms without
a word between them.

The KV path draws a room's faults once, as a `RoomFaults`, and hands that object
down; nothing on the hot path looks faults up by name.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from pdctl.serve.settings import Handoff
from pdctl.settings import FAULTS_VAR

log = logging.getLogger("pdctl.serve")
LATE_WRITE_S = 0.1  # abort-transfer: how long after the abort the write lands, by default
ROOMS_REMEMBERED = 4096  # abort-transfer: rooms whose pick is kept (each is counted once)


class Fault(BaseModel):
    """One fault as the launcher hands it over: the topology's `FaultSpec`, with `spare`."""

    model_config = ConfigDict(frozen=True)

    name: str
    every: int = 1
    after: int | None = None  # kill-role: 3 when not given; abort-transfer: 0
    spare: int = 0
    seconds: float | None = None
    role: str | None = None


class Faults:
    def __init__(self, specs: Iterable[Mapping[str, object]]) -> None:
        """`specs`: the JSON objects of the faults (checked here, once)."""
        self.specs = {fault.name: fault for fault in map(Fault.model_validate, specs)}
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self._aborts: OrderedDict[int, bool] = OrderedDict()  # room -> picked (abort-transfer)
        for name in self.specs:
            log.warning("fault injection is ON: %r", self.specs[name])

    @classmethod
    def from_json(cls, raw: str) -> Faults:
        """The faults the launcher handed over (`Handoff.faults`, a JSON list)."""
        if not raw:
            return cls([])
        try:
            specs = json.loads(raw)
            if not isinstance(specs, list):
                raise ValueError("not a list")
            return cls(specs)
        except ValueError as exc:  # a fault that is not one too (pydantic's ValidationError)
            raise SystemExit(f"{FAULTS_VAR} is not a JSON list of faults: {exc}") from None

    def __bool__(self) -> bool:
        return bool(self.specs)

    def hit(self, name: str) -> Fault | None:
        """The fault's spec when this occurrence (1-based) is every `every`th, else None."""
        spec = self.specs.get(name)
        if spec is None:
            return None
        with self.lock:
            seen = self.counts[name] = self.counts.get(name, 0) + 1
        count = seen - spec.spare  # the first `spare` occurrences are spared
        if count > 0 and count % spec.every == 0:
            log.warning("injecting fault %s (occurrence %d)", name, count)
            return spec
        return None

    def aborts(self, room: int) -> Fault | None:
        """abort-transfer: the spec when `room` is one decode aborts mid-transfer (None
        otherwise). Each room counts once, however often it is asked about; past the
        first `spare` + `after` rooms, a room is picked when its id is a multiple of
        `every` (the router draws ids at random: one room in `every`)."""
        spec = self.specs.get("abort-transfer")
        if spec is None:
            return None
        with self.lock:
            picked = self._aborts.get(room)
            if picked is None:
                seen = self.counts["abort-transfer"] = self.counts.get("abort-transfer", 0) + 1
                spared = spec.spare + (spec.after or 0)
                picked = seen > spared and room % spec.every == 0
                self._aborts[room] = picked
                if len(self._aborts) > ROOMS_REMEMBERED:
                    self._aborts.popitem(last=False)
        return spec if picked else None

    def perturbed_logits(self, logits: Any, cached_tokens: int) -> Any:
        """perturb-prefix-hit: a prompt computed on a radix-cache hit gets its two best
        first-token logits swapped, as an engine that is not invariant to a prefix hit
        would pick another token. Every server of the engine has it (the reference too)."""
        if cached_tokens <= 0 or "perturb-prefix-hit" not in self.specs:
            return logits
        best, second = (int(i) for i in logits.topk(2).indices)
        log.warning("injecting fault perturb-prefix-hit (%d cached tokens)", cached_tokens)
        swapped = logits.clone()
        swapped[best], swapped[second] = logits[second], logits[best]
        return swapped

    def request_arrived(self) -> None:
        """kill-role: die (SIGKILL, like an OOM kill) on the first request past `after`."""
        spec = self.specs.get("kill-role")
        if spec is None:
            return
        with self.lock:
            seen = self.counts["kill-role"] = self.counts.get("kill-role", 0) + 1
        if seen - spec.spare > (3 if spec.after is None else spec.after):
            log.warning("injecting fault kill-role at request %d: SIGKILL", seen)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)


_faults: Faults | None = None


def faults() -> Faults:
    """This process's faults (read once from the environment)."""
    global _faults
    if _faults is None:
        _faults = Faults.from_json(Handoff.from_environ(os.environ).faults)
    return _faults


@dataclass(frozen=True)
class RoomFaults:
    """The faults one room's KV transfer gets, drawn once (all off unless injected)."""

    corrupt_kv: bool = False  # prefill: flip a byte of the first segment after its digests
    delay_s: float | None = None  # prefill: hold the room this long before sending
    drop_first_scatter: bool = False  # decode: skip the first segment's scatter
    # prefill (abort-transfer): decode aborts this room mid-transfer; each write waits
    # for the room to close, then lands this long after (it was in flight)
    late_write_s: float | None = None

    @classmethod
    def for_prefill(
        cls, hold_s: float, source: Faults | None = None, *, room: int | None = None
    ) -> RoomFaults:
        """Prefill's draw, once the room's first decode rank registered; `hold_s` is the
        delay when `delay-transfer` names no `seconds` (past decode's timeout)."""
        found = source if source is not None else faults()
        corrupt = found.hit("corrupt-kv") is not None
        delay = found.hit("delay-transfer")
        delay_s = None if delay is None else float(delay.seconds or hold_s)
        aborted = None if room is None else found.aborts(room)
        late_s = None if aborted is None else float(aborted.seconds or LATE_WRITE_S)
        return cls(corrupt_kv=corrupt, delay_s=delay_s, late_write_s=late_s)

    @classmethod
    def for_decode(cls, source: Faults | None = None) -> RoomFaults:
        """Decode's draw, for a room received through the staging ring."""
        found = source if source is not None else faults()
        return cls(drop_first_scatter=found.hit("drop-scatter") is not None)
