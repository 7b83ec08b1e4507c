"""The builtin TCP transport's wire format: fixed binary headers, JSON handshakes.

    header (24 bytes, network order): kind u8 | pad 3 | aux u32 | a u64 | b u64

    server -> client   CHALLENGE  aux=16, then 16 random bytes
    client -> server   HELLO      aux=n, then JSON {name, mac}
                                  mac = HMAC-SHA256(secret, nonce + name)
    server -> client   WELCOME    aux=n, then JSON {name, pid, host_id}
    client -> server   WRITE      a=destination address, b=length, then `length` bytes
    client -> server   NOTIFY     aux=n, then the message
    client -> server   SYNC       a=id; the server answers ACK a=id once every earlier frame is done
    client -> server   PROBE      the server answers PROBE_AT a=pid, b=address of a 16-byte cell
    client -> server   CHECK      aux=16, then 16 bytes; ACK a=1 if the cell holds them
    server -> client   ERROR      aux=n, then a UTF-8 message; the server then closes

Sizes are bounded (`MAX_AUX`); nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
from typing import Any

HEADER = struct.Struct("!B3xIQQ")
MAX_AUX = 64 * 1024

CHALLENGE, HELLO, WELCOME, WRITE, NOTIFY, SYNC, ACK, PROBE, PROBE_AT, CHECK, ERROR = range(1, 12)


class ProtocolError(ConnectionError):
    """The peer sent something this protocol does not allow."""


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    view = memoryview(data)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:], size - received)
        if count == 0:
            raise ConnectionError("connection closed by the peer")
        received += count
    return bytes(data)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    received, size = 0, len(view)
    while received < size:
        count = sock.recv_into(view[received:], size - received)
        if count == 0:
            raise ConnectionError("connection closed by the peer mid-write")
        received += count


def send_frame(
    sock: socket.socket, kind: int, a: int = 0, b: int = 0, payload: bytes = b""
) -> None:
    if len(payload) > MAX_AUX:
        raise ProtocolError(f"frame payload of {len(payload)} bytes exceeds {MAX_AUX}")
    sock.sendall(HEADER.pack(kind, len(payload), a, b) + payload)


def recv_frame(sock: socket.socket) -> tuple[int, int, int, bytes]:
    kind, aux, a, b = HEADER.unpack(recv_exact(sock, HEADER.size))
    if aux > MAX_AUX:
        raise ProtocolError(f"frame announces {aux} bytes of payload, more than {MAX_AUX}")
    payload = recv_exact(sock, aux) if kind != WRITE and aux else b""
    return kind, a, b, payload


def mac(secret: bytes, nonce: bytes, name: str) -> str:
    return hmac.new(secret, nonce + name.encode(), hashlib.sha256).hexdigest()


def json_payload(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed handshake: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError("malformed handshake: not a JSON object")
    return value
