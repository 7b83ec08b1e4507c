"""The staging kernels on a real accelerator (CUDA or XPU). Skipped where there is none."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdctl.staging import device as dev
from pdctl.staging.buffer import init_staging_allocator
from pdctl.staging.handler import DecodeStagingHandler
from pdctl.staging.layout import Segment, StagingLayout, head_slices
from tests.staging.kv_factory import random_kv
from tests.staging.test_kernels import DTYPES, SPLITS, run_case


def accelerator() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    return None


DEVICE = accelerator()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="no CUDA or XPU device on this machine"),
]

GRID = list(itertools.product([1, 16, 64], [1, 3, 61], SPLITS, DTYPES))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(("page_size", "layers", "split", "dtype"), GRID)
def test_bitwise_on_the_accelerator(backend, page_size, layers, split, dtype) -> None:
    run_case(
        backend,
        layers,
        page_size,
        split,
        dtype,
        seed=page_size + layers,
        head_dim=32 if layers < 61 else 8,
        device=f"{DEVICE}:0",
    )


def test_scatter_orders_after_the_rooms_event_on_real_streams() -> None:
    if DEVICE != "cuda":
        pytest.skip("the long-kernel ordering check uses torch.cuda._sleep")
    device = torch.device(DEVICE, 0)
    k, v = random_kv(2, 64, 2, 8, torch.bfloat16, seed=1, device=device)
    layout = StagingLayout(2, 8, 2, head_slices(4, 1, 2, 0))
    ring = init_staging_allocator(1 << 16, device_type=DEVICE, gpu_id=0)
    handler = DecodeStagingHandler(k, v, page_size=4, ring=ring, layout=layout)
    scheduler = dev.create_device_stream(device)
    segment = Segment(0, 0, 2)
    handler.open_room(0, torch.tensor([2, 3], device=device), scheduler)  # warm-up: compile
    handler.scatter(0, handler.assign_region(0, segment), segment)
    handler.close_room(0)
    pages = torch.tensor([0, 1], device=device)  # ids already on the device: no host copy
    region = ring.allocator.assign(layout.region_bytes(8))
    ring.allocator.free(region)
    ring.view(region).fill_(7)  # the transport's bytes, landed before the notice
    dev.synchronize(device)
    with dev.device_stream_context(scheduler):
        torch.cuda._sleep(
            2_000_000_000
        )  # cuda-only: about a second of work on the scheduler stream
        handler.open_room(1, pages, scheduler)  # records the room's event after it
    region = handler.assign_region(1, segment)
    handler.scatter(1, region, segment)
    assert handler.has_inflight(1)  # waits on the room's event, so still pending
    handler.close_room(1)  # drains the scatter stream, then frees
    assert not handler.rooms and ring.allocator.is_empty
    assert (k[0][0:8].view(torch.uint8) == 7).all()
