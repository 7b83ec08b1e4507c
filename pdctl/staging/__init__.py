"""The embedded staging library: device-agnostic KV staging between prefill and decode.

Gathers each decode rank's KV head slice of every layer into one contiguous buffer
so a transport moves it in one write, and scatters it into the decode KV pool.
Runs on CPU, CUDA, XPU, NPU or any torch device. Imports nothing else from pdctl:
only torch, numpy, and optionally triton and transport libraries.
"""

from pdctl.staging.allocator import Region, RegionTooLarge, RingAllocator, Watermark
from pdctl.staging.buffer import (
    StagingBuffer,
    StagingRing,
    init_staging_allocator,
    init_staging_buffers,
)
from pdctl.staging.digest import block_digests, chunk_digests
from pdctl.staging.kernels import gather_all_layers_to_staging, scatter_staging_to_kv
from pdctl.staging.layout import (
    HeadSlice,
    Segment,
    StagingLayout,
    head_slices,
    plan_segments,
    writers_of,
)

__all__ = [
    "HeadSlice",
    "Region",
    "RegionTooLarge",
    "RingAllocator",
    "Segment",
    "StagingBuffer",
    "StagingLayout",
    "StagingRing",
    "Watermark",
    "block_digests",
    "chunk_digests",
    "gather_all_layers_to_staging",
    "head_slices",
    "init_staging_allocator",
    "init_staging_buffers",
    "plan_segments",
    "scatter_staging_to_kv",
    "writers_of",
]
