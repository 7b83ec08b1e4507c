"""NIXL with the UCX (or LIBFABRIC) plugin: DRAM on the CPU, VRAM on accelerators.

NIXL helpers can return None on bad input; every such result is turned into an
error here. Peers are added from their agent metadata (carried in the
description); notifications are NIXL's own, delivered when the write completes.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import logging
import sys
import threading
import time
import uuid
from typing import Any, TypedDict

import numpy as np

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
from pdctl.staging.transport.regions import SMALL_LOOKUP, RegionIndex


def import_nixl() -> Any:
    errors = []
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        _logs_to_stderr()
        return api
    raise TransportError(
        "the nixl transport needs nixl (pip install --no-deps nixl-cu12 nixl): " + "; ".join(errors)
    )


def _logs_to_stderr() -> None:
    """NIXL's logger writes to stdout, which belongs to data (--json); move it to stderr."""
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def memory_type(device_type: str) -> str:
    return "DRAM" if device_type == "cpu" else "VRAM"


class NixlHandle(TransferHandle):
    def __init__(self, transport: NixlTransport, handle: Any, peer: Peer) -> None:
        self.transport, self.handle, self.peer = transport, handle, peer
        self.finished = False

    def done(self) -> bool:
        if self.finished:
            return True
        state = self.transport.agent.check_xfer_state(self.handle)
        if state == "PROC":
            return False
        self.transport.agent.release_xfer_handle(self.handle)
        self.finished = True
        if state != "DONE":
            raise TransportError(
                f"{self.transport.config.name}: NIXL write to {self.peer.label} ended in {state}"
            )
        return True

    def timeout_message(self, timeout: float) -> str:
        name = self.transport.config.name
        return f"{name}: NIXL write to {self.peer.label} did not complete within {timeout:g} s"


class NixlDescription(TypedDict):
    """What a peer needs to add this endpoint's agent (`Transport.describe`)."""

    agent: str
    metadata: str  # the agent's metadata, base64


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        api = import_nixl()
        self.agent_name = f"{config.name}/{uuid.uuid4().hex[:8]}"
        try:
            # NIXL's own progress thread spins on a core even when idle (a whole core
            # per process on a CPU box). Instead a pump thread polls for notifications
            # every PUMP_S, which also progresses the backend (over UCX's TCP transport
            # the target side must progress for a write to land).
            agent_config = api.nixl_agent_config(
                enable_prog_thread=False,
                backends=[config.nixl_backend],
                # sender and receiver threads share the agent
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            )
            self.agent = api.nixl_agent(self.agent_name, agent_config)
        except Exception as exc:  # NIXL raises its own exception types
            raise TransportError(
                f"{config.name}: NIXL could not start a {config.nixl_backend} agent: {exc}"
            ) from None
        self.peer_names: dict[str, str] = {}  # NIXL agent name -> pdctl peer name
        self.reg_descs: dict[int, Any] = {}
        self._pump_stop = threading.Event()
        self._pump: threading.Thread | None = threading.Thread(
            target=self._run_pump, name=f"pdctl-nixl-pump-{config.name}", daemon=True
        )
        self._pump.start()

    PUMP_S = 0.0005

    def _run_pump(self) -> None:
        while not self._pump_stop.wait(self.PUMP_S):
            try:
                self._poll()
            except Exception:  # the agent is closing; the next wait reports real errors
                if self._pump_stop.is_set():
                    return

    def _register(self, region: MemoryRegion) -> None:
        try:
            descs = self.agent.register_memory(
                [(region.ptr, region.length, region.device_index or 0, "")],
                memory_type(region.device_type),
            )
        except Exception as exc:
            raise RegistrationError(
                f"{self.config.name}: NIXL refused to register {region.length} bytes: {exc}"
            ) from None
        if descs is None:
            raise RegistrationError(
                f"{self.config.name}: NIXL returned no registration for {region.ptr:#x}"
            )
        self.reg_descs[region.ptr] = descs

    def _deregister(self, region: MemoryRegion) -> None:
        descs = self.reg_descs.pop(region.ptr, None)
        if descs is not None:
            self.agent.deregister_memory(descs)

    def _describe(self) -> NixlDescription:
        metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        return NixlDescription(agent=self.agent_name, metadata=metadata)

    def _connect(self, name: str, regions: list[MemoryRegion], info: dict[str, Any]) -> Peer:
        try:
            metadata = base64.b64decode(str(info["metadata"]), validate=True)
            remote = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise PeerUnreachable(
                f"{self.config.name}: cannot add NIXL peer {name}: {exc}"
            ) from None
        if remote is None:
            raise PeerUnreachable(f"{self.config.name}: NIXL rejected the metadata of {name}")
        remote_name = remote.decode() if isinstance(remote, bytes) else str(remote)
        self.peer_names[remote_name] = name
        return Peer(name, f"nixl:{remote_name}", regions, {"agent": remote_name})

    def _write_async(self, peer: Peer, descriptors: Descriptors, notify: Notice) -> TransferHandle:
        message = notice_bytes(notify)  # NIXL sends it with the transfer
        src, dst, lengths = descriptors
        found = self.located(peer, src, dst, lengths)  # the check's lookups, not made again
        local = self._xfer_list(found.mine, found.sources, src, lengths)
        remote = self._xfer_list(found.theirs, found.targets, dst, lengths)
        if local is None or remote is None:
            raise TransportError(
                f"{self.config.name}: NIXL could not describe the write to {peer.label}"
            )
        try:
            handle = self.agent.initialize_xfer(
                "WRITE", local, remote, peer.state["agent"], message or b""
            )
            if handle is None:
                raise TransportError("no transfer handle")
            if self.agent.transfer(handle) == "ERR":
                self.agent.release_xfer_handle(handle)
                raise TransportError("the transfer was refused")
        except TransportError as exc:
            raise TransportError(
                f"{self.config.name}: NIXL write to {peer.label} failed: {exc}"
            ) from None
        except Exception as exc:
            raise TransportError(
                f"{self.config.name}: NIXL write to {peer.label} failed: {exc}"
            ) from None
        return NixlHandle(self, handle, peer)

    def _xfer_list(
        self, index: RegionIndex, found: np.ndarray, addresses: np.ndarray, lengths: np.ndarray
    ) -> Any:
        """One side of a write as NIXL's descriptor list: rows of (address, length, the
        device of the region holding it), as one numpy array (a list for a few). A page
        write carries thousands of ranges; looked up and described one by one in
        Python they cost milliseconds a write, more than NIXL's copy of them."""
        few = len(found) <= SMALL_LOOKUP  # numpy's per-call cost would dominate
        held = found.tolist() if few else np.unique(found).tolist()
        regions = {i: index.regions[i] for i in held}
        kinds = {region.device_type for region in regions.values()}
        if len(kinds) != 1:
            raise TransportError(
                f"{self.config.name}: one NIXL write cannot mix host and device memory"
            )
        kind = memory_type(kinds.pop())
        if few:
            rows = [
                (address, length, regions[i].device_index or 0)
                for address, length, i in zip(
                    addresses.tolist(), lengths.tolist(), held, strict=True
                )
            ]
            return self.agent.get_xfer_descs(rows, kind)
        devices = np.zeros(len(index.regions), dtype=np.uint64)
        devices[held] = [region.device_index or 0 for region in regions.values()]
        return self.agent.get_xfer_descs(np.stack((addresses, lengths, devices[found]), 1), kind)

    def _poll(self) -> None:
        for agent, messages in self.agent.get_new_notifs().items():
            peer = self.peer_names.get(agent, agent.rsplit("/", 1)[0])
            for message in messages:
                self.deliver(Notification(peer, bytes(message)))

    def _close(self) -> None:
        self._pump_stop.set()
        if self._pump is not None and self._pump is not threading.current_thread():
            self._pump.join(timeout=1.0)
        for remote in list(self.peer_names):
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(remote)
        time.sleep(0)  # NIXL releases its threads when the agent is collected
