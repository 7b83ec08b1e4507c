"""The builtin transport: TCP between hosts, a direct memory write within one host.

No extra dependency. Each endpoint listens on its port; a writer opens
authenticated connections to a peer (a small pool, so several threads can write to
one peer at once). Within one host, host memory goes straight into the peer's
memory when the kernel allows `process_vm_writev` (probed per connection, see
`fastpath.py`), and device memory goes device to device through the device's own
IPC (`device_ipc.py`: CUDA IPC; the peer's allocations are opened once, when it
connects), scattered pages in one launch (`kernels/ranges.py`). Then a write is
the copy alone (it completes when the bytes are in the peer's memory; a pidfd shows
at once a peer that exited), and only its notification travels over TCP, after the
bytes and unacknowledged. Otherwise every byte goes over the socket
into the peer's registered memory, device memory staged through host memory.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import queue
import secrets
import select
import socket
import threading
from collections.abc import Callable
from typing import Any, TypedDict, cast

import numpy as np

from pdctl.staging import device as dev
from pdctl.staging.descriptors import U64_MASK
from pdctl.staging.transport import device_ipc, fastpath, wire
from pdctl.staging.transport.base import (
    Descriptors,
    MemoryRegion,
    Notice,
    Peer,
    PeerUnreachable,
    TransferHandle,
    Transport,
    TransportConfig,
    TransportError,
    notice_bytes,
)
from pdctl.staging.transport.pool import WritePool
from pdctl.staging.transport.tcp_server import Listener, RegionTable

MAX_CONNECTIONS_PER_PEER = 8


class TcpDescription(TypedDict):
    """What a peer needs to reach this endpoint, besides the regions (`Transport.describe`)."""

    host: str
    port: int
    host_id: str  # peers with the same write here directly (`fastpath`)
    device_ipc: dict[str, device_ipc.IpcHandle]  # region address -> its device IPC handle


def _used(found: np.ndarray) -> list[int]:
    """The distinct region indices among `found` (all located: the write was checked)."""
    if len(found) <= 8:
        return list(set(found.tolist()))
    return np.flatnonzero(np.bincount(found)).tolist()


class Connection:
    """One authenticated socket to a peer, used by one writer at a time."""

    def __init__(self, transport: TcpTransport, peer: Peer) -> None:
        host, port = peer.state["host"], peer.state["port"]
        config = transport.config
        try:
            self.sock = socket.create_connection((host, port), timeout=config.connect_timeout_s)
        except OSError as exc:
            raise PeerUnreachable(f"{config.name}: cannot connect to {peer.label}: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(config.transfer_timeout_s)
        self.peer = peer
        self.sync_ids = itertools.count(1)
        try:
            self._handshake(config)
        except (OSError, wire.ProtocolError) as exc:
            self.sock.close()
            raise PeerUnreachable(
                f"{config.name}: handshake with {peer.label} failed: {exc}"
            ) from None

    def _handshake(self, config: TransportConfig) -> None:
        kind, _, _, nonce = wire.recv_frame(self.sock)
        if kind != wire.CHALLENGE:
            raise wire.ProtocolError("expected CHALLENGE")
        hello = {"name": config.name, "mac": wire.mac(config.secret, nonce, config.name)}
        wire.send_frame(self.sock, wire.HELLO, payload=json.dumps(hello).encode())
        kind, _, _, payload = wire.recv_frame(self.sock)
        if kind == wire.ERROR:
            raise wire.ProtocolError(payload.decode(errors="replace"))
        if kind != wire.WELCOME:
            raise wire.ProtocolError("expected WELCOME")
        self.welcome = wire.json_payload(payload)

    def expect(self, kind: int) -> tuple[int, int]:
        got, a, b, payload = wire.recv_frame(self.sock)
        if got == wire.ERROR:
            raise TransportError(f"{self.peer.label} refused: {payload.decode(errors='replace')}")
        if got != kind:
            raise wire.ProtocolError(f"expected frame {kind}, got {got}")
        return a, b

    def probe_fast_path(self) -> int | None:
        """The peer's pid if this process can write into it directly, else None."""
        if not fastpath.available() or self.welcome.get("host_id") != fastpath.host_id():
            return None
        wire.send_frame(self.sock, wire.PROBE)
        pid, address = self.expect(wire.PROBE_AT)
        token = secrets.token_bytes(16)
        source = ctypes.create_string_buffer(token, 16)
        one = np.ones(1, dtype=np.uint64)
        try:
            fastpath.write(pid, one * ctypes.addressof(source), one * address, one * 16)
        except OSError:
            return None
        wire.send_frame(self.sock, wire.CHECK, payload=token)
        ok, _ = self.expect(wire.ACK)
        return pid if ok == 1 else None

    def close(self) -> None:
        self.sock.close()


class TcpTransport(Transport):
    name = "tcp"
    RINGS_BELLS = True
    LATE_NOTICE = True  # a same-host write makes its notification after the copy

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        self.table = RegionTable()
        self.listener = Listener(config, self.table, self.deliver)
        self.pool = WritePool("tcp")
        self.ipc_handles: dict[int, device_ipc.IpcHandle] = {}  # region ptr -> its IPC handle
        self.mapped = device_ipc.Mapped()  # peers' device allocations opened here
        self._copy_streams: dict[str, Any] = {}  # device -> the stream device writes run on
        self._pools: dict[str, queue.LifoQueue[Connection]] = {}
        self._pool_sizes: dict[str, int] = {}
        self._pool_lock = threading.Lock()
        self._pidfds: dict[int, int | None] = {}  # same-host peer pid -> its pidfd

    @property
    def port(self) -> int:
        return self.listener.port

    # -- registration and description ------------------------------------------------
    def _register(self, region: MemoryRegion) -> None:
        self.table.add(region, None)

    def register_tensor(self, tensor: Any) -> MemoryRegion:
        region = super().register_tensor(tensor)
        self.table.add(region, self.tensors[region.ptr])
        if self.config.same_host_fast_path:
            handle = device_ipc.export(tensor)
            if handle is not None:
                self.ipc_handles[region.ptr] = handle
        return region

    def _deregister(self, region: MemoryRegion) -> None:
        self.ipc_handles.pop(region.ptr, None)
        self.table.remove(region, self.config.transfer_timeout_s)

    def _describe(self) -> TcpDescription:
        ipc = {str(ptr): handle for ptr, handle in self.ipc_handles.items()}
        host, host_id = self.config.host, fastpath.host_id()
        return TcpDescription(host=host, port=self.port, host_id=host_id, device_ipc=ipc)

    # -- connections -------------------------------------------------------------
    def _connect(self, name: str, regions: list[MemoryRegion], info: dict[str, Any]) -> Peer:
        try:
            host, port = str(info["host"]), int(info["port"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerUnreachable(f"{self.config.name}: bad tcp description: {exc}") from None
        peer = Peer(name, f"{host}:{port}", regions, {"host": host, "port": port})
        connection = Connection(self, peer)  # proves the peer is there and we are allowed in
        fast = self.config.same_host_fast_path
        peer.state["pid"] = connection.probe_fast_path() if fast else None
        mapped = self._open_device_regions(info, regions) if fast else {}
        peer.state["device"] = mapped
        peer.state["device_shift"] = np.array(  # each peer region's address here, as a shift
            [
                (mapped[r.ptr].data_ptr() - r.ptr) & U64_MASK if r.ptr in mapped else 0
                for r in peer.index.regions
            ],
            dtype=np.uint64,
        )
        same_host = connection.welcome.get("host_id") == fastpath.host_id()
        if fast and same_host and (mapped or peer.state["pid"] is not None):
            peer.state["pidfd"] = self._pidfd(int(connection.welcome.get("pid", 0)))
        self._release(peer, connection)
        return peer

    def _pidfd(self, pid: int) -> int | None:
        """A pidfd of the peer process (one per process, closed with the transport);
        None where the kernel has none, and then every write keeps its round trip."""
        with self._pool_lock:
            if pid not in self._pidfds:
                try:
                    self._pidfds[pid] = os.pidfd_open(pid) if pid > 0 else None
                except (OSError, AttributeError):
                    self._pidfds[pid] = None
            return self._pidfds[pid]

    def _open_device_regions(
        self, info: dict[str, Any], regions: list[MemoryRegion]
    ) -> dict[int, Any]:
        """The peer's device regions mapped here (ptr -> tensor), when it is on this host
        and its device is visible; an empty map keeps the staged path."""
        handles = info.get("device_ipc")
        if not isinstance(handles, dict) or info.get("host_id") != fastpath.host_id():
            return {}
        opened: dict[int, Any] = {}
        for region in regions:
            handle = handles.get(str(region.ptr))
            if not isinstance(handle, dict):
                continue
            try:  # a peer's handle, as it sent it: `open` raises where it is not one
                opened[region.ptr] = self.mapped.open(cast(device_ipc.IpcHandle, handle))
            except (RuntimeError, KeyError, TypeError, ValueError):
                return {}  # another device mask, or no IPC: every byte staged, as before
        return opened

    def fast_path(self, peer: Peer) -> bool:
        return peer.state.get("pid") is not None

    def _acquire(self, peer: Peer) -> Connection:
        with self._pool_lock:
            pool = self._pools.setdefault(peer.address, queue.LifoQueue())
            try:
                return pool.get_nowait()
            except queue.Empty:
                pass
            grow = self._pool_sizes.get(peer.address, 0) < MAX_CONNECTIONS_PER_PEER
            if grow:
                self._pool_sizes[peer.address] = self._pool_sizes.get(peer.address, 0) + 1
        if grow:
            try:
                return Connection(self, peer)
            except PeerUnreachable:
                self._shrink(peer)
                raise
        try:
            return pool.get(timeout=self.config.transfer_timeout_s)
        except queue.Empty:
            raise TransportError(
                f"{self.config.name}: every connection to {peer.label} is busy"
            ) from None

    def _release(self, peer: Peer, connection: Connection) -> None:
        with self._pool_lock:
            self._pools.setdefault(peer.address, queue.LifoQueue()).put(connection)
            self._pool_sizes.setdefault(peer.address, 1)

    def _shrink(self, peer: Peer) -> None:
        with self._pool_lock:
            self._pool_sizes[peer.address] = max(0, self._pool_sizes.get(peer.address, 1) - 1)

    # -- writes ------------------------------------------------------------------
    def _write_async(self, peer: Peer, descriptors: Descriptors, notify: Notice) -> TransferHandle:
        return self.pool.submit(peer, lambda: self._write(peer, descriptors, notify))

    def _write_sync(self, peer: Peer, descriptors: Descriptors, notify: Notice) -> None:
        self._write(peer, descriptors, notify)  # inline: socket timeouts bound every wait

    def _write(self, peer: Peer, descriptors: Descriptors, notify: Notice) -> None:
        route = self._route(peer, descriptors)
        if route is not None and peer.state.get("pidfd") is not None:
            # Same host: the copy itself completes the write (the bytes are in the peer's
            # memory when it returns). A notification follows on TCP, in order after the
            # bytes, without waiting for an acknowledgement (as NIXL's do); it is made
            # after the copy, so what it needs was computed beside it.
            self._check_alive(peer)
            self._direct(peer, route, descriptors)
            notice = notice_bytes(notify)
            if notice is not None:
                self._on_connection(
                    peer, lambda c: wire.send_frame(c.sock, wire.NOTIFY, payload=notice)
                )
            return
        message = notice_bytes(notify)
        self._on_connection(peer, lambda c: self._send(c, peer, route, descriptors, message))

    def mapped_view(self, peer: Peer, address: int) -> Any:
        mapped: dict[int, Any] = peer.state.get("device") or {}
        if not mapped or peer.state.get("pidfd") is None:
            return None  # another host, or no device IPC: writes go through `write`
        self._check_alive(peer)
        for region in peer.index.regions:
            if region.ptr in mapped and region.ptr <= address < region.ptr + region.length:
                return mapped[region.ptr][address - region.ptr :]
        return None

    def notify(self, peer: Peer, notice: bytes) -> None:
        if self._closed:
            raise TransportError(f"{self.config.name}: the transport is closed")
        message = notice_bytes(notice)
        assert message is not None
        self._check_alive(peer)
        self._on_connection(peer, lambda c: wire.send_frame(c.sock, wire.NOTIFY, payload=message))

    def _on_connection(self, peer: Peer, action: Callable[[Connection], None]) -> None:
        """`action` on a pooled connection to `peer`; a connection that failed is closed."""
        connection = self._acquire(peer)
        try:
            action(connection)
        except (OSError, wire.ProtocolError) as exc:
            connection.close()
            self._shrink(peer)
            raise TransportError(
                f"{self.config.name}: write to {peer.label} failed: {exc}"
            ) from None
        except BaseException:
            connection.close()
            self._shrink(peer)
            raise
        self._release(peer, connection)

    def _route(self, peer: Peer, descriptors: Descriptors) -> str | None:
        """ "device" (device IPC), "host" (process_vm_writev) or None (the socket)."""
        src, dst, lengths = descriptors
        mapped: dict[int, Any] = peer.state.get("device") or {}
        pid = peer.state.get("pid")
        if not mapped and pid is None:
            return None
        found = self.located(peer, src, dst, lengths)
        sources = {found.mine.regions[i].device_type for i in _used(found.sources)}
        targets = [found.theirs.regions[i] for i in _used(found.targets)]
        if mapped and "cpu" not in sources:
            return "device" if all(t.ptr in mapped for t in targets) else None
        if pid is not None and sources == {"cpu"}:
            return "host" if all(t.device_type == "cpu" for t in targets) else None
        return None

    def _check_alive(self, peer: Peer) -> None:
        """A same-host peer that exited is an error before its pid could name another
        process (pidfd: readable once the process is gone)."""
        pidfd = peer.state.get("pidfd")
        if pidfd is None:
            return
        ready, _, _ = select.select([pidfd], [], [], 0)
        if ready:
            raise PeerUnreachable(f"{self.config.name}: {peer.label} has exited")

    def _direct(self, peer: Peer, route: str, descriptors: Descriptors) -> None:
        src, dst, lengths = descriptors
        try:
            if route == "device":
                self._device_write(peer, src, dst, lengths)
            else:
                fastpath.write(int(peer.state["pid"]), src, dst, lengths)
        except OSError as exc:
            raise TransportError(
                f"{self.config.name}: write to {peer.label} failed: {exc}"
            ) from None

    def _send(
        self,
        connection: Connection,
        peer: Peer,
        route: str | None,
        descriptors: Descriptors,
        notify: bytes | None,
    ) -> None:
        src, dst, lengths = descriptors
        sock = connection.sock
        if route is not None:  # the bytes go directly; only the notice goes by TCP
            self._check_alive(peer)
            self._direct(peer, route, descriptors)
        else:
            for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
                wire.send_frame(sock, wire.WRITE, a=d, b=n)
                self._send_bytes(sock, s, n)
        if notify is not None:
            wire.send_frame(sock, wire.NOTIFY, payload=notify)
        sync_id = next(connection.sync_ids)
        wire.send_frame(sock, wire.SYNC, a=sync_id)
        acked, _ = connection.expect(wire.ACK)
        if acked != sync_id:
            raise wire.ProtocolError(f"acknowledged {acked}, expected {sync_id}")

    def _device_write(
        self, peer: Peer, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
    ) -> None:
        """Device to device into the peer's mapped regions: a few ranges one copy each,
        many (pages, runs of pages) in one launch; synchronized before returning."""
        found = self.located(peer, src, dst, lengths)
        device = self.tensors[found.mine.regions[int(found.sources[0])].ptr].device
        stream = self._copy_stream(device)
        with dev.device_stream_context(stream):
            mapped, shift = peer.state["device"], peer.state["device_shift"]
            device_ipc.copy_located(found, lengths, self.tensors, mapped, shift, device)
        dev.synchronize_stream(stream)  # the bytes are in the peer's memory before returning

    def _copy_stream(self, device: Any) -> Any:
        """One stream per device for device writes: never queued behind this process's
        other work on the default stream (the caller synchronized what it wrote)."""
        key = str(device)
        with self._pool_lock:
            if key not in self._copy_streams:
                self._copy_streams[key] = dev.create_device_stream(device)
            return self._copy_streams[key]

    def _send_bytes(self, sock: socket.socket, address: int, length: int) -> None:
        region = next(r for r in self.regions if r.contains(address, length))
        if region.device_type == "cpu":
            sock.sendall(memoryview((ctypes.c_char * length).from_address(address)).cast("B"))
            return
        tensor = self.tensors[region.ptr]
        offset = address - region.ptr
        sock.sendall(tensor[offset : offset + length].cpu().numpy().data)

    def _close(self) -> None:
        self.listener.close()
        self.pool.shutdown()
        self.mapped.clear()
        with self._pool_lock:
            pools = list(self._pools.values())
            self._pools.clear()
            for pidfd in self._pidfds.values():
                if pidfd is not None:
                    os.close(pidfd)
            self._pidfds.clear()
        for pool in pools:
            while not pool.empty():
                pool.get_nowait().close()
