"""The receiving side of the builtin TCP transport: listener and per-connection handlers.

Each accepted connection is authenticated (HMAC of a fresh nonce with the per-run
secret), then serves frames in order: writes land in registered memory only (a
destination outside every registered region is an error that closes the
connection), notifications are queued after the bytes before them, SYNC is
answered once everything before it is done. A region being written cannot be
deregistered until the write ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import json
import os
import secrets
import socket
import threading
from collections import Counter
from collections.abc import Callable

import torch

from pdctl.staging.transport import fastpath, wire
from pdctl.staging.transport.base import MemoryRegion, Notification, TransportConfig

RECV_CHUNK = 4 << 20


class RegionTable:
    """Registered regions plus in-flight counts, so deregistration waits for writers."""

    def __init__(self) -> None:
        self.regions: dict[int, MemoryRegion] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        self._busy: Counter[int] = Counter()
        self._idle = threading.Condition()

    def add(self, region: MemoryRegion, tensor: torch.Tensor | None) -> None:
        with self._idle:
            self.regions[region.ptr] = region
            if tensor is not None:
                self.tensors[region.ptr] = tensor

    def remove(self, region: MemoryRegion, timeout: float) -> None:
        with self._idle:
            self.regions.pop(region.ptr, None)
            self.tensors.pop(region.ptr, None)
            self._idle.wait_for(lambda: self._busy[region.ptr] == 0, timeout)

    def acquire(self, ptr: int, length: int) -> MemoryRegion | None:
        with self._idle:
            for region in self.regions.values():
                if region.contains(ptr, length):
                    self._busy[region.ptr] += 1
                    return region
        return None

    def release(self, region: MemoryRegion) -> None:
        with self._idle:
            self._busy[region.ptr] -= 1
            self._idle.notify_all()


class Listener:
    """Accepts peers and runs one handler thread per connection."""

    def __init__(
        self, config: TransportConfig, table: RegionTable, deliver: Callable[[Notification], None]
    ) -> None:
        """Listens on the config's host and port (0: a free one); a handshake is bounded by
        its connect timeout, and peers prove they hold its secret."""
        self.name, self.secret = config.name, config.secret
        self.table, self.deliver = table, deliver
        self.timeout = config.connect_timeout_s
        self.sock = socket.create_server((config.host, config.port), reuse_port=False)
        self.sock.settimeout(0.25)
        self.port = self.sock.getsockname()[1]
        self.probe = ctypes.create_string_buffer(16)  # the fast-path probe cell
        self.closed = threading.Event()
        self.connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.thread = threading.Thread(
            target=self._accept_loop, name=f"pdctl-tcp-accept-{self.port}", daemon=True
        )
        self.thread.start()

    def _accept_loop(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="pdctl-tcp-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        peer = "?"
        try:
            conn.settimeout(self.timeout)
            peer = self._handshake(conn)
            conn.settimeout(None)  # idle connections stay open; writes are bounded by the sender
            while not self.closed.is_set():
                self._handle(conn, peer, *wire.recv_frame(conn))
        except (ConnectionError, OSError, wire.ProtocolError) as exc:
            if isinstance(exc, wire.ProtocolError):
                self._error(conn, f"{self.name}: {exc}")
        finally:
            with self._lock:
                self.connections.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> str:
        nonce = secrets.token_bytes(16)
        wire.send_frame(conn, wire.CHALLENGE, payload=nonce)
        kind, _, _, payload = wire.recv_frame(conn)
        if kind != wire.HELLO:
            raise wire.ProtocolError("expected HELLO")
        hello = wire.json_payload(payload)
        peer = str(hello.get("name", "?"))[:200]
        if not hmac.compare_digest(str(hello.get("mac", "")), wire.mac(self.secret, nonce, peer)):
            self._error(conn, f"{self.name}: authentication failed (wrong per-run secret)")
            raise ConnectionError(f"rejected {peer}: bad credentials")
        welcome = {"name": self.name, "pid": os.getpid(), "host_id": fastpath.host_id()}
        wire.send_frame(conn, wire.WELCOME, payload=json.dumps(welcome).encode())
        return peer

    def _handle(
        self, conn: socket.socket, peer: str, kind: int, a: int, b: int, payload: bytes
    ) -> None:
        if kind == wire.WRITE:
            self._receive(conn, a, b)
        elif kind == wire.NOTIFY:
            self.deliver(Notification(peer, payload))
        elif kind == wire.SYNC:
            wire.send_frame(conn, wire.ACK, a=a)
        elif kind == wire.PROBE:
            self.probe.raw = b"\0" * 16
            wire.send_frame(conn, wire.PROBE_AT, a=os.getpid(), b=ctypes.addressof(self.probe))
        elif kind == wire.CHECK:
            wire.send_frame(conn, wire.ACK, a=int(hmac.compare_digest(self.probe.raw, payload)))
        else:
            raise wire.ProtocolError(f"unexpected frame kind {kind}")

    def _receive(self, conn: socket.socket, address: int, length: int) -> None:
        region = self.table.acquire(address, length)
        if region is None:
            raise wire.ProtocolError(
                f"write to [{address:#x}, +{length}) outside registered memory"
            )
        try:
            if region.device_type == "cpu":
                view = memoryview((ctypes.c_char * length).from_address(address)).cast("B")
                wire.recv_into_exact(conn, view)
            else:  # device memory: through a host buffer, then one copy to the device
                tensor = self.table.tensors[region.ptr]
                offset = address - region.ptr
                host = torch.empty(min(length, RECV_CHUNK), dtype=torch.uint8)
                for start in range(0, length, RECV_CHUNK):
                    count = min(RECV_CHUNK, length - start)
                    wire.recv_into_exact(conn, memoryview(host.numpy().data)[:count])
                    tensor[offset + start : offset + start + count].copy_(host[:count])
        finally:
            self.table.release(region)

    def _error(self, conn: socket.socket, message: str) -> None:
        with contextlib.suppress(OSError):
            wire.send_frame(conn, wire.ERROR, payload=message.encode()[: wire.MAX_AUX])

    def close(self) -> None:
        self.closed.set()
        self.sock.close()
        with self._lock:
            for conn in list(self.connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=2)
