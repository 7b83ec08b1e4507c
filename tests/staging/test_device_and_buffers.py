"""Device helpers, staging buffers and their device_type contract."""

from __future__ import annotations

import inspect
import threading

import pytest
import torch

from pdctl.staging import device as dev
from pdctl.staging.buffer import init_staging_allocator, init_staging_buffers


def test_cpu_streams_and_events_are_correct_no_ops() -> None:
    event = dev.create_device_event("cpu")
    stream = dev.current_device_stream("cpu")
    event.record(stream)
    assert event.query()
    dev.stream_wait_event(dev.create_device_stream("cpu"), event)
    with dev.device_stream_context(stream):
        x = torch.ones(3) * 2
    dev.synchronize_stream(stream)
    dev.synchronize("cpu")
    assert x.sum().item() == 6
    assert dev.get_device_module("cpu") is torch.cpu


def test_explicit_index_wins_over_gpu_id_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="names index 3 but gpu_id is 1"):
        assert dev.resolve_device("xpu:3", 1) == torch.device("xpu", 3)
    assert dev.resolve_device("hpu", 2) == torch.device("hpu", 2)
    with pytest.raises(ValueError, match="'npu' is not known to this torch build"):
        dev.resolve_device("npu", 0)
    assert dev.resolve_device("cuda") == torch.device("cuda", 0)
    assert dev.resolve_device("cpu", 5) == torch.device("cpu")
    with pytest.raises(ValueError, match="device_type must be a device name"):
        dev.resolve_device("", 0)


@pytest.mark.parametrize("function", [init_staging_buffers, init_staging_allocator])
def test_device_type_is_required_and_keyword_only(function) -> None:
    parameter = inspect.signature(function).parameters["device_type"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    assert parameter.default is inspect.Parameter.empty
    with pytest.raises(TypeError):
        function(1024)


def test_buffers_allocate_on_the_requested_device() -> None:
    (buffer,) = init_staging_buffers(4096, device_type="cpu")
    assert buffer.device == torch.device("cpu") and buffer.nbytes == 4096
    assert buffer.view(100, 50).numel() == 50
    with pytest.raises(ValueError, match="outside a staging buffer of 4096 bytes"):
        buffer.view(4090, 10)
    ring = init_staging_allocator(1 << 20, device_type="cpu")
    assert ring.buffer.nbytes == ring.allocator.capacity == 1 << 20


def test_gather_stream_is_lazy_and_producer_stream_is_resolved_per_call(monkeypatch) -> None:
    (buffer,) = init_staging_buffers(64, device_type="cpu")
    assert not buffer.has_gather_stream  # decode-side buffers never create one
    buffer.gather_stream()
    assert buffer.has_gather_stream
    calls: list[str] = []
    monkeypatch.setattr(
        dev,
        "current_device_stream",
        lambda device: (
            calls.append(threading.current_thread().name) or threading.current_thread().name
        ),
    )
    assert buffer.producer_stream() == threading.current_thread().name
    worker = threading.Thread(
        target=lambda: calls.append(buffer.producer_stream()), name="transfer-worker"
    )
    worker.start()
    worker.join()
    assert calls[-1] == "transfer-worker"  # not a value cached from the first thread
