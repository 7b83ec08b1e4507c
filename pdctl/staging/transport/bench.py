"""Transport benchmark: each backend cross-process on loopback, beside a memcpy ceiling.

For every size, a peer process (`peer.py`) holds the destination; this process
writes from registered memory and times each write to completion (the bytes are in
the peer's memory). GB/s is size / median latency; p50 and p99 latencies are
reported. After the timed writes the peer hashes what it received, so every row
carries a consistency check. The ceiling is a single-process memcpy of the same
bytes, measured in the same run.
"""

from __future__ import annotations

import ctypes
import hashlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

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


@dataclass(frozen=True)
class Row:
    variant: str
    label: str  # size, or "1024 x 4 KiB"
    nbytes: int
    gbps: float
    p50_ms: float
    p99_ms: float
    consistent: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def _iterations(nbytes: int, budget_bytes: int) -> int:
    return max(5, min(200, budget_bytes // max(nbytes, 1)))


def _summary(variant: str, label: str, nbytes: int, latencies: list[float], ok: bool) -> Row:
    ordered = sorted(latencies)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return Row(
        variant,
        label,
        nbytes,
        round(nbytes / p50 / 1e9, 3),
        round(p50 * 1e3, 4),
        round(p99 * 1e3, 4),
        ok,
    )


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


def variant_rows(variant: str, sizes: tuple[int, ...], budget_bytes: int) -> list[Row]:
    backend, fast = VARIANTS[variant]
    capacity = max(max(sizes), BATCH[0] * BATCH[1] * 2)
    source = np.random.default_rng(2).integers(0, 256, capacity, dtype=np.uint8)
    rows = []
    with PeerProcess(backend, capacity, name="bench-peer", fast_path=fast, secret=SECRET) as peer:
        writer = create_transport(
            backend, TransportConfig("bench-writer", secret=SECRET, same_host_fast_path=fast)
        )
        try:
            writer.register(source.ctypes.data, source.nbytes)
            connection = writer.connect(peer.description)
            base = np.uint64(source.ctypes.data)
            for size in sizes:
                src, dst, lengths = [int(base)], [peer.base], [size]
                for _ in range(2):  # warm-up: connections, first touch
                    writer.write(connection, src, dst, lengths)
                latencies = []
                for _ in range(_iterations(size, budget_bytes)):
                    start = time.perf_counter()
                    writer.write(connection, src, dst, lengths)
                    latencies.append(time.perf_counter() - start)
                expected = hashlib.sha256(source[:size].tobytes()).hexdigest()
                ok = peer.sha256(0, size) == expected
                rows.append(_summary(variant, _label(size), size, latencies, ok))
            count, each = BATCH
            order = np.random.default_rng(3).permutation(2 * count)[:count].astype(np.uint64)
            src_b = base + np.arange(count, dtype=np.uint64) * np.uint64(each)
            dst_b = np.uint64(peer.base) + order * np.uint64(each)
            lengths_b = np.full(count, each, dtype=np.uint64)
            for _ in range(2):
                writer.write(connection, src_b, dst_b, lengths_b)
            latencies = []
            for _ in range(_iterations(count * each, budget_bytes)):
                start = time.perf_counter()
                writer.write(connection, src_b, dst_b, lengths_b)
                latencies.append(time.perf_counter() - start)
            received = bytearray(2 * count * each)
            for i, slot in enumerate(order.tolist()):
                received[slot * each : (slot + 1) * each] = source[
                    i * each : (i + 1) * each
                ].tobytes()
            ok = all(
                peer.sha256(int(slot) * each, each)
                == hashlib.sha256(
                    bytes(received[int(slot) * each : (int(slot) + 1) * each])
                ).hexdigest()
                for slot in order[:16].tolist()
            )
            rows.append(_summary(variant, f"{count} x {_label(each)}", count * each, latencies, ok))
        finally:
            writer.close()
    return rows


def run_transport_bench(
    variants: list[str] | None = None,
    sizes: tuple[int, ...] = SIZES,
    budget_bytes: int = 2 << 30,
) -> dict[str, Any]:
    chosen = variants or list(VARIANTS)
    rows = memcpy_rows(sizes, budget_bytes)
    unavailable: dict[str, str] = {}
    for variant in chosen:
        try:
            rows += variant_rows(variant, sizes, budget_bytes)
        except (TransportError, ConnectionError, TimeoutError) as exc:
            unavailable[variant] = str(exc).splitlines()[0][:300]
    return {
        "rows": [row.to_json() for row in rows],
        "unavailable": unavailable,
        "targets": targets(rows),
    }


def targets(rows: list[Row], size: int = 64 * MIB) -> dict[str, Any]:
    """The issue's targets at 64 MiB: direct >= 1.5x best library, >= 0.3x memcpy."""
    at = {row.variant: row.gbps for row in rows if row.label == _label(size)}
    direct = at.get("tcp (same-host direct)")
    libraries = [at[v] for v in ("mooncake (tcp)", "nixl (ucx)") if v in at]
    ceiling = at.get("memcpy (ceiling)")
    result: dict[str, Any] = {"size": _label(size)}
    if direct and libraries:
        result["direct_vs_best_library"] = round(direct / max(libraries), 2)
    if direct and ceiling:
        result["direct_vs_memcpy"] = round(direct / ceiling, 2)
    return result
