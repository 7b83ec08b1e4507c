"""Builtin TCP transport specifics: authentication, hostile frames, the same-host path."""

from __future__ import annotations

import hashlib
import json
import socket
import time

import numpy as np
import pytest

from pdctl.staging.transport import PeerUnreachable, TransportConfig, create_transport, wire
from pdctl.staging.transport.peer import PeerProcess
from tests.staging.transport.conftest import SECRET


@pytest.fixture
def receiver():
    transport = create_transport("tcp", TransportConfig("decode-0", secret=SECRET))
    buffer = np.zeros(1 << 20, dtype=np.uint8)
    transport.register(buffer.ctypes.data, buffer.nbytes)
    yield transport, buffer
    transport.close()


def test_wrong_secret_is_rejected_with_a_clear_error(receiver) -> None:
    transport, _ = receiver
    intruder = create_transport("tcp", TransportConfig("intruder", secret=b"guess"))
    try:
        with pytest.raises(PeerUnreachable, match="authentication failed"):
            intruder.connect(transport.describe())
    finally:
        intruder.close()


def test_unreachable_peer_fails_within_the_connect_timeout() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    writer = create_transport("tcp", TransportConfig("prefill-0", connect_timeout_s=2))
    description = json.dumps(
        {"transport": "tcp", "name": "decode-3", "host": "127.0.0.1", "port": port, "regions": []}
    ).encode()
    started = time.monotonic()
    try:
        with pytest.raises(PeerUnreachable, match=r"cannot connect to decode-3 \(127.0.0.1:"):
            writer.connect(description)
    finally:
        writer.close()
    assert time.monotonic() - started < 3


def _authenticated_socket(transport) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", transport.port), timeout=5)
    kind, _, _, nonce = wire.recv_frame(sock)
    assert kind == wire.CHALLENGE
    hello = {"name": "hostile", "mac": wire.mac(SECRET, nonce, "hostile")}
    wire.send_frame(sock, wire.HELLO, payload=json.dumps(hello).encode())
    assert wire.recv_frame(sock)[0] == wire.WELCOME
    return sock


def test_server_refuses_writes_outside_registered_memory(receiver) -> None:
    transport, buffer = receiver
    sock = _authenticated_socket(transport)
    wire.send_frame(sock, wire.WRITE, a=buffer.ctypes.data + buffer.nbytes - 8, b=64)
    kind, _, _, payload = wire.recv_frame(sock)
    assert kind == wire.ERROR and b"outside registered memory" in payload
    assert not buffer.any()  # nothing was written
    sock.close()


def test_server_refuses_oversized_and_unknown_frames(receiver) -> None:
    transport, _ = receiver
    sock = _authenticated_socket(transport)
    sock.sendall(wire.HEADER.pack(wire.NOTIFY, wire.MAX_AUX + 1, 0, 0))
    kind, _, _, payload = wire.recv_frame(sock)
    assert kind == wire.ERROR and b"more than" in payload
    sock.close()
    sock = _authenticated_socket(transport)
    wire.send_frame(sock, 200)
    kind, _, _, payload = wire.recv_frame(sock)
    assert kind == wire.ERROR and b"unexpected frame kind 200" in payload
    sock.close()
    # The server keeps serving after hostile clients.
    writer = create_transport("tcp", TransportConfig("prefill-0", secret=SECRET))
    try:
        data = np.full(4096, 9, dtype=np.uint8)
        writer.register(data.ctypes.data, data.nbytes)
        peer = writer.connect(transport.describe())
        writer.write(peer, [data.ctypes.data], [transport.regions[0].ptr], [4096], notify=b"ok")
        assert transport.wait_notification(b"ok", 5).peer == "prefill-0"
    finally:
        writer.close()


def test_same_host_peers_take_the_direct_path_and_others_can_opt_out() -> None:
    with PeerProcess("tcp", 1 << 20, secret=SECRET) as peer:
        fast = create_transport("tcp", TransportConfig("a", secret=SECRET))
        slow = create_transport(
            "tcp", TransportConfig("b", secret=SECRET, same_host_fast_path=False)
        )
        try:
            assert fast.connect(peer.description).state["pid"] == peer.pid
            assert slow.connect(peer.description).state["pid"] is None
        finally:
            fast.close()
            slow.close()


def test_same_host_writes_need_no_round_trip(monkeypatch) -> None:
    """The copy completes the write; a notification goes by TCP after the bytes, and the
    writer does not wait for it to be read."""
    from pdctl.staging.transport import tcp as tcp_module

    frames: list[int] = []
    real = tcp_module.wire.send_frame

    def counting(sock, kind, *args, **kwargs):  # type: ignore[no-untyped-def]
        frames.append(kind)
        return real(sock, kind, *args, **kwargs)

    with PeerProcess("tcp", 1 << 20, secret=SECRET) as peer:
        writer = create_transport("tcp", TransportConfig("nrt", secret=SECRET))
        source = np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8)
        try:
            writer.register(source.ctypes.data, source.nbytes)
            connection = writer.connect(peer.description)
            monkeypatch.setattr(tcp_module.wire, "send_frame", counting)
            writer.write(connection, [source.ctypes.data], [peer.base], [4096])
            assert frames == []  # no frame at all: the bytes are there when it returns
            assert peer.sha256(0, 4096) == hashlib.sha256(source[:4096].tobytes()).hexdigest()
            writer.write(connection, [source.ctypes.data], [peer.base], [8192], notify=b"n-1")
            assert frames == [wire.NOTIFY]  # after the bytes; nothing to wait for
            assert "peer" in peer.wait_notification(b"n-1", 5)
            assert peer.sha256(0, 8192) == hashlib.sha256(source[:8192].tobytes()).hexdigest()
        finally:
            writer.close()


def test_a_write_to_an_exited_same_host_peer_fails_at_once() -> None:
    peer = PeerProcess("tcp", 1 << 20, name="gone-peer", secret=SECRET)
    writer = create_transport("tcp", TransportConfig("w-exit", secret=SECRET))
    source = np.zeros(4096, dtype=np.uint8)
    try:
        writer.register(source.ctypes.data, source.nbytes)
        connection = writer.connect(peer.description)
        assert connection.state["pidfd"] is not None
        writer.write(connection, [source.ctypes.data], [peer.base], [4096])
        peer.kill()  # SIGKILL and reaped: its pid may be anyone's next
        with pytest.raises(PeerUnreachable, match=r"gone-peer .* has exited"):
            writer.write(connection, [source.ctypes.data], [peer.base], [4096])
    finally:
        writer.close()
        peer.close()


def test_region_lookups_never_outlive_their_write() -> None:
    """A write's lookups serve that call only: descriptors changed in place afterwards
    are checked again (a stale lookup would let a write leave registered memory)."""
    from pdctl.staging.transport import BadDescriptor

    with PeerProcess("tcp", 1 << 20, secret=SECRET) as peer:
        writer = create_transport("tcp", TransportConfig("lookups", secret=SECRET))
        source = np.zeros(8192, dtype=np.uint8)
        try:
            writer.register(source.ctypes.data, 4096)  # only the first half is registered
            connection = writer.connect(peer.description)
            src = np.array([source.ctypes.data], dtype=np.uint64)
            dst = np.array([peer.base], dtype=np.uint64)
            lengths = np.array([4096], dtype=np.uint64)
            writer.write(connection, src, dst, lengths)
            assert writer._tls.located is None  # nothing kept once the call returned
            src[0] += np.uint64(4096)  # now the unregistered half, same array object
            with pytest.raises(BadDescriptor, match="not in registered memory"):
                writer.write(connection, src, dst, lengths)
        finally:
            writer.close()
