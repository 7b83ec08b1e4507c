"""DCP pack (Triton-only) and the encoder -> prefill embedding path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdctl.staging import dcp_pack
from pdctl.staging import device as dev
from pdctl.staging.embedding_pool import EmbeddingPool, TensorWrapper, synchronize_before_send


def test_off_cuda_dcp_returns_no_buffers_and_registers_nothing() -> None:
    calls: list = []
    for device_type in ("cpu", "xpu", "npu", "hpu:1"):
        assert (
            dcp_pack.init_dcp_pack_buffers(
                16, 64, 2, device_type=device_type, gpu_id=0, register=lambda *a: calls.append(a)
            )
            == []
        )
    assert calls == []


def test_cuda_dcp_registers_with_the_bare_device_type_and_gpu_id(monkeypatch) -> None:
    calls: list = []
    devices: list = []
    real_allocate = dcp_pack.allocate_pack
    # No GPU here: record the device the pack is meant for, allocate the bytes on the CPU.
    monkeypatch.setattr(
        dcp_pack,
        "allocate_pack",
        lambda n, d: (devices.append(d), real_allocate(n, torch.device("cpu")))[1],
    )
    (pack,) = dcp_pack.init_dcp_pack_buffers(
        16, 64, 2, device_type="cuda", gpu_id=3, register=lambda *a: calls.append(a)
    )
    assert pack.numel() == 2 * 16 * 64
    ((ptr, nbytes, device_type, gpu_id),) = calls
    assert (nbytes, device_type, gpu_id) == (2 * 16 * 64, "cuda", 3) and ptr == pack.data_ptr()
    assert devices == [torch.device("cuda", 3)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mla_rows_pack_bitwise(backend) -> None:
    layers, pool, dim = 3, 40, 72
    buffers = [torch.randn(pool, 1, dim, dtype=torch.bfloat16) for _ in range(layers)]
    rows = torch.from_numpy(dcp_pack.dcp_rows(pool, 4, 1))
    pack = torch.empty(layers * pool * dim * 2, dtype=torch.uint8)
    packed = dcp_pack.copy_mla_rows_into_pack(buffers, rows, pack, backend=backend)
    for layer in range(layers):
        expected = buffers[layer][rows].reshape(len(rows), -1).view(torch.uint8)
        assert torch.equal(packed[layer], expected)


def test_per_token_fallback_descriptors() -> None:
    src, dst, lengths = dcp_pack.per_token_descriptors(
        [1 << 63, 4096], [8192, 2**64 - 4096 * 8], np.array([0, 2]), 144
    )
    assert [int(x) for x in src] == [1 << 63, (1 << 63) + 288, 4096, 4096 + 288]
    assert int(dst[3]) == 2**64 - 4096 * 8 + 288 and set(lengths.tolist()) == {144}


def test_embedding_pool_allocates_on_the_runtime_device() -> None:
    pool = EmbeddingPool(device_type="cpu", gpu_id=0, size_bytes=4096)
    slot = pool.allocate(3, 100, torch.float32)
    view = pool.view(slot)
    assert view.shape == (3, 100) and view.device.type == "cpu"
    view.copy_(torch.arange(300, dtype=torch.float32).view(3, 100))
    assert pool.address(slot) == view.data_ptr()
    assert pool.allocate(10, 100, torch.float32) is None  # full: caller retries later
    pool.free(slot)
    assert pool.allocate(10, 100, torch.float32) is not None


def test_tensor_wrapper_round_trips_bytes() -> None:
    tensor = torch.randn(4, 5, dtype=torch.bfloat16)
    wrapper = TensorWrapper(tensor)
    back = TensorWrapper.from_bytes(wrapper.to_bytes(), torch.bfloat16, (4, 5))
    assert torch.equal(back.to("cpu").view(torch.int16), tensor.view(torch.int16))


def test_send_synchronizes_every_accelerator_but_not_the_cpu(monkeypatch) -> None:
    synced: list = []
    monkeypatch.setattr(dev, "synchronize", lambda device: synced.append(str(device)))
    synchronize_before_send(torch.ones(4))
    assert synced == []
    _, nbytes = synchronize_before_send(torch.empty(4, 8, device="meta"))
    assert synced == ["meta"] and nbytes == 128
