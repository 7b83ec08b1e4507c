"""Mooncake Transfer Engine: P2P handshake, TCP (CI) or RDMA, CPU or GPU memory.

The protocol comes from the topology (`transfer.protocol`), else from
`MOONCAKE_PROTOCOL`, else tcp. Mooncake itself reads `MC_USE_TENT` (and the older
`MC_USE_TEV1`): set to any value, "0" included, it asks for the TENT engine. Whether
TENT really ran is what `probe_engine` observes: a Transfer Engine started in a
child process with that environment, read from its own log (the classic engine logs
from its own source files, which TENT never constructs). Wheels built without TENT
ignore the variable silently; `tent_built()` only says whether TENT's symbols are in
the library. Notifications ride on Mooncake's own notify messages, sent with the
last write.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, TypedDict

from pdctl.staging.descriptors import xpu_pointer_type
from pdctl.staging.transport.base import (
    Descriptors,
    MemoryRegion,
    Notice,
    Notification,
    Peer,
    PeerUnreachable,
    RegistrationError,
    TransferHandle,
    Transport,
    TransportConfig,
    TransportError,
    notice_bytes,
)
from pdctl.staging.transport.pool import WritePool


def import_engine() -> Any:
    try:
        import mooncake.engine as engine
    except ImportError as exc:
        hint = ""
        if "libibverbs" in str(exc):
            hint = " (Mooncake links libibverbs even for TCP: apt-get install libibverbs1)"
        raise TransportError(f"the mooncake transport needs mooncake.engine: {exc}{hint}") from None
    return engine


def tent_built() -> bool:
    """Is the TENT engine compiled into the installed Mooncake? (symbol probe)"""
    try:
        import mooncake
    except ImportError:
        return False
    folder = os.path.dirname(mooncake.__file__)
    pattern = b"_ZN8mooncake4tent"
    for name in os.listdir(folder):
        if name.endswith(".so"):
            with open(os.path.join(folder, name), "rb") as handle:
                if pattern in handle.read():
                    return True
    return False


TENT_VARIABLES = ("MC_USE_TENT", "MC_USE_TEV1")
# glog names the source file of each line: these are the classic engine's, which a
# Transfer Engine running TENT never constructs
CLASSIC_SOURCES = ("transfer_engine_impl.cpp", "tcp_transport.cpp", "rdma_transport.cpp")
_PROBE = (
    "from mooncake.engine import TransferEngine\n"
    "engine = TransferEngine()\n"
    "print('pdctl-probe-init', engine.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', ''))\n"
)


def tent_requested(env: Mapping[str, str] | None = None) -> str | None:
    """The variable that asks Mooncake for TENT (set to any value), if any."""
    found = os.environ if env is None else env
    return next((name for name in TENT_VARIABLES if name in found), None)


class EngineProbe(TypedDict):
    """Which implementation a Transfer Engine ran, and the line of its log that shows it."""

    implementation: str  # "tent", "classic" or "unknown" (it did not start)
    evidence: str


def probe_engine(env: Mapping[str, str], timeout: float = 60.0) -> EngineProbe:
    """Which implementation a Transfer Engine runs under `env`, from the engine itself:
    `implementation` is "tent", "classic" or "unknown" (it did not start), with the
    log line that shows it. The child binds only loopback and exits at once."""
    child_env = {**env, "GLOG_logtostderr": "1", "GLOG_minloglevel": "0"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"implementation": "unknown", "evidence": f"the probe did not finish: {exc}"}
    started = "pdctl-probe-init 0" in done.stdout
    lines = done.stderr.splitlines()
    classic = [line for line in lines if any(source in line for source in CLASSIC_SOURCES)]
    if classic:
        return {"implementation": "classic", "evidence": classic[0].strip()[-200:]}
    if started:
        return {
            "implementation": "tent",
            "evidence": "initialised with no line from the classic engine's sources",
        }
    tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    return {"implementation": "unknown", "evidence": f"the engine did not start: {tail[-200:]}"}


class MooncakeDescription(TypedDict):
    """What a peer needs to reach this endpoint's engine (`Transport.describe`)."""

    session: str  # host:port of the engine's handshake
    protocol: str


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        engine = import_engine()
        self._module = engine
        self.protocol = config.protocol or os.environ.get("MOONCAKE_PROTOCOL", "tcp")
        self.engine = engine.TransferEngine()
        result = self.engine.initialize(
            config.host, "P2PHANDSHAKE", self.protocol, ",".join(config.ib_devices)
        )
        if result != 0:
            raise TransportError(
                f"{config.name}: Mooncake failed to initialise ({self.protocol} on {config.host}): "
                f"error {result}"
            )
        self.session = f"{config.host}:{self.engine.get_rpc_port()}"
        self.tent_requested = tent_requested() is not None
        self.pool = WritePool("mooncake")
        self._batch_lock = threading.Lock()

    def _register(self, region: MemoryRegion) -> None:
        location = "*"
        if region.device_type == "xpu":
            location = xpu_pointer_type(region.ptr)
        elif region.device_type != "cpu":
            location = f"{region.device_type}:{region.device_index or 0}"
        if self.engine.register_memory(region.ptr, region.length, location) != 0:
            raise RegistrationError(
                f"{self.config.name}: Mooncake refused to register {region.length} bytes at "
                f"{region.ptr:#x} ({location})"
            )

    def _deregister(self, region: MemoryRegion) -> None:
        self.engine.unregister_memory(region.ptr)

    def _describe(self) -> MooncakeDescription:
        return MooncakeDescription(session=self.session, protocol=self.protocol)

    def _connect(self, name: str, regions: list[MemoryRegion], info: dict[str, Any]) -> Peer:
        session = info.get("session")
        if not isinstance(session, str) or ":" not in session:
            raise PeerUnreachable(f"{self.config.name}: bad mooncake description (no session)")
        if info.get("protocol") not in (None, self.protocol):
            raise PeerUnreachable(
                f"{self.config.name}: peer {name} uses protocol {info.get('protocol')}, "
                f"this endpoint {self.protocol}"
            )
        return Peer(name, session, regions, {"session": session})

    def _write_async(self, peer: Peer, descriptors: Descriptors, notify: Notice) -> TransferHandle:
        message = notice_bytes(notify)  # it rides the last batch
        return self.pool.submit(peer, lambda: self._write(peer, descriptors, message))

    # Mooncake's TCP lanes have bounded queues: a batch of thousands of small ranges
    # (per-token writes when staging is off), or several batches at once from the
    # sender's threads, is refused ("queue-full", error -1). So batches go one at a
    # time per engine, at most MAX_BATCH ranges each; the notification rides the last.
    MAX_BATCH = 128

    def _write(self, peer: Peer, descriptors: Descriptors, notify: bytes | None) -> None:
        src, dst, lengths = (a.tolist() for a in descriptors)
        session = peer.state["session"]
        with self._batch_lock:
            for start in range(0, len(src), self.MAX_BATCH):
                end = start + self.MAX_BATCH
                last = end >= len(src)
                ranges = (src[start:end], dst[start:end], lengths[start:end])
                self._batch(peer, session, ranges, notify if last else None)

    def _batch(
        self,
        peer: Peer,
        session: str,
        ranges: tuple[list[int], list[int], list[int]],  # (src, dst, lengths)
        notify: bytes | None,
    ) -> None:
        src, dst, lengths = ranges
        for attempt in range(3):
            if notify is None:
                result = self.engine.batch_transfer_sync_write(session, src, dst, lengths)
            else:
                message = self._module.TransferNotify(self.config.name, notify.hex())
                opcode = self._module.TransferOpcode.Write
                result = self.engine.batch_transfer_sync(
                    session, src, dst, lengths, opcode, message
                )
            if result >= 0:
                return
            if notify is not None or attempt == 2:  # a notification is never sent twice
                break
            time.sleep(0.01 * (attempt + 1))  # the same bytes again: writes are idempotent
        raise TransportError(
            f"{self.config.name}: Mooncake write to {peer.label} failed (error {result}); "
            "is the peer alive and its memory registered?"
        )

    def _poll(self) -> None:
        for item in self.engine.get_notifies():
            try:
                message = bytes.fromhex(item.msg)
            except ValueError:
                continue  # not one of ours
            self.deliver(Notification(str(item.name), message))

    def _close(self) -> None:
        self.pool.shutdown()
