"""Every transport, cross-process on loopback: bytes arrive exactly, notifications follow."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

from pdctl.staging.transport import BadDescriptor, PeerUnreachable, TransportError
from pdctl.staging.transport.peer import PeerProcess
from tests.staging.transport.conftest import SECRET, make_writer


def sha(data: np.ndarray) -> str:
    return hashlib.sha256(data.tobytes()).hexdigest()


@pytest.mark.parametrize("size", [1, 4096, (1 << 20) + 3, 64 << 20, 256 << 20])
def test_single_ranges_from_one_byte_to_256_mib(writer, peer, source, size) -> None:
    connection = writer.connect(peer.description)
    offset = 4096 - (size % 4096) if size < 4096 else 0
    writer.write(connection, [source.ctypes.data + 7], [peer.base + offset], [size])
    assert peer.sha256(offset, size) == sha(source[7 : 7 + size])


def test_many_small_descriptors_scattered(writer, peer, source) -> None:
    connection = writer.connect(peer.description)
    rng = np.random.default_rng(1)
    slots = rng.permutation(2048)[:1024]
    src = source.ctypes.data + np.arange(1024, dtype=np.uint64) * 4096
    dst = peer.base + slots.astype(np.uint64) * 4096
    peer.command(cmd="fill", value=0)
    writer.write(connection, src, dst, np.full(1024, 4096, dtype=np.uint64), notify=b"batch-1")
    assert "peer" in peer.wait_notification(b"batch-1", 5)
    expected = np.zeros(2048 * 4096, dtype=np.uint8)
    for i, slot in enumerate(slots.tolist()):
        expected[slot * 4096 : (slot + 1) * 4096] = source[i * 4096 : (i + 1) * 4096]
    assert peer.sha256(0, 2048 * 4096) == sha(expected)


def test_page_writes_from_many_registered_buffers(writer, peer) -> None:
    """As a request's KV pages go: ranges from two dozen registrations (a pool's layer
    buffers), interleaved, to scattered places in the peer; every byte lands."""
    connection = writer.connect(peer.description)
    rng = np.random.default_rng(2)
    layers = [rng.integers(0, 256, 64 * 1024, dtype=np.uint8) for _ in range(24)]
    regions = [writer.register(layer.ctypes.data, layer.nbytes) for layer in layers]
    try:
        pieces = [(layer, page) for page in range(16) for layer in range(24)]  # 384 ranges
        slots = rng.permutation(2048)[: len(pieces)]
        src = np.array([layers[i].ctypes.data + page * 4096 for i, page in pieces], np.uint64)
        dst = peer.base + slots.astype(np.uint64) * 4096
        peer.command(cmd="fill", value=0)
        lengths = np.full(len(pieces), 4096, dtype=np.uint64)
        writer.write(connection, src, dst, lengths, notify=b"layers")
        assert "peer" in peer.wait_notification(b"layers", 5)
        expected = np.zeros(2048 * 4096, dtype=np.uint8)
        for (i, page), slot in zip(pieces, slots.tolist(), strict=True):
            expected[slot * 4096 : (slot + 1) * 4096] = layers[i][page * 4096 : (page + 1) * 4096]
        assert peer.sha256(0, 2048 * 4096) == sha(expected)
    finally:
        for region in regions:
            writer.deregister(region)


def test_async_write_then_notification_after_the_bytes(writer, peer, source) -> None:
    connection = writer.connect(peer.description)
    handle = writer.write_async(
        connection, [source.ctypes.data], [peer.base], [32 << 20], notify=b"room-7:seg-0"
    )
    handle.wait(10)
    assert handle.done()
    reply = peer.wait_notification(b"room-7:seg-0", 5)
    assert reply["peer"] == "prefill-0"
    assert peer.sha256(0, 32 << 20) == sha(source[: 32 << 20])


def test_a_notification_made_by_a_function_is_made_once_after_the_write_began(
    writer, peer, source
) -> None:
    """The builtin transport makes it after its same-host copy; others before sending."""
    connection = writer.connect(peer.description)
    calls: list[int] = []

    def made() -> bytes:
        calls.append(1)
        return b"made-%d" % len(calls)

    peer.command(cmd="fill", value=0)
    writer.write(connection, [source.ctypes.data], [peer.base], [1 << 20], notify=made)
    assert calls == [1]
    assert "peer" in peer.wait_notification(b"made-1", 5)
    assert peer.sha256(0, 1 << 20) == sha(source[: 1 << 20])
    too_long = b"x" * (64 * 1024 + 1)
    with pytest.raises(BadDescriptor, match="at most"):
        writer.write(connection, [source.ctypes.data], [peer.base], [16], notify=lambda: too_long)
    writer.write(connection, [source.ctypes.data], [peer.base], [16], notify=made)  # still works
    assert "peer" in peer.wait_notification(b"made-2", 5)


def test_concurrent_writers_to_one_peer(writer, peer, source) -> None:
    connection = writer.connect(peer.description)
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            start = index * (8 << 20)
            writer.write(
                connection,
                [source.ctypes.data + start],
                [peer.base + start],
                [8 << 20],
                notify=b"t%d" % index,
            )
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    for index in range(6):
        assert "peer" in peer.wait_notification(b"t%d" % index, 5)
    assert peer.sha256(0, 48 << 20) == sha(source[: 48 << 20])


def test_unregistered_source_is_a_clear_error(writer, peer) -> None:
    connection = writer.connect(peer.description)
    stray = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(BadDescriptor, match="not in registered memory"):
        writer.write(connection, [stray.ctypes.data], [peer.base], [4096])


def test_destination_outside_the_peers_memory_is_a_clear_error(writer, peer, source) -> None:
    connection = writer.connect(peer.description)
    with pytest.raises(BadDescriptor, match=r"outside the memory decode-0 .* registered"):
        writer.write(connection, [source.ctypes.data], [peer.base + (300 << 20)], [4096])


@pytest.mark.parametrize(
    ("src", "dst", "lengths", "message"),
    [
        ([1, 2], [1], [1, 1], "one entry per write"),
        ([], [], [], "at least one descriptor"),
        ([1], [1], [0], "length 0"),
        (["x"], [1], [1], "unsigned 64-bit integers"),
    ],
)
def test_bad_descriptors(writer, peer, src, dst, lengths, message) -> None:
    connection = writer.connect(peer.description)
    with pytest.raises(BadDescriptor, match=message):
        writer.write(connection, src, dst, lengths)


@pytest.mark.parametrize(
    ("description", "message"),
    [
        (b"not json", "bad peer description"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"transport": "other", "name": "x"}', "'other' description"),
    ],
)
def test_wrong_peer_description(writer, description, message) -> None:
    with pytest.raises(PeerUnreachable, match=message):
        writer.connect(description)


def test_peer_killed_mid_transfer_fails_within_the_timeout(backend, source) -> None:
    writer = make_writer(backend, name="prefill-9")
    writer.register(source.ctypes.data, source.nbytes)
    try:
        with PeerProcess(
            backend[0], 256 << 20, name="decode-9", fast_path=backend[1], secret=SECRET, timeout=5
        ) as peer:
            connection = writer.connect(peer.description)
            writer.write(connection, [source.ctypes.data], [peer.base], [1 << 20])  # warm
            handle = writer.write_async(
                connection, [source.ctypes.data], [peer.base], [256 << 20], notify=b"x"
            )
            peer.kill()
            started = time.monotonic()
            with pytest.raises(TransportError, match="decode-9"):
                handle.wait(writer.config.transfer_timeout_s)  # the in-flight write, or
                writer.write(
                    connection, [source.ctypes.data], [peer.base], [1 << 20]
                )  # the next one
            assert time.monotonic() - started < writer.config.transfer_timeout_s + 3
    finally:
        writer.close()


def test_every_transport_accepts_slot_layer_ids(backend) -> None:
    import torch

    writer = make_writer(backend, name="decode-kv")
    try:
        k = [torch.zeros(64, 2, 8) for _ in range(2)]
        v = [torch.zeros(64, 2, 8) for _ in range(2)]
        regions = writer.set_kv_buffer_tensors(k, v, 16, slot_layer_ids=[0, 1])
        assert writer.kv_layout is not None
        assert len(regions) == 4 and writer.kv_layout.slot_layer_ids == [0, 1]
        assert writer.kv_layout.page_size == 16
    finally:
        writer.close()
