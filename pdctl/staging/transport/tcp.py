"""The builtin transport: TCP between hosts, a direct memory write within one host.

No extra dependency. Each endpoint listens on its port; a writer opens
authenticated connections to a peer (a small pool, so several threads can write to
one peer at once). Within one host, when the kernel allows `process_vm_writev`
(probed per connection, see `fastpath.py`), bytes go straight into the peer's
memory and only the notification and the completion travel over TCP; otherwise
every byte goes over the socket into the peer's registered memory. Device memory
is staged through host memory on both sides.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import queue
import secrets
import socket
import threading
from typing import Any

import numpy as np

from pdctl.staging.transport import fastpath, wire
from pdctl.staging.transport.base import (
    Descriptors,
    MemoryRegion,
    Peer,
    PeerUnreachable,
    TransferHandle,
    Transport,
    TransportConfig,
    TransportError,
)
from pdctl.staging.transport.pool import WritePool
from pdctl.staging.transport.tcp_server import Listener, RegionTable

MAX_CONNECTIONS_PER_PEER = 8


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

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        self.table = RegionTable()
        self.listener = Listener(
            config.name, config.host, config.port, config.secret, self.table, self.deliver,
            config.connect_timeout_s,
        )  # fmt: skip
        self.pool = WritePool("tcp")
        self._pools: dict[str, queue.LifoQueue[Connection]] = {}
        self._pool_sizes: dict[str, int] = {}
        self._pool_lock = threading.Lock()

    @property
    def port(self) -> int:
        return self.listener.port

    # -- registration and description ------------------------------------------------
    def _register(self, region: MemoryRegion) -> None:
        self.table.add(region, None)

    def register_tensor(self, tensor: Any) -> MemoryRegion:
        region = super().register_tensor(tensor)
        self.table.add(region, self.tensors[region.ptr])
        return region

    def _deregister(self, region: MemoryRegion) -> None:
        self.table.remove(region, self.config.transfer_timeout_s)

    def _describe(self) -> dict[str, Any]:
        return {"host": self.config.host, "port": self.port, "host_id": fastpath.host_id()}

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
        self._release(peer, connection)
        return peer

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
    def _write_async(
        self, peer: Peer, descriptors: Descriptors, notify: bytes | None
    ) -> TransferHandle:
        return self.pool.submit(peer, lambda: self._write(peer, descriptors, notify))

    def _write_sync(self, peer: Peer, descriptors: Descriptors, notify: bytes | None) -> None:
        self._write(peer, descriptors, notify)  # inline: socket timeouts bound every wait

    def _write(self, peer: Peer, descriptors: Descriptors, notify: bytes | None) -> None:
        connection = self._acquire(peer)
        try:
            self._send(connection, peer, descriptors, notify)
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

    def _send(
        self, connection: Connection, peer: Peer, descriptors: Descriptors, notify: bytes | None
    ) -> None:
        src, dst, lengths = descriptors
        sock = connection.sock
        pid = peer.state.get("pid")
        if (
            isinstance(pid, int)
            and self._host_memory(src, lengths)
            and self._peer_host_memory(peer, dst, lengths)
        ):
            fastpath.write(pid, src, dst, lengths)
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

    def _send_bytes(self, sock: socket.socket, address: int, length: int) -> None:
        region = next(r for r in self.regions if r.contains(address, length))
        if region.device_type == "cpu":
            sock.sendall(memoryview((ctypes.c_char * length).from_address(address)).cast("B"))
            return
        tensor = self.tensors[region.ptr]
        offset = address - region.ptr
        sock.sendall(tensor[offset : offset + length].cpu().numpy().data)

    def _host_memory(self, ptrs: np.ndarray, lengths: np.ndarray) -> bool:
        return all(
            next(r for r in self.regions if r.contains(p, n)).device_type == "cpu"
            for p, n in zip(ptrs.tolist(), lengths.tolist(), strict=True)
        )

    @staticmethod
    def _peer_host_memory(peer: Peer, ptrs: np.ndarray, lengths: np.ndarray) -> bool:
        return all(
            next(r for r in peer.regions if r.contains(p, n)).device_type == "cpu"
            for p, n in zip(ptrs.tolist(), lengths.tolist(), strict=True)
        )

    def _close(self) -> None:
        self.listener.close()
        self.pool.shutdown()
        with self._pool_lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            while not pool.empty():
                pool.get_nowait().close()
