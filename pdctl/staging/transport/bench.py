"""Transport benchmark: each backend cross-process on loopback, beside a copy ceiling.

For every size, a peer process (`peer.py`) holds the destination; this process
writes from registered memory and times each write to completion (the bytes are in
the peer's memory). GB/s is size / median latency; p50 and p99 latencies are
reported, and the very first write (connections, mappings) separately. After the
timed writes the peer hashes what it received, so every row carries a consistency
check. Memory is the device's on both sides (`--device`); the ceiling is the same
bytes copied in one process, measured in the same run: a memcpy on the CPU, the
device's own copy elsewhere.
"""

from __future__ import annotations

import ctypes
import hashlib
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, TypedDict, cast

import numpy as np
import torch

from pdctl.staging import device as dev
from pdctl.staging.transport import TransportConfig, TransportError, create_transport
from pdctl.staging.transport.peer import PeerProcess

KIB, MIB = 1 << 10, 1 << 20
SIZES = (4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB)
BATCH = (1024, 4 * KIB)  # descriptors x bytes each
VARIANTS = {  # label -> (backend, same-host fast path)
    "tcp (same-host direct)": ("tcp", True),
    "tcp (socket)": ("tcp", False),
    "mooncake (tcp)": ("mooncake", True),
    "nixl (ucx)": ("nixl", True),
}
SECRET = b"pdctl-bench"


class RowJson(TypedDict):
    """A `Row` as JSON, field for field."""

    variant: str
    label: str
    nbytes: int
    gbps: float
    p50_ms: float
    p99_ms: float
    consistent: bool
    first_ms: float | None
    connect_ms: float | None


class Targets(TypedDict, total=False):
    """The issue's targets, each a ratio of two rows of a run (`targets`)."""

    size: str
    direct_vs_best_library: float
    direct_vs_memcpy: float
    p50_4k_vs_nixl: float
    direct_256m_gbps: float
    direct_vs_nixl_256m: float
    first_256m_gbps: float


class TransportBenchReport(TypedDict):
    """`pdctl bench transport`'s report: a row per variant and size, the targets."""

    device: str
    rows: list[RowJson]
    unavailable: dict[str, str]  # variant -> why it was not measured
    targets: Targets


@dataclass(frozen=True)
class Row:
    variant: str
    label: str  # size, or "1024 x 4 KiB"
    nbytes: int
    gbps: float
    p50_ms: float
    p99_ms: float
    consistent: bool
    first_ms: float | None = None  # the very first write (connections, IPC mappings)
    connect_ms: float | None = None  # a first-write row: the connect before it

    def to_json(self) -> RowJson:
        return cast(RowJson, asdict(self))  # the same fields, in the same order


def _label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def _iterations(nbytes: int, budget_bytes: int) -> int:
    return max(5, min(200, budget_bytes // max(nbytes, 1)))


def _summary(variant: str, label: str, nbytes: int, latencies: list[float], ok: bool) -> Row:
    ordered = sorted(latencies)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    gbps, p50_ms, p99_ms = round(nbytes / p50 / 1e9, 3), round(p50 * 1e3, 4), round(p99 * 1e3, 4)
    return Row(variant, label, nbytes, gbps, p50_ms, p99_ms, ok)


def memcpy_rows(sizes: tuple[int, ...], budget_bytes: int) -> list[Row]:
    rows = []
    source = np.random.default_rng(1).integers(0, 256, max(sizes), dtype=np.uint8)
    target = np.ones_like(source)  # pages touched
    for size in sizes:
        latencies = []
        for _ in range(_iterations(size, budget_bytes)):
            start = time.perf_counter()
            ctypes.memmove(target.ctypes.data, source.ctypes.data, size)
            latencies.append(time.perf_counter() - start)
        ok = bool(np.array_equal(source[:size], target[:size]))
        rows.append(_summary("memcpy (ceiling)", _label(size), size, latencies, ok))
    return rows


def device_copy_rows(device: str, sizes: tuple[int, ...], budget_bytes: int) -> list[Row]:
    """The device's own copy of the same bytes, in this process: the ceiling there."""
    target_device = torch.device(device)
    source = _random_bytes(max(sizes), target_device, seed=1)
    target = torch.ones_like(source)
    rows = []
    for size in sizes:
        latencies = []
        for _ in range(_iterations(size, budget_bytes) + 2):
            start = time.perf_counter()
            target[:size].copy_(source[:size])
            dev.synchronize(target_device)
            latencies.append(time.perf_counter() - start)
        ok = bool(torch.equal(source[:size], target[:size]))
        rows.append(_summary("device copy (ceiling)", _label(size), size, latencies[2:], ok))
    return rows


def _random_bytes(size: int, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).to(device)


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()


def variant_rows(
    variant: str, sizes: tuple[int, ...], budget_bytes: int, device: str = "cpu"
) -> list[Row]:
    """`variant` writing from `device` memory here into `device` memory of a peer."""
    backend, fast = VARIANTS[variant]
    capacity = max(max(sizes), BATCH[0] * BATCH[1] * 2)
    source = _random_bytes(capacity, torch.device(device), seed=2)  # [capacity] bytes
    rows = []
    with PeerProcess(
        backend, capacity, device=device, name="bench-peer", fast_path=fast, secret=SECRET
    ) as peer:
        writer = create_transport(
            backend, TransportConfig("bench-writer", secret=SECRET, same_host_fast_path=fast)
        )
        try:
            writer.register_tensor(source)
            connection = writer.connect(peer.description)
            base = source.data_ptr()
            for index, size in enumerate(sizes):
                src, dst, lengths = [base], [peer.base], [size]
                first = time.perf_counter()
                writer.write(connection, src, dst, lengths)  # the first: mappings, first touch
                first_ms = (time.perf_counter() - first) * 1e3
                writer.write(connection, src, dst, lengths)
                latencies = []
                for _ in range(_iterations(size, budget_bytes)):
                    start = time.perf_counter()
                    writer.write(connection, src, dst, lengths)
                    latencies.append(time.perf_counter() - start)
                ok = peer.sha256(0, size) == _sha(source[:size])
                row = _summary(variant, _label(size), size, latencies, ok)
                rows.append(replace(row, first_ms=round(first_ms, 4) if index == 0 else None))
            rows.append(_batch_row(variant, writer, connection, peer, source, budget_bytes))
        finally:
            writer.close()
        rows.append(_first_row(variant, peer, source, min(FIRST_SIZE, max(sizes))))
    return rows


FIRST_SIZE = 256 * MIB


def _first_row(variant: str, peer: PeerProcess, source: torch.Tensor, size: int) -> Row:
    """A fresh endpoint's first write of `size` bytes right after it connects: what the
    first request of a new peer pays (registrations and mappings happen at connect)."""
    backend, fast = VARIANTS[variant]
    writer = create_transport(
        backend, TransportConfig("bench-first", secret=SECRET, same_host_fast_path=fast)
    )
    try:
        writer.register_tensor(source)
        started = time.perf_counter()
        connection = writer.connect(peer.description)
        connect_ms = (time.perf_counter() - started) * 1e3
        peer.command(cmd="fill", value=0)
        started = time.perf_counter()
        writer.write(connection, [source.data_ptr()], [peer.base], [size])
        seconds = time.perf_counter() - started
        ok = peer.sha256(0, size) == _sha(source[:size])
    finally:
        writer.close()
    row = _summary(variant, f"{_label(size)}, first", size, [seconds], ok)
    return replace(row, connect_ms=round(connect_ms, 3))


def _batch_row(
    variant: str,
    writer: Any,
    connection: Any,
    peer: PeerProcess,
    source: torch.Tensor,
    budget_bytes: int,
) -> Row:
    """1024 scattered 4 KiB pieces in one write (page-sized KV writes)."""
    count, each = BATCH
    base = np.uint64(source.data_ptr())
    order = np.random.default_rng(3).permutation(2 * count)[:count].astype(np.uint64)
    src = base + np.arange(count, dtype=np.uint64) * np.uint64(each)
    dst = np.uint64(peer.base) + order * np.uint64(each)
    lengths = np.full(count, each, dtype=np.uint64)
    for _ in range(2):
        writer.write(connection, src, dst, lengths)
    latencies = []
    for _ in range(_iterations(count * each, budget_bytes)):
        start = time.perf_counter()
        writer.write(connection, src, dst, lengths)
        latencies.append(time.perf_counter() - start)
    ok = all(
        peer.sha256(int(slot) * each, each) == _sha(source[i * each : (i + 1) * each])
        for i, slot in enumerate(order[:16].tolist())
    )
    return _summary(variant, f"{count} x {_label(each)}", count * each, latencies, ok)


def run_transport_bench(
    variants: list[str] | None = None,
    sizes: tuple[int, ...] = SIZES,
    budget_bytes: int = 2 << 30,
    device: str = "cpu",
) -> TransportBenchReport:
    chosen = variants or list(VARIANTS)
    if device == "cpu":
        rows = memcpy_rows(sizes, budget_bytes)
    else:
        rows = device_copy_rows(device, sizes, budget_bytes)
    unavailable: dict[str, str] = {}
    for variant in chosen:
        try:
            rows += variant_rows(variant, sizes, budget_bytes, device)
        except (TransportError, ConnectionError, TimeoutError) as exc:
            unavailable[variant] = str(exc).splitlines()[0][:300]
    return {
        "device": device,
        "rows": [row.to_json() for row in rows],
        "unavailable": unavailable,
        "targets": targets(rows),
    }


def targets(rows: list[Row], size: int = 64 * MIB) -> Targets:
    """The issue's targets, each a ratio of two rows of this run (absent rows: absent).

    At `size`: the builtin same-host path against the faster of Mooncake and NIXL
    (>= 1.5x) and against the copy ceiling; at 4 KiB its p50 against NIXL's (<= 1);
    at 256 MiB its GB/s against NIXL's and, for a fresh endpoint's first write, in GB/s.
    """
    direct_name = "tcp (same-host direct)"
    by = {(row.variant, row.label): row for row in rows}
    at = {row.variant: row.gbps for row in rows if row.label == _label(size)}
    direct = at.get(direct_name)
    libraries = [at[v] for v in ("mooncake (tcp)", "nixl (ucx)") if v in at]
    ceiling = at.get("memcpy (ceiling)") or at.get("device copy (ceiling)")
    result: Targets = {"size": _label(size)}
    if direct and libraries:
        result["direct_vs_best_library"] = round(direct / max(libraries), 2)
    if direct and ceiling:
        result["direct_vs_memcpy"] = round(direct / ceiling, 2)
    small = by.get((direct_name, "4 KiB")), by.get(("nixl (ucx)", "4 KiB"))
    if small[0] and small[1]:
        result["p50_4k_vs_nixl"] = round(small[0].p50_ms / small[1].p50_ms, 2)
    large = by.get((direct_name, "256 MiB")), by.get(("nixl (ucx)", "256 MiB"))
    if large[0]:
        result["direct_256m_gbps"] = large[0].gbps
        if large[1]:
            result["direct_vs_nixl_256m"] = round(large[0].gbps / large[1].gbps, 2)
    first = by.get((direct_name, "256 MiB, first"))
    if first:
        result["first_256m_gbps"] = first.gbps
    return result
