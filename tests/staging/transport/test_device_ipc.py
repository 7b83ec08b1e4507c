"""The builtin transport's same-host device path: device to device between processes.

On the CPU: no device offers IPC here, so nothing is exported and every byte keeps
its path. On a CUDA machine (marked gpu): a peer process's device buffer is mapped
once at connect, writes are device-to-device copies (no host staging), the bytes are
checked, and without the same-host path the staged path still moves them right.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from pdctl.staging.transport import TransportConfig, create_transport, device_ipc
from pdctl.staging.transport.peer import PeerProcess

SECRET = b"device-ipc-test"
CUDA = torch.cuda.is_available()


def test_no_ipc_is_claimed_for_host_memory() -> None:
    assert device_ipc.mechanism("cpu") is None
    assert device_ipc.export(torch.zeros(16, dtype=torch.uint8)) is None
    transport = create_transport("tcp", TransportConfig("ipc-cpu", secret=SECRET))
    try:
        transport.register_tensor(torch.zeros(64, dtype=torch.uint8))
        assert json.loads(transport.describe())["device_ipc"] == {}
    finally:
        transport.close()


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
@pytest.mark.parametrize("same_host", [True, False])
def test_device_writes_between_processes_on_one_gpu(same_host: bool) -> None:
    size = 64 << 20
    generator = torch.Generator().manual_seed(5)
    source = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).cuda()
    with PeerProcess("tcp", size, device="cuda", fast_path=same_host, secret=SECRET) as peer:
        writer = create_transport(
            "tcp", TransportConfig("ipc-writer", secret=SECRET, same_host_fast_path=same_host)
        )
        try:
            writer.register_tensor(source)
            connection = writer.connect(peer.description)
            mapped = connection.state["device"]
            assert bool(mapped) is same_host  # the peer's buffer mapped here, once
            base = source.data_ptr()
            for length in (4096, 1 << 20, size):
                writer.write(connection, [base], [peer.base], [length])
                assert peer.sha256(0, length) == _sha(source[:length])
            count, each = 1024, 4096  # scattered page-sized pieces, in one write
            order = np.random.default_rng(7).permutation(count).astype(np.uint64)
            src = np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(each)
            dst = np.uint64(peer.base) + order * np.uint64(each)
            writer.write(connection, src, dst, np.full(count, each, dtype=np.uint64))
            for i, slot in enumerate(order[:32].tolist()):
                assert peer.sha256(slot * each, each) == _sha(source[i * each : (i + 1) * each])
        finally:
            writer.close()


def test_host_memory_peers_are_not_mapped() -> None:
    """A CPU peer on this host: writes keep their descriptors; there is no view to give."""
    with PeerProcess("tcp", 4096, secret=SECRET) as peer:
        writer = create_transport("tcp", TransportConfig("map-cpu", secret=SECRET))
        try:
            writer.register_tensor(torch.zeros(4096, dtype=torch.uint8))
            connection = writer.connect(peer.description)
            assert writer.mapped_view(connection, peer.base) is None
        finally:
            writer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_a_mapped_view_is_the_peers_memory_and_a_notice_follows() -> None:
    size = 8 << 20
    generator = torch.Generator().manual_seed(9)
    source = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).cuda()
    with PeerProcess("tcp", size, device="cuda", secret=SECRET) as peer:
        writer = create_transport("tcp", TransportConfig("map-writer", secret=SECRET))
        try:
            writer.register_tensor(source)
            connection = writer.connect(peer.description)
            view = writer.mapped_view(connection, peer.base + 4096)
            assert view is not None and view.numel() == size - 4096  # to its region's end
            assert writer.mapped_view(connection, peer.base + size) is None  # past the region
            view[: 1 << 20].copy_(source[: 1 << 20])
            torch.cuda.synchronize()
            writer.notify(connection, b"landed")
            assert "peer" in peer.wait_notification(b"landed", 10.0)
            assert peer.sha256(4096, 1 << 20) == _sha(source[: 1 << 20])
        finally:
            writer.close()
